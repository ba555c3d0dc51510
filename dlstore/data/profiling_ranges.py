"""Named ranges in a ``torch.profiler`` trace: ``profiling_range("my.stage")``.

dlstore marks its own loader stages with it, once per batch (never per sample):

- ``dlstore.build_batch``: a thread loader's batch, in its builder thread (read + host transforms);
- ``dlstore.read``: the store read of a batch (``StoreDataset.get_batch``);
- ``dlstore.host_transforms``: per-sample and batch transforms on the host;
- ``dlstore.copy_to_device``: the host-to-device copy (the device stage of ``dlstore.loader(device=)``);
- ``dlstore.device_transforms``: float conversion, normalisation, random ops on the device;
- ``dlstore.wait_for_data`` / ``dlstore.step``: ``profile_loader``'s phases of the loop.

With no profiler running a range costs a few microseconds (``torch.profiler.record_function``
checks whether anyone listens); measured by ``range_overhead``.
"""

from __future__ import annotations

import time

import torch

__all__ = ["profiling_range", "range_overhead"]


def profiling_range(name: str) -> torch.profiler.record_function:
    """A context manager (and decorator) naming what runs inside it in a ``torch.profiler`` trace.

    ::

        with dlstore.profiling_range("my.augment"):
            x = augment(x)
    """
    return torch.profiler.record_function(name)


def range_overhead(rounds: int = 2000) -> float:
    """Seconds one ``profiling_range`` costs when no profiler is running (the mean of ``rounds``)."""
    start = time.perf_counter()
    for _ in range(rounds):
        with profiling_range("dlstore.overhead"):
            pass
    return (time.perf_counter() - start) / rounds
