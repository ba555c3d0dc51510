"""Shared by the benchmark scripts: machine description, repeated timing, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path


def machine_info() -> dict:
    """CPU model, cores, RAM and library versions, recorded with every result."""
    import h5py
    import lmdb
    import numpy
    import PIL
    import torch
    import torchvision

    from dlstore.tuning import usable_cpus

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = None
    return {
        "cpu": cpu, "logical_cpus": os.cpu_count(), "usable_cpus": usable_cpus(),
        "ram_bytes": mem, "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "torchvision": torchvision.__version__, "numpy": numpy.__version__,
        "pillow": PIL.__version__, "lmdb": lmdb.__version__, "h5py": h5py.__version__,
        "cuda": torch.cuda.is_available(),
    }


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
