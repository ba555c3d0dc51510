"""How many CPUs this process may really use, and DataLoader settings found by measurement.

``cpu_info()`` reads the CPU topology, the affinity mask and the container's
cgroup quota; ``usable_cpus()`` is the number a pool of processes should use.

``tune(dataset, batch_size)`` measures steady-state batches/s of a
``DataLoader`` over a short, budgeted search and returns the fastest settings
as ``DataLoader(dataset, **kwargs)`` keyword arguments. The search, in order
(each stage keeps the best so far; a setting must beat a cheaper one by more
than the noise margin to be preferred, so ties go to fewer workers, smaller
prefetch):

1. ``num_workers=0``: the baseline every other row is compared with.
2. ``num_workers`` coarse sweep: 1, 2, 4, ... up to the usable CPUs, plus the
   usable count and a little over it (oversubscription sometimes helps when
   workers wait on I/O), twice round-robin when the budget allows; if the best is
   the highest count tried, doubling it while that pays (up to 4x the usable
   CPUs); then the midpoints next to the best. For a StoreDataset that threads apply to
   (``dlstore.data.loaders.factory.threads_apply``), ``dlstore.loader(ds, threads=t)``, t = 1, 2 and
   the usable CPUs (at most 8), joins the sweep; among equals threads (no inter-process
   copy) beat processes; so do ``dlstore.loader(ds, num_workers=w, shm_ring=True)``, worker
   processes writing into a shared-memory ring (no per-batch segment), for the same worker
   counts. When threads or the ring win, the kwargs are for ``dlstore.loader``.
3. ``prefetch_factor`` 1, 4, 8 around the best worker count (2 was measured).
4. ``pin_memory`` on and off, only when the target device is CUDA.
5. ``persistent_workers`` off, only when an epoch is short enough that the
   measurement window crosses an epoch boundary (otherwise the per-epoch
   restart cost is reported from the measured start-up time, and
   ``persistent_workers=True`` is recommended for any worker count > 0).
6. Confirmation: the winner, its strongest rival with another worker count and
   the baseline are measured once more; the decision uses the median of the
   measurements of each (rates drift on a shared machine; interleaving gives
   the contenders the same conditions, the median ignores one stalled run).

Each trial starts a fresh DataLoader, discards the start-up and the first
``num_workers + 1`` batches (every worker's first batch pays its set-up), then
counts batches over a fixed time window, moving each batch to the device (and
synchronising) when a device is given, so the host-to-device copy is included.
"""

from __future__ import annotations

import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .._system import CpuInfo, cpu_info, memory_limit_bytes, usable_cpus
from ..errors import ArgumentError, StoreNotFoundError
from ..transforms import compiled
from ..units import human_bytes
from .throughput import Trial, _nbytes, loader_kwargs, measure_throughput

# Two measurements within this fraction of each other are considered equal.
NOISE = 0.05


# --------------------------------------------------------------------------- measuring


