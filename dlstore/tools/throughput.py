"""Measuring a loader: steady-state batches/s over a time window, the unit ``tune`` searches with.

``measure_throughput(dataset, **kwargs)`` builds a fresh loader, discards the
start-up and the first ``num_workers + 1`` batches, then counts batches over a
fixed window, moving each batch to the device (and synchronising) when a device
is given, so the host-to-device copy is included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Trial:
    """One measured DataLoader configuration.

    Attributes:
        kwargs: the DataLoader keyword arguments measured (batch_size included).
        batches_per_s: steady-state batches per second after warm-up.
        samples_per_s: the same in samples.
        startup_s: from ``iter(loader)`` to the first batch (worker start-up and first fetch).
        batches: batches counted in the steady-state window.
        stage: which search stage ran it.
        note: remarks (slower than workers=0, skipped, ...).
    """

    kwargs: dict[str, Any]
    batches_per_s: float
    samples_per_s: float
    startup_s: float
    batches: int
    stage: str = ""
    note: str = ""

    @property
    def num_workers(self) -> int:
        return int(self.kwargs.get("num_workers", 0))

    @property
    def prefetch_factor(self) -> int:
        return int(self.kwargs.get("prefetch_factor") or 0)


def loader_kwargs(
    batch_size: int,
    num_workers: int,
    *,
    prefetch_factor: int = 2,
    pin_memory: bool = False,
    persistent_workers: bool = True,
) -> dict[str, Any]:
    """DataLoader kwargs for one configuration; worker-only options dropped when ``num_workers == 0``
    (the DataLoader refuses ``prefetch_factor`` and ``persistent_workers=True`` without workers)."""
    kwargs: dict[str, Any] = {"batch_size": batch_size, "num_workers": num_workers,
                              "pin_memory": pin_memory}
    if num_workers > 0:
        kwargs["prefetch_factor"] = prefetch_factor
        kwargs["persistent_workers"] = persistent_workers
    return kwargs


def uses_store_loader(kwargs: dict[str, Any]) -> bool:
    """Whether ``kwargs`` (as ``tune`` returns them) are for ``dlstore.loader``: they name a ``backend``."""
    return "backend" in kwargs


def build_loader(dataset: Any, kwargs: dict[str, Any], *, shuffle: bool = True, extra: dict[str, Any] | None = None,
                 store_loader: bool | None = None) -> Any:
    """The loader ``kwargs`` describe: ``dlstore.loader(dataset, **kwargs)`` or ``DataLoader(dataset, **kwargs)``.

    Args:
        dataset: the dataset to read.
        kwargs: loader keyword arguments, ``batch_size`` included.
        shuffle: a new random order every epoch.
        extra: DataLoader arguments not tuned (``collate_fn``, ``sampler``, ...); only ``drop_last``
            reaches ``dlstore.loader``.
        store_loader: True for ``dlstore.loader``, False for torch's ``DataLoader``; None decides as
            ``tune``'s kwargs mean it (``uses_store_loader``).
    """
    if store_loader is None:
        store_loader = uses_store_loader(kwargs)
    if store_loader:   # threads, worker processes writing into the ring, or its DataLoader back-end
        from ..data.loaders.loader import loader

        drop_last = bool((extra or {}).get("drop_last", False))
        return loader(dataset, shuffle=shuffle, drop_last=drop_last, **kwargs)
    from torch.utils.data import DataLoader

    if (extra or {}).get("sampler") is not None:
        shuffle = False   # the sampler orders the samples (DataLoader refuses both)
    return DataLoader(dataset, shuffle=shuffle, **kwargs, **(extra or {}))


def _move(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        return [_move(b, device, non_blocking) for b in batch]
    if isinstance(batch, dict):
        return {k: _move(v, device, non_blocking) for k, v in batch.items()}
    return batch


def nbytes_of(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.element_size() * batch.nelement()
    if isinstance(batch, (list, tuple)):
        return sum(nbytes_of(b) for b in batch)
    if isinstance(batch, dict):
        return sum(nbytes_of(v) for v in batch.values())
    return 0


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_throughput(
    dataset: Any,
    kwargs: dict[str, Any],
    *,
    seconds: float = 2.0,
    device: str | torch.device | None = None,
    warmup: int | None = None,
    min_batches: int = 5,
    max_seconds: float | None = None,
    shuffle: bool = True,
    extra: dict[str, Any] | None = None,
) -> Trial:
    """Steady-state throughput of ``DataLoader(dataset, shuffle=shuffle, **kwargs, **extra)``.

    With ``kwargs["backend"]`` it is ``dlstore.loader(dataset, shuffle=shuffle, **kwargs)``
    (``extra`` gives only ``drop_last`` then).

    Starts a fresh loader, skips the first ``warmup`` batches (default
    ``num_workers + 1``), then counts batches for ``seconds``, starting new
    epochs as needed (with the loader's own ``persistent_workers`` setting, so a
    restart between epochs is paid where it would be in training). With a
    ``device`` each batch is copied there (``non_blocking`` when pinned) and the
    device synchronised, so the copy is part of the time.

    Args:
        dataset: any map-style dataset.
        kwargs: DataLoader keyword arguments (``batch_size`` included).
        seconds: length of the steady-state window.
        device: where batches go, or None to stop at the host.
        warmup: batches discarded after start-up.
        min_batches: batches the window must count, however long that takes (up to
            ``max_seconds``): a rate over one or two batches is mostly noise.
        max_seconds: hard cap on the whole trial (default ``4 * seconds + 30``);
            a very slow loader is measured over whatever it delivered by then.
        shuffle: passed to the DataLoader (random access, as in training).
        extra: further DataLoader arguments not being tuned (``collate_fn``, ...).
    """
    dev = torch.device(device) if device is not None else None
    workers = int(kwargs.get("num_workers", 0))
    threads = int(kwargs.get("num_threads") or 0)
    warmup = workers + threads + 1 if warmup is None else warmup
    max_seconds = 4 * seconds + 30 if max_seconds is None else max_seconds
    non_blocking = bool(kwargs.get("pin_memory")) and dev is not None and dev.type == "cuda"
    loader = build_loader(dataset, kwargs, shuffle=shuffle, extra=extra)
    stamps: list[float] = []
    start = time.perf_counter()
    iterator = iter(loader)
    try:
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                iterator = iter(loader)
                continue
            if dev is not None:
                _move(batch, dev, non_blocking)
                _sync(dev)
            now = time.perf_counter()
            stamps.append(now)
            if len(stamps) > warmup + min_batches and now - stamps[warmup] >= seconds:
                break
            if now - start >= max_seconds and len(stamps) >= 2:
                break
    finally:
        # Shut the workers down now rather than at garbage collection.
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        del iterator, loader
    first = warmup if len(stamps) > warmup + 1 else 0
    counted = len(stamps) - 1 - first
    if counted > 0:
        rate = counted / (stamps[-1] - stamps[first])
    else:  # a single batch in the whole cap: the best we know
        rate = 1.0 / (stamps[0] - start)
    batch_size = int(kwargs.get("batch_size") or 1)
    return Trial(kwargs=dict(kwargs), batches_per_s=rate, samples_per_s=rate * batch_size,
                 startup_s=stamps[0] - start, batches=max(counted, 1))


# --------------------------------------------------------------------------- search
