"""One timed pass of ``dlstore bench`` over a store or the image folder, in a stated cache state.

Every run builds a fresh loader. Its workers start, then wait at a gate (``_Gate``) until all of
them are up; the clock starts when the gate opens, so worker start-up (reported apart) is not
counted as reading. Before a cold run the files are evicted (and the eviction measured); before a
warm run they are read whole (and the residency measured).
"""

from __future__ import annotations

import gc
import multiprocessing
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import MeasurementError
from .options import WARM_RESIDENT_MIN
from .probes import IO_BLOCK, evict, resident_fraction

_GATE_TIMEOUT = 120.0




class _Gate:
    """Holds DataLoader workers after start-up until the clock starts (``worker_init_fn``)."""

    def __init__(self, ctx: Any):
        self.ready = ctx.Semaphore(0)
        self.go = ctx.Event()

    def __call__(self, worker_id: int) -> None:  # noqa: ARG002 - DataLoader's signature
        self.ready.release()
        if not self.go.wait(_GATE_TIMEOUT):
            raise MeasurementError(f"dlstore bench: the timing gate did not open within {_GATE_TIMEOUT:.0f} s")

    def wait_ready(self, workers: int) -> None:
        deadline = time.monotonic() + _GATE_TIMEOUT
        for i in range(workers):
            if not self.ready.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise MeasurementError(f"dlstore bench: only {i} of {workers} DataLoader workers started within "
                                   f"{_GATE_TIMEOUT:.0f} s (machine overloaded, or workers dying at start-up)")


def imagefolder_dataset(folder: Path, spec: list[dict[str, Any]]) -> Any:
    from torchvision import datasets
    from torchvision.transforms import v2

    from ...transforms.static import to_torchvision

    return datasets.ImageFolder(str(folder), transform=v2.Compose(list(to_torchvision(spec)) + [v2.PILToTensor()]))


def _make_loader(dataset: Any, *, store: bool, shuffle: bool, workers: int, batch_size: int, seed: int,
                 gate: _Gate | None, backend: str) -> Any:
    import torch
    from torch.utils.data import DataLoader

    from ...data.loaders.loader import loader

    generator = torch.Generator().manual_seed(seed)
    if store:
        return loader(dataset, batch_size, shuffle=shuffle, num_workers=workers, generator=generator,
                      worker_init_fn=gate, backend=backend)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=workers, generator=generator,
                      worker_init_fn=gate)


def read_once(opener: Callable[[], Any], files: list[Path], *, store: bool, cache: str, order: str,
              workers: int, batch_size: int, seed: int, drop_caches: bool, backend: str = "auto") -> dict[str, Any]:
    """One timed pass over a dataset; evicts its files first when ``cache == "cold"``. A store is read
    through ``dlstore.loader(backend=backend)``, the image folder through torch's DataLoader; the run
    records the back-end that built the store's batches (None for the DataLoader)."""
    dataset = opener()  # before the eviction: reads the manifest/labels, maps no data
    resident = evict(files, drop_caches=drop_caches) if cache == "cold" else _warm(files)
    gate = _Gate(multiprocessing.get_context()) if workers > 0 else None
    loader = _make_loader(dataset, store=store, shuffle=order == "random", workers=workers,
                          batch_size=batch_size, seed=seed, gate=gate, backend=backend)
    start = time.perf_counter()
    it = iter(loader)
    gaps: list[float] = []
    sizes: list[int] = []
    try:
        if gate is not None:
            try:
                gate.wait_ready(workers)
            finally:
                t0 = time.perf_counter()
                gate.go.set()  # also on failure: no worker stays parked at the gate
        else:
            t0 = time.perf_counter()
        last = t0
        for batch in it:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            sizes.append(len(batch[1]))
        built_by = loader.backend if store else None   # after the pass: a ring may have fallen back
    finally:
        del it, loader, dataset  # shut the workers down and unmap the store before the next eviction
        gc.collect()
    return {"samples": sum(sizes), "seconds": last - t0, "startup_s": t0 - start, "batch_s": gaps,
            "batch_sizes": sizes, "workers": workers, "resident": resident, "backend": built_by}


def _warm(files: list[Path], attempts: int = 3) -> float:
    """Read ``files`` whole (a reader may never touch some pages, e.g. free LMDB pages), up to
    ``attempts`` times while memory pressure reclaims pages; the resident fraction measured last.
    Each warm run warms its own store: one warm-up for all leaves later runs to what was reclaimed."""
    for _ in range(attempts):
        _read_files(files)
        resident = resident_fraction(files)
        if resident >= WARM_RESIDENT_MIN:
            break
    return resident


def _read_files(files: list[Path]) -> None:
    """Read files whole (into the page cache)."""
    buf = bytearray(IO_BLOCK)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
