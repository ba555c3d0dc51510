"""Named ranges in a ``torch.profiler`` trace: ``profiling_range("my.stage")``.

dlstore marks its own loader stages with it, once per batch (never per sample):

- ``dlstore.build_batch``: a thread loader's batch, in its builder thread (read + host transforms);
- ``dlstore.read``: the store read of a batch (``StoreDataset.get_batch``);
- ``dlstore.host_transforms``: per-sample and batch transforms on the host;
- ``dlstore.copy_to_device``: the host-to-device copy (the device stage of ``dlstore.loader(device=)``);
- ``dlstore.device_transforms``: float conversion, normalisation, random ops on the device;
- ``dlstore.wait_for_data`` / ``dlstore.step``: ``profile_loader``'s phases of the loop.

A range is ``torch.profiler.record_function`` while a profiler runs and nothing otherwise:
torch's own enters a dispatcher op even with nobody listening, and each op lets go of the GIL
and waits to take it back, six times a batch in a loader thread beside another (4-9 % of a
thread loader's rate on 2 cores, docs/reading.md). "A profiler runs" is torch's flag, set by
``torch.profiler.profile``, ``emit_nvtx`` and ``emit_itt``; the deprecated ``profiler_legacy``
and an on-demand Kineto trace started from outside (dynolog) do not set it, and see no ranges.
``range_overhead`` measures what one costs.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.profiler as _autograd_profiler

__all__ = ["profiling_range", "range_overhead"]


def _listening() -> bool:
    # torch's flag "for fast python checks", set while any of its profilers runs (True where a
    # torch without it cannot say: then every range is recorded, as before)
    return bool(getattr(_autograd_profiler, "_is_profiler_enabled", True))


class profiling_range:  # noqa: N801 - used like torch's record_function, which it wraps
    """A context manager (and decorator) naming what runs inside it in a ``torch.profiler`` trace.

    ::

        with dlstore.profiling_range("my.augment"):
            x = augment(x)
    """

    __slots__ = ("name", "_open")

    def __init__(self, name: str):
        self.name = name
        self._open = threading.local()     # per thread, a stack: one range may be entered again inside itself

    def __enter__(self) -> profiling_range:
        record = None
        if _listening():
            record = torch.profiler.record_function(self.name)
            record.__enter__()
        stack = getattr(self._open, "stack", None)
        if stack is None:
            stack = self._open.stack = []
        stack.append(record)
        return self

    def __exit__(self, *exc: Any) -> None:
        record = self._open.stack.pop()
        if record is not None:
            record.__exit__(*exc)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        name = self.name

        @functools.wraps(fn)
        def ranged(*args: Any, **kwargs: Any) -> Any:
            with profiling_range(name):    # decided per call: a profiler may start after decoration
                return fn(*args, **kwargs)
        return ranged


def range_overhead(rounds: int = 2000) -> float:
    """Seconds one ``profiling_range`` costs (the mean of ``rounds``), with or without a profiler."""
    start = time.perf_counter()
    for _ in range(rounds):
        with profiling_range("dlstore.overhead"):
            pass
    return (time.perf_counter() - start) / rounds