class TuneResult(dict):
    """The recommended DataLoader kwargs (a dict: ``DataLoader(ds, **result)``), with the evidence.

    With ``result["threads"]`` (threads won) they are for ``dlstore.loader(ds, **result)``.

    Attributes:
        trials: every measured configuration, in the order run.
        best: the recommended trial.
        baseline: the ``num_workers=0`` trial.
        batch_bytes: bytes of one collated batch on the host.
        warnings: human-readable warnings (memory-heavy recommendation, settings slower
            than workers=0, budget too small to finish the search).
        cpus: the ``CpuInfo`` the worker range was based on.
        device: the target device, or None.
    """

    def __init__(self, kwargs: dict[str, Any], *, trials: list[Trial], best: Trial, baseline: Trial,
                 batch_bytes: int, warnings: list[str], cpus: CpuInfo, device: str | None):
        super().__init__(kwargs)
        self.trials = trials
        self.best = best
        self.baseline = baseline
        self.batch_bytes = batch_bytes
        self.warnings = warnings
        self.cpus = cpus
        self.device = device

    @property
    def kwargs(self) -> dict[str, Any]:
        """A plain-dict copy of the recommendation."""
        return dict(self)

    def call(self, name: str = "dataset") -> str:
        """The recommended loader as code: ``DataLoader(dataset, ...)`` or ``dlstore.loader(dataset, ...)``."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.items())
        store_loader = self.get("threads") or self.get("shm_ring")
        return f"{'dlstore.loader' if store_loader else 'DataLoader'}({name}, {args})"

    def rate(self, kwargs: dict[str, Any]) -> float:
        """Median batches/s over every trial of exactly these kwargs (0.0 if never measured)."""
        rates = [t.batches_per_s for t in self.trials if t.kwargs == dict(kwargs)]
        return statistics.median(rates) if rates else 0.0

    @property
    def speedup(self) -> float:
        """Median measured batches/s of the recommendation over that of ``num_workers=0``."""
        return self.rate(self.best.kwargs) / self.rate(self.baseline.kwargs)

    def to_json(self) -> dict[str, Any]:
        """Everything as JSON-able data."""
        return {"kwargs": dict(self), "speedup_vs_workers0": self.speedup,
                "batch_bytes": self.batch_bytes, "device": self.device, "cpus": asdict(self.cpus),
                "warnings": list(self.warnings), "trials": [asdict(t) for t in self.trials]}

    def table(self) -> str:
        """The trials as an aligned text table, the recommendation marked with ``*``."""
        head = (f"  {'workers':>7} {'threads':>7} {'prefetch':>8} {'pin':>5} {'persist':>7} {'batches/s':>10} "
                f"{'samples/s':>10} {'vs w=0':>7} {'start s':>7}  stage / note")
        lines = [head]
        base = self.rate(self.baseline.kwargs)
        for t in self.trials:
            k = t.kwargs
            mark = "*" if t is self.best else " "
            note = t.stage + (f": {t.note}" if t.note else "")
            lines.append(
                f"{mark} {t.num_workers:>7} {'ring' if k.get('shm_ring') else k.get('threads') or '-':>7} "
                f"{str(k.get('prefetch_factor', '-')):>8} "
                f"{'yes' if k.get('pin_memory') else 'no':>5} "
                f"{('yes' if k.get('persistent_workers') else 'no') if t.num_workers else '-':>7} "
                f"{t.batches_per_s:>10.1f} {t.samples_per_s:>10.0f} "
                f"{t.batches_per_s / base:>6.2f}x {t.startup_s:>7.2f}  {note}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"TuneResult({dict(self)!r}, speedup={self.speedup:.2f}x over workers=0)"


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
    memory_warn_fraction: float = 0.1,
    loader_extra: dict[str, Any] | None = None,
    cpus: CpuInfo | None = None,
    log: Callable[[str], None] | None = None,
    threads: bool | None = None,
) -> TuneResult:
    """Measure DataLoader settings on ``dataset`` and return the fastest as kwargs.

    See the module docstring for the search. Rates are steady-state batches/s
    after warm-up; a candidate replaces the best so far only if it is faster by
    more than ``noise`` (a fraction), so among equals the cheaper setting wins.

    Args:
        dataset: any map-style dataset (a ``StoreDataset``, an ``ImageFolder``, ...).
        batch_size: the batch size you train with (throughput depends on it).
        device: the training device (``"cuda"``, ``"cuda:1"``, ``"cpu"``); batches are copied
            there inside the timing, and ``pin_memory`` is searched only for CUDA.
        budget: seconds for the whole search, start-ups included (approximate: a trial in
            flight is not cut short, and the ``num_workers=0`` baseline always runs).
        max_workers: cap on the worker counts tried (default: a little over the usable CPUs).
        shuffle: measure with random access, as in training.
        noise: relative margin under which two rates count as equal.
        memory_warn_fraction: warn when ``workers x prefetch x batch bytes`` exceeds this
            fraction of the memory available to the process.
        loader_extra: DataLoader arguments that are not tuned (``collate_fn``,
            ``multiprocessing_context``, ``drop_last`` ...); not part of the returned kwargs.
        cpus: override the CPU information (default: ``cpu_info()``).
        log: called with one line per finished trial (progress), e.g. ``print``.
        threads: measure ``dlstore.loader(threads=t)`` too (None: for a StoreDataset they apply to).

    Returns:
        A ``TuneResult``: a dict of DataLoader kwargs (``batch_size``, ``num_workers``,
        ``pin_memory``, and with workers ``prefetch_factor``, ``persistent_workers``) carrying
        the measured trials, warnings and a ``table()``.

    Raises:
        ValueError: ``batch_size`` < 1, an empty dataset, or a non-positive budget.
    """
    if batch_size < 1:
        raise ArgumentError(f"batch_size must be >= 1, got {batch_size}")
    if budget <= 0:
        raise ArgumentError(f"budget must be a positive number of seconds, got {budget}")
    n = len(dataset)
    if n == 0:
        raise ArgumentError("cannot tune on an empty dataset (len(dataset) == 0)")
    dev = torch.device(device) if device is not None else None
    cuda = dev is not None and dev.type == "cuda"
    cpus = cpus or cpu_info()
    candidates = _worker_candidates(cpus.usable, max_workers)
    thread_counts = _thread_candidates(dataset, cpus.usable) if threads is not False else []
    if threads and not thread_counts:
        raise ArgumentError("tune(threads=True) needs a fixed-shape StoreDataset (dlstore.open_dataset)")
    deadline = time.perf_counter() + budget
    # Two rounds of the coarse sweep need ~0.5 s a trial at least; one round otherwise.
    # the shared-memory ring applies where threads do (a fixed-shape StoreDataset)
    ring_counts = [w for w in candidates if w > 0] if thread_counts else []
    sweep_size = 1 + len(thread_counts) + len(candidates) + len(ring_counts)
    rounds = 2 if budget >= 2 * sweep_size * 0.5 + 8 else 1
    # Planned trials: sweep, up to 2 refinements, 3 prefetch, pin, persistent, 3 confirmations.
    planned = rounds * sweep_size + 2 + 3 + (1 if cuda else 0) + 1 + 3
    trials: list[Trial] = []
    notes: list[str] = []
    skipped: list[str] = []
    batches_per_epoch = math.ceil(n / batch_size)

    def run(kwargs: dict[str, Any], stage: str) -> Trial | None:
        remaining = deadline - time.perf_counter()
        if trials and remaining <= 0:
            skipped.append(f"{stage} {_short(kwargs)}")
            return None
        todo = max(1, planned - len(trials))
        # Leave about a third of each slot for start-up, warm-up and shutdown.
        seconds = max(0.25, 0.6 * remaining / todo) if trials else max(0.25, 0.6 * budget / planned)
        with warnings.catch_warnings():
            # Oversubscribing the CPUs is deliberate here; DataLoader would warn about it.
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            trial = measure_throughput(dataset, kwargs, seconds=seconds, device=dev, shuffle=shuffle,
                                       extra=loader_extra, max_seconds=max(2 * seconds, remaining))
        trial.stage = stage
        trials.append(trial)
        if log is not None:
            log(f"{stage:<10} {_short(kwargs):<52} {trial.batches_per_s:8.1f} batches/s "
                f"(start-up {trial.startup_s:.2f} s)")
        return trial

    def config(workers: int, prefetch: int = 2, pin: bool = cuda, persistent: bool = True) -> dict[str, Any]:
        return loader_kwargs(batch_size, workers, prefetch_factor=prefetch, pin_memory=pin,
                             persistent_workers=persistent)

    def like(kwargs: dict[str, Any], workers: int) -> dict[str, Any]:
        """``config(workers)`` through the same kind of loader as ``kwargs`` (the ring or the DataLoader)."""
        return dict(config(workers), shm_ring=True) if kwargs.get("shm_ring") and workers > 0 else config(workers)

    def rate(kwargs: dict[str, Any]) -> float:
        # The median of every measurement of these kwargs. Not the best: on a busy machine one
        # setting may get a lucky quiet window the others never had; not the mean: one stalled
        # run would sink it. The round-robin sweep and the confirmation give the contenders the
        # same number of interleaved runs (three for the finalists).
        return statistics.median(t.batches_per_s for t in trials if t.kwargs == kwargs)

    def pick(pool: Iterable[dict[str, Any]]) -> dict[str, Any]:
        # The cheapest setting within the noise margin of the fastest: more workers and
        # deeper queues must earn their memory by a clear margin.
        pool = list(pool)
        top = max(rate(k) for k in pool)
        return min((k for k in pool if rate(k) >= top / (1 + noise)),
                   key=lambda k: (int(k.get("num_workers", 0)), int(k.get("threads") or 0),
                                  int(k.get("prefetch_factor") or 0),
                                  bool(k.get("pin_memory")), not k.get("persistent_workers", True)))

    def measured() -> list[dict[str, Any]]:
        unique: list[dict[str, Any]] = []
        for t in trials:
            if t.kwargs not in unique:
                unique.append(t.kwargs)
        return unique

    # 1-2. baseline and the coarse workers sweep, twice round-robin when the budget allows,
    # so a burst of outside load hits one measurement of a setting, not its only one.
    # Threads (a StoreDataset) join the sweep: against the processes under the same conditions.
    sweep = [(config(0), "baseline")] + [(config(w), "workers") for w in candidates]
    sweep[1:1] = [(dict(config(0), threads=t), "threads") for t in thread_counts]
    sweep += [(dict(config(w), shm_ring=True), "ring") for w in ring_counts]
    for _ in range(rounds):
        for kwargs, stage in sweep:
            if run(kwargs, stage) is None:
                break
    baseline = trials[0]
    best = pick(measured())
    # The best at the top of the range: the trend may go on (e.g. workers that wait on I/O, or
    # a busy machine where more processes get more CPU time), so double while it pays.
    top_count = candidates[-1]
    while (max_workers is None and int(best["num_workers"]) == top_count
           and top_count < 4 * cpus.usable):
        top_count = min(2 * top_count, 4 * cpus.usable)
        if run(like(best, top_count), "extend") is None:
            break
        best = pick(measured())
    # Refine between the best worker count and its measured neighbours.
    counts = sorted({int(k["num_workers"]) for k in measured() if bool(k.get("shm_ring")) == bool(best.get("shm_ring"))})
    best_workers = int(best["num_workers"])
    if best_workers > 0:
        i = counts.index(best_workers)
        for neighbour in (counts[i - 1] if i > 0 else None, counts[i + 1] if i + 1 < len(counts) else None):
            mid = (best_workers + neighbour) // 2 if neighbour is not None else 0
            if mid >= 1 and mid not in counts and run(like(best, mid), "refine") is None:
                break
        best = pick(measured())

    # 3. prefetch around the best worker count; when workers=0 won, around the best worker
    # count anyway if it came close (a deeper queue may tip the balance), else not at all.
    with_workers = [k for k in measured() if int(k["num_workers"]) > 0]
    if with_workers:
        local = pick(with_workers)
        if rate(local) >= 0.7 * rate(best):
            for prefetch in (1, 4, 8):
                if run(dict(local, prefetch_factor=prefetch), "prefetch") is None:
                    break
        best = pick(measured())

    if cuda:  # 4. pin_memory: on by default for CUDA; check that it pays
        run(dict(best, pin_memory=not best.get("pin_memory")), "pin")
        best = pick(measured())

    persist_note = ""
    if int(best["num_workers"]) > 0:  # 5. persistent_workers
        last = [t for t in trials if t.kwargs == best][-1]
        if last.batches >= batches_per_epoch:
            run(dict(best, persistent_workers=False), "persistent")
            best = pick(measured())
        else:
            persist_note = (f"persistent_workers=True keeps the workers between epochs: saves their "
                            f"start-up (~{last.startup_s:.2f} s measured) once per epoch of "
                            f"{batches_per_epoch} batches (~{batches_per_epoch / rate(best):.1f} s)")

    # 6. confirm: re-measure the winner, its strongest rival with another worker count and the
    # baseline, and decide among them on the median of all their measurements.
    finalists = [best]
    rivals = [k for k in measured() if k["num_workers"] != best["num_workers"]]
    if rivals:
        finalists.append(max(rivals, key=rate))
    if baseline.kwargs not in finalists:
        finalists.append(baseline.kwargs)
    for kwargs in finalists:
        run(kwargs, "confirm")
    winner = pick(finalists)
    best_trial = max((t for t in trials if t.kwargs == winner), key=lambda t: t.batches_per_s)
    best = best_trial
    base_rate = rate(baseline.kwargs)

    slower = [k for k in measured() if int(k["num_workers"]) > 0 and rate(k) < base_rate * (1 - noise)]
    for t in trials:
        if t.kwargs in slower:
            t.note = (t.note + "; " if t.note else "") + "slower than workers=0"
    if slower:
        notes.append(f"{len(slower)} of {len(measured())} settings were slower than num_workers=0 "
                     f"at the median (e.g. {_short(slower[0])}): more processes are not free here")
    if skipped:
        notes.append(f"budget of {budget:g} s spent before {len(skipped)} planned trial(s) ran "
                     f"(first: {skipped[0]}); give more --budget for a fuller search")
    batch_bytes = _batch_bytes(dataset, batch_size, loader_extra)
    in_flight = best.num_workers * max(best.prefetch_factor, 1) * batch_bytes
    limit = memory_limit_bytes()
    if best.num_workers and limit and in_flight > memory_warn_fraction * limit:
        notes.append(
            f"memory-heavy: {best.num_workers} workers x prefetch {best.prefetch_factor} x "
            f"{human_bytes(batch_bytes)} per batch = {human_bytes(in_flight)} of batches in flight "
            f"({in_flight / limit:.0%} of {human_bytes(limit)} available"
            f"{', plus pinned copies' if best.kwargs.get('pin_memory') else ''}); "
            "lower prefetch_factor or num_workers if memory is short")
    if getattr(dataset, "fuses_crop_flip", False) and not compiled.available():
        notes.append(f"the random crop/flip ran the pure-numpy kernel ({compiled.unavailable_reason()}); "
                     "the compiled one reads ~2x faster with threads (docs/reading.md)")
    if persist_note:
        best.note = (best.note + "; " if best.note else "") + persist_note
    return TuneResult(best.kwargs, trials=trials, best=best, baseline=baseline, batch_bytes=batch_bytes,
                      warnings=notes, cpus=cpus, device=str(dev) if dev is not None else None)


def _thread_candidates(dataset: Any, usable: int) -> list[int]:
    """1, 2 and the usable CPUs (at most 8), for a StoreDataset that threads apply to; else none."""
    from ..data.dataset import StoreDataset
    from ..data.loaders.factory import MAX_AUTO_THREADS, threads_apply

    top = max(1, min(usable, MAX_AUTO_THREADS))
    return sorted({1, min(2, top), top}) if isinstance(dataset, StoreDataset) and threads_apply(dataset) else []


def _batch_bytes(dataset: Any, batch_size: int, extra: dict[str, Any] | None) -> int:
    """Bytes of one collated batch, from one batch fetched in this process."""
    from torch.utils.data import DataLoader

    extra = {k: v for k, v in (extra or {}).items() if k in ("collate_fn",)}
    batch = next(iter(DataLoader(dataset, batch_size=batch_size, num_workers=0, **extra)))
    return _nbytes(batch)


def _short(kwargs: dict[str, Any]) -> str:
    skip = {"batch_size"}
    return ", ".join(f"{k}={v}" for k, v in kwargs.items() if k not in skip)


def open_for_tuning(
    path: str | os.PathLike,
    *,
    static: str | Iterable[dict[str, Any]] | None = None,
) -> Any:
    """A dataset to tune from a path: a dlstore store via ``open_dataset``, or a raw image
    folder via torchvision ``ImageFolder`` with ``static`` applied per sample then
    ``PILToTensor`` (your current pipeline, decode included).

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

        ops = list(to_torchvision(parse_static(static))) + [v2.PILToTensor()]
        return datasets.ImageFolder(str(p), transform=v2.Compose(ops))
    if static:
        raise ArgumentError(f"{path} is a dlstore store: its static transforms ran at conversion; "
                         "drop --static (it applies to raw image folders only)")
    from ..data.stores import open_dataset

    return open_dataset(p)


__all__ = ["CpuInfo", "Trial", "TuneResult", "cpu_info", "loader_kwargs", "measure_throughput",
           "open_for_tuning", "tune", "usable_cpus"]
