"""Shared by the benchmark scripts: machine description, repeated timing, JSON output."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from dlstore._system import machine_info  # noqa: F401 - re-exported: one copy, shared with `dlstore bench`


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
