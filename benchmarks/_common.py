"""Shared by the benchmark scripts: machine description, load, repeated timing, JSON output."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType

import torch

from dlstore.tools.bench.probes import machine_info  # noqa: F401 - re-exported: one copy, shared with `dlstore bench`

GPU_CHECK = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def repeat(fn: Callable[[], int], repeats: int, warmup: int = 1) -> dict:
    """Run ``fn`` (returns items processed) ``warmup + repeats`` times; items/s statistics."""
    for _ in range(warmup):
        fn()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        n = fn()
        rates.append(n / (time.perf_counter() - start))
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "runs": rates}


def write_json(path: str | os.PathLike, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    return path


def uptime() -> str:
    """``uptime``'s line (the load averages: this machine is shared)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


def load_gpu_check() -> ModuleType:
    """``scripts/gpu_check.py`` as a module (``scripts/`` is not a package: loaded from its file)."""
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA); nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_epochs(loader: Iterable, device: torch.device, epochs: int) -> list[float]:
    """Seconds of each of ``epochs`` full passes over ``loader`` (batches discarded, device synced)."""
    times = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        for _images, _labels in loader:
            pass
        sync(device)
        times.append(time.perf_counter() - t0)
    return times
