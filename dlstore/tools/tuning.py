"""Loader settings found by measurement: ``tune(dataset, batch_size)``.

It measures steady-state batches/s of each setting the same way and returns the fastest as
``DataLoader(dataset, **kwargs)`` (or ``dlstore.loader(dataset, **kwargs)``) keyword arguments.
The search, within a time budget:

0. Warm-up: one untimed trial of ``num_workers=0``, so the baseline is not measured cold
   (the first pass over a store pays its page faults, lazy imports and kernel set-up).
1. Sweep: ``num_workers=0`` (the baseline), the loader this dataset gets by default (threads for a
   store they apply to, else as many workers as usable CPUs), then the rest:
   ``dlstore.loader(backend="threads", num_threads=t)`` for t = 1, 2, the usable CPUs (at most 8);
   ``num_workers`` 1, 2, 4, ... up to the usable CPUs and a little over; the shared-memory ring
   (``dlstore.loader(backend="ring", num_workers=w)``) for the same
   counts. Every setting is measured ``repeats`` times, round-robin; the baseline and the default
   always, the rest while the budget lasts. A setting is judged on its median, and only once
   measured ``repeats`` times: one lucky (or stalled) trial neither wins nor loses.
2. Refinement, each new setting ``repeats`` times round-robin: more workers while the highest
   count wins, the midpoints next to the best count, ``prefetch_factor`` 1/4/8, ``pin_memory``
   (CUDA targets only), ``persistent_workers=False`` (only when an epoch is shorter than a
   trial; otherwise ``True`` is kept and the start-up it saves per epoch reported).
3. Confirmation: the winner and the baseline measured in turn, in ``max(repeats, 5)`` pairs,
   with longer windows (a quarter of the budget). The speed-up claimed is the median of the
   pairs' ratios; a winner that is not faster than the baseline
   by more than the noise margin here is not recommended (the baseline is). So no setting is
   recommended without being compared with the baseline side by side.

Among settings within the noise margin of the fastest, the cheapest wins (fewer workers, fewer
threads, smaller prefetch). Each trial starts a fresh loader, discards its start-up and the first
``num_workers + num_threads + 1`` batches, then counts batches over a time window
(``throughput.measure_throughput``), moving each batch to the device when one is given.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from .._system import CpuInfo, cpu_info, memory_limit_bytes, usable_cpus
from ..errors import ArgumentError, StoreNotFoundError
from ..transforms import compiled
from ..units import human_bytes
from .oversubscription import check_threads
from .throughput import Trial, nbytes_of, loader_kwargs, measure_throughput
from .tune_result import UNCOUNTED, TuneResult
from .tune_search import NOISE, TuneSearch



def _worker_candidates(usable: int, max_workers: int | None) -> list[int]:
    """Coarse sweep: powers of two below ``usable``, ``usable`` itself and a little over it;
    with ``max_workers``, capped there, or extended to it by powers of two when it is higher."""
    over = usable + max(1, usable // 4)
    top = over if max_workers is None else max(1, max_workers)
    out = {n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n < max(usable, top)}
    out |= {usable, over, top}
    return sorted(n for n in out if 1 <= n <= top and (n <= over or n & (n - 1) == 0 or n == top))


def tune(
    dataset: Any,
    batch_size: int,
    *,
    device: str | torch.device | None = None,
    budget: float = 30.0,
    max_workers: int | None = None,
    shuffle: bool = True,
    noise: float = NOISE,
    repeats: int = 3,
    memory_warn_fraction: float = 0.1,
    loader_extra: dict[str, Any] | None = None,
    cpus: CpuInfo | None = None,
    log: Callable[[str], None] | None = None,
    threads: bool | None = None,
    measure: Callable[[dict[str, Any], float], Trial] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    fix_threads: bool | None = None,
) -> TuneResult:
    """Measure loader settings on ``dataset`` and return the fastest, confirmed beside the baseline.

    See the module docstring for the search (``tune_search.TuneSearch`` runs its steps). Many keyword options:
    what to search (workers, threads, repeats) and the seams tests replace (``measure``, ``clock``).

    Args:
        dataset: any map-style dataset (a ``StoreDataset``, an ``ImageFolder``, ...).
        batch_size: the batch size you train with (throughput depends on it).
        device: the training device (``"cuda"``, ``"cuda:1"``, ``"cpu"``); batches are copied
            there inside the timing, and ``pin_memory`` is searched only for CUDA.
        budget: seconds for the search (approximate: the warm-up, the baseline, the default loader
            and the confirmation always run, however short the budget).
        max_workers: cap on the worker counts tried (default: a little over the usable CPUs).
        shuffle: measure with random access, as in training.
        noise: relative margin under which two rates count as equal.
        repeats: measurements of each setting (its median decides); the confirmation runs
            ``max(repeats, 5)`` pairs.
        memory_warn_fraction: warn when ``workers x prefetch x batch bytes`` exceeds this
            fraction of the memory available to the process.
        loader_extra: DataLoader arguments that are not tuned (``collate_fn``, ``sampler``,
            ``drop_last`` ...); not part of the returned kwargs.
        cpus: override the CPU information (default: ``cpu_info()``).
        log: called with one line per finished trial (progress), e.g. ``print``.
        threads: measure ``dlstore.loader(backend="threads")`` and the ring too (None: for a StoreDataset they
            apply to).
        measure: ``measure(kwargs, seconds) -> Trial`` times one setting (default:
            ``measure_throughput`` on ``dataset``); tests give seeded fake timings.
        clock: the clock the budget is kept with (tests give a fake one with ``measure``).
        fix_threads: search with ``torch.set_num_threads(1)`` and recommend it (None: when a probe of
            this process's batch stack measures intra-op oversubscription, ``oversubscription.py``).

    Returns:
        A ``TuneResult``: a dict of loader kwargs carrying the trials, warnings and a ``table()``.

    Raises:
        ValueError: ``batch_size`` or ``repeats`` < 1, an empty dataset, or a non-positive budget.
    """
    if batch_size < 1:
        raise ArgumentError(f"batch_size must be >= 1, got {batch_size}")
    if budget <= 0:
        raise ArgumentError(f"budget must be a positive number of seconds, got {budget}")
    if repeats < 1:
        raise ArgumentError(f"repeats must be >= 1, got {repeats}")
    if len(dataset) == 0:
        raise ArgumentError("cannot tune on an empty dataset (len(dataset) == 0)")
    dev = torch.device(device) if device is not None else None
    cpus = cpus or cpu_info()
    thread_counts = _thread_candidates(dataset, cpus.usable) if threads is not False else []
    if threads and not thread_counts:
        raise ArgumentError("tune(threads=True) needs a fixed-shape StoreDataset (dlstore.open_dataset)")
    if measure is None:
        def measure(kwargs: dict[str, Any], seconds: float) -> Trial:
            with warnings.catch_warnings():
                # Oversubscribing the CPUs is deliberate here; DataLoader would warn about it.
                warnings.filterwarnings("ignore", message="This DataLoader will create")
                return measure_throughput(dataset, kwargs, seconds=seconds, device=dev, shuffle=shuffle,
                                          extra=loader_extra, max_seconds=4 * seconds + 10)

    batch, batch_bytes = _one_batch(dataset, batch_size, loader_extra)
    thread_check = _thread_check(batch, 0)
    # Oversubscribed (measured): the baseline's collate stalls at random, so its rate, the
    # denominator of every claim, would not reproduce. Search with the fix, and recommend it.
    one_thread = bool(thread_check is not None and thread_check.measured) if fix_threads is None else fix_threads
    search = TuneSearch(measure, clock, budget=budget, repeats=repeats, noise=noise, log=log,
                     batch_size=batch_size, cuda=dev is not None and dev.type == "cuda",
                     workers=_worker_candidates(cpus.usable, max_workers), thread_counts=thread_counts,
                     usable=cpus.usable, max_workers=max_workers, batches_per_epoch=math.ceil(len(dataset) / batch_size))
    threads_before = torch.get_num_threads()
    with _intra_op_threads(1 if one_thread else None):
        best = search.sweep()
        best = search.refine(best)
        best = search.confirm(best)
    notes = search.notes
    if one_thread:
        notes.append((thread_check.message() if thread_check is not None and thread_check.message() else
                      "torch.set_num_threads(1) asked for") + f"; measured with torch.set_num_threads(1) (was "
                     f"{threads_before}), every setting and the baseline alike: the recommendation includes it")
    elif thread_check is not None and thread_check.message():
        notes.append(thread_check.message())
    best_trial = [t for t in search.trials if t.kwargs == best and t.stage not in UNCOUNTED][-1]
    notes += _memory_notes(best_trial, batch_bytes, memory_warn_fraction)
    if getattr(dataset, "fuses_crop_flip", False) and not compiled.available():
        notes.append(f"the random crop/flip ran the pure-numpy kernel ({compiled.unavailable_reason()}); "
                     "the compiled one reads ~2x faster with threads (docs/reading.md)")
    if search.persist_note:
        best_trial.note = (best_trial.note + "; " if best_trial.note else "") + search.persist_note
    baseline = next(t for t in search.trials if t.stage == "baseline")
    return TuneResult(best_trial.kwargs, trials=search.trials, best=best_trial, baseline=baseline,
                      batch_bytes=batch_bytes, warnings=notes, cpus=cpus, device=str(dev) if dev is not None else None,
                      thread_check=thread_check, one_thread=one_thread)


def _memory_notes(best: Trial, batch_bytes: int, fraction: float) -> list[str]:
    """A warning when the recommendation keeps more than ``fraction`` of the memory in batches."""
    in_flight = best.num_workers * max(best.prefetch_factor, 1) * batch_bytes
    limit = memory_limit_bytes()
    if not (best.num_workers and limit and in_flight > fraction * limit):
        return []
    return [f"memory-heavy: {best.num_workers} workers x prefetch {best.prefetch_factor} x "
            f"{human_bytes(batch_bytes)} per batch = {human_bytes(in_flight)} of batches in flight "
            f"({in_flight / limit:.0%} of {human_bytes(limit)} available"
            f"{', plus pinned copies' if best.kwargs.get('pin_memory') else ''}); "
            "lower prefetch_factor or num_workers if memory is short"]


def _thread_check(batch: Any, extra: int) -> Any:
    """The oversubscription check, measured on the samples of one real batch (None if it has no tensors)."""
    images = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    if not isinstance(images, torch.Tensor) or images.dim() < 1:
        return None
    return check_threads(extra_processes=extra, samples=list(images.unbind(0)))


@contextlib.contextmanager
def _intra_op_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` inside (None: unchanged), restored after."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _thread_candidates(dataset: Any, usable: int) -> list[int]:
    """1, 2 and the usable CPUs (at most 8), for a StoreDataset that threads apply to; else none."""
    from ..data.dataset import StoreDataset
    from ..data.loaders.options import MAX_AUTO_THREADS

    top = max(1, min(usable, MAX_AUTO_THREADS))
    return sorted({1, min(2, top), top}) if isinstance(dataset, StoreDataset) and dataset.threads_apply else []


def _one_batch(dataset: Any, batch_size: int, extra: dict[str, Any] | None) -> tuple[Any, int]:
    """One collated batch, fetched in this process, and its bytes."""
    from torch.utils.data import DataLoader

    extra = {k: v for k, v in (extra or {}).items() if k in ("collate_fn",)}
    batch = next(iter(DataLoader(dataset, batch_size=batch_size, num_workers=0, **extra)))
    return batch, nbytes_of(batch)


def open_for_tuning(
    path: str | os.PathLike,
    *,
    static: str | Iterable[dict[str, Any]] | None = None,
    transform: Any = None,
) -> Any:
    """A dataset to tune from a path: a dlstore store via ``open_dataset``, or a raw image
    folder via torchvision ``ImageFolder`` with ``static`` applied per sample then
    ``PILToTensor`` (your current pipeline, decode included); ``transform`` (read-time, random
    ops) after them.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: ``static`` given for a store (its static ops already ran at conversion),
            or an invalid spec.
    """
    from .. import formats
    from ..errors import UnknownFormatError

    p = Path(path)
    if not p.exists():
        raise StoreNotFoundError(f"{path}: no such store or image folder")
    try:
        formats.detect_format(p)
    except UnknownFormatError:
        if not p.is_dir():
            raise
        from torchvision import datasets
        from torchvision.transforms import v2

        from ..transforms.static import parse_static, to_torchvision

        ops = list(to_torchvision(parse_static(static))) + [v2.PILToTensor()] + ([transform] if transform else [])
        return datasets.ImageFolder(str(p), transform=v2.Compose(ops))
    if static:
        raise ArgumentError(f"{path} is a dlstore store: its static transforms ran at conversion; "
                         "drop --static (it applies to raw image folders only)")
    from ..data.stores import open_dataset

    return open_dataset(p, transform=transform)


__all__ = ["NOISE", "CpuInfo", "Trial", "TuneResult", "cpu_info", "loader_kwargs", "measure_throughput",
           "open_for_tuning", "tune", "usable_cpus"]
