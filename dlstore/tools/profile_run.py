"""``dlstore profile`` as a function: build the loader the arguments describe, time a loop over it,
and say why the numbers are what they are.

Any loader the API builds can be profiled: ``dlstore.loader(...)`` with each ``backend=``
(threads, worker processes over the shared-memory ring, its DataLoader back-end), torch's
``DataLoader``, and exactly what ``tune`` recommends (its kwargs choose the loader as
``TuneResult.call()`` prints it). Beside the loop it measures, in this process, how long one batch
takes to build (``batch_build_time``): a wait per step far above what the loader's batch building
can explain is reported with the likely reason (intra-op thread oversubscription, a busy machine,
the trip from worker processes), and the first batch (worker start-up, opening the store) apart.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from .oversubscription import ThreadCheck, check_threads
from .profiling import LoaderReport
from .throughput import build_loader
from .timeline import Timeline, record_timeline
from .timed_dataset import ms

# A wait per step above this many times what batch building explains (plus a millisecond of
# slack for the iterator itself) is reported with its likely reasons.
UNEXPLAINED = 3.0


def build_batch(dataset: Any, indices: list[int]) -> Any:
    """One batch, built in this process the way a loader builds it: ``get_batch`` on a store, else
    ``__getitems__`` (or indexing) and the default collate."""
    from torch.utils.data import default_collate

    if hasattr(dataset, "get_batch"):
        return dataset.get_batch(indices)
    if hasattr(dataset, "__getitems__"):
        return default_collate(dataset.__getitems__(indices))
    return default_collate([dataset[i] for i in indices])


def batch_build_time(dataset: Any, batch_size: int, *, rounds: int = 5, seed: int = 0,
                     clock: Callable[[], float] = time.perf_counter) -> tuple[float, Any]:
    """Median seconds to build one batch of random samples in this process (``build_batch``), after
    one untimed batch (first page faults, lazy imports); and the last batch built."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = len(dataset)
    batch = build_batch(dataset, rng.integers(0, n, size=min(batch_size, n)).tolist())
    times = []
    for _ in range(rounds):
        idx = rng.integers(0, n, size=min(batch_size, n)).tolist()
        start = clock()
        batch = build_batch(dataset, idx)
        times.append(clock() - start)
    return statistics.median(times), batch


def backend_of(loader: Any) -> str | None:
    """The back-end a ``dlstore.Loader`` builds its batches with; None for torch's DataLoader."""
    from torch.utils.data import DataLoader

    return None if isinstance(loader, DataLoader) else loader.backend


def parallelism(loader: Any) -> int:
    """Batches the loader builds at once beside the loop: its threads or worker processes (0: built in
    the loop). A DataLoader and every dlstore back-end but threads say it with ``num_workers``."""
    if backend_of(loader) == "threads":
        return loader.num_threads
    return loader.num_workers


def describe_loader(loader: Any, kwargs: dict[str, Any]) -> str:
    """The loader as code a user can paste, with the back-end dlstore.loader builds batches with."""
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    backend = backend_of(loader)
    if backend is None:
        return f"DataLoader(dataset, {args}, shuffle=True)"
    builders = f", num_threads={loader.num_threads}" if backend == "threads" else \
        f", num_workers={loader.num_workers}" if loader.num_workers else ""
    return f"dlstore.loader(dataset, {args}, shuffle=True) -> backend={backend!r}{builders}"


@dataclass
class ProfileResult:
    """What ``run_profile`` measured: the loop's report, the batch build time, the thread check;
    ``backend`` is the dlstore.loader back-end measured (None: torch's DataLoader)."""

    loader: str
    kwargs: dict[str, Any]
    report: LoaderReport
    build_s: float
    parallel: int
    step_spec: str
    device: str
    thread_check: ThreadCheck
    latency: str | None = None
    latency_stats: dict[str, Any] | None = None
    transform: str = ""
    timeline: Timeline | None = None
    backend: str | None = None

    def expected_wait(self) -> float:
        """The wait per step batch building explains: all of it when the loop builds the batch
        itself, else what the loader's threads or workers cannot hide behind the step."""
        if self.parallel == 0:
            return self.build_s
        return max(0.0, self.build_s / self.parallel - self.report.step_p50)

    def explanation(self) -> str | None:
        """Why the wait is far above what building a batch costs, or None when it is not."""
        # the mean, as the stall fraction counts it (a few long stalls show there, not in the median)
        wait = self.report.wait / max(self.report.steps, 1)
        expected = self.expected_wait()
        # far above: past what batch building explains, and past one whole batch build
        if wait <= max(UNEXPLAINED * expected, self.build_s) + 1e-3:
            return None
        reasons = []
        said = self.thread_check.message()
        if said:
            reasons.append(said)
        elif self.thread_check.load is not None and self.thread_check.load > self.thread_check.usable:
            reasons.append(f"the machine is busy (1-minute load average {self.thread_check.load:.1f} on "
                           f"{self.thread_check.usable} usable CPU(s)): the loader's threads or workers get "
                           "a share of the CPUs, not the CPUs")
        if self.parallel and self.build_s / self.parallel > self.report.step_p50 * 0.5:
            reasons.append(f"{self.parallel} builder(s) at {ms(self.build_s)} a batch barely keep up with a "
                           f"{ms(self.report.step_p50)} step")
        if self.backend in (None, "dataloader") and self.kwargs.get("num_workers"):
            reasons.append("each batch crosses from a worker process (pickled, through shared memory)")
        if not reasons:
            reasons.append("not the batch building itself: look at what else the loop process runs")
        return (f"the wait per step (mean {ms(wait)}, p50 {ms(self.report.wait_p50)}) is {wait / max(self.build_s, 1e-9):,.0f}x the {ms(self.build_s)} "
                f"this process needs to build a batch (measured apart; {self.parallel or 'no'} builder(s) beside "
                f"the loop, so ~{ms(expected)} expected): " + "; ".join(reasons))

    def __str__(self) -> str:
        lines = [f"loader    {self.loader}"] + ([f"transform {self.transform}"] if self.transform else [])
        lines.append(f"step      {self.step_spec} on {self.device}")
        lines.append(f"one batch built in this process, measured apart: {ms(self.build_s)} at the median "
                     f"({self.parallel or 'no'} builder(s) beside the loop)")
        if self.latency:
            lines.append("per-sample fetch latency (TimedDataset, all workers):")
            lines.append("  " + self.latency.replace("\n", "\n  "))
        lines.append(str(self.report))
        if self.timeline is not None:
            lines.append(str(self.timeline))
        why = self.explanation()
        if why:
            lines.append(f"why       {why}")
        elif self.thread_check.message():
            lines.append(f"warning   {self.thread_check.message()}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"loader": self.loader, "backend": self.backend, "kwargs": self.kwargs, "transform": self.transform, "step": self.step_spec, "device": self.device,
                "report": self.report.to_json(), "batch_build_s": self.build_s, "parallel": self.parallel,
                "expected_wait_s": self.expected_wait(), "explanation": self.explanation(),
                "thread_check": dict(asdict(self.thread_check), oversubscribed=self.thread_check.oversubscribed,
                                     message=self.thread_check.message()),
                "dataset_latency": self.latency_stats,
                "timeline": self.timeline.to_json() if self.timeline is not None else None}


def run_profile(dataset: Any, kwargs: dict[str, Any], *, steps: int, step: Callable[[Any, Any], None],
                step_spec: str, device: str, store_loader: bool | None = None, transform: str = "",
                label: str = "", trace_dir: str | os.PathLike | None = None,
                util_interval: float = 0.05) -> ProfileResult:
    """Profile ``steps`` steps of ``step`` over the loader ``kwargs`` describe (``throughput.build_loader``).

    The loop runs through ``timeline.record_timeline``: per-step timestamps, GPU utilisation on
    CUDA every ``util_interval`` s, a ``torch.profiler`` trace in ``trace_dir`` when given.

    A plain ``DataLoader`` reads through a ``TimedDataset`` (per-sample latency in every worker);
    ``dlstore.loader`` needs the store itself, so its batches are timed by ``batch_build_time``.
    Its keywords are ``dlstore profile``'s options, one for one.
    """
    from .throughput import uses_store_loader
    from .timed_dataset import TimedDataset

    store_loader = uses_store_loader(kwargs) if store_loader is None else store_loader
    timed = None if store_loader else TimedDataset(dataset, max_workers=max(int(kwargs.get("num_workers", 0)), 1))
    loader = build_loader(timed if timed is not None else dataset, kwargs, shuffle=True, store_loader=store_loader)
    build_s, sample = batch_build_time(dataset, int(kwargs["batch_size"]))
    workers = parallelism(loader)
    images = sample[0] if isinstance(sample, (list, tuple)) else sample
    check = check_threads(extra_processes=workers,
                          samples=list(images.unbind(0)) if hasattr(images, "unbind") else None)

    report, timeline = record_timeline(loader, step, steps=steps, device=device,
                                       label=label or describe_loader(loader, kwargs),
                                       trace_dir=trace_dir, util_interval=util_interval)
    latency = stats = None
    if timed is not None:
        latency = timed.report()
        stats = {kind: vars(s) for kind, s in timed.stats().items()}
    # described after the loop: a ring that /dev/shm could not hold has fallen back by now
    return ProfileResult(loader=describe_loader(loader, kwargs), kwargs=dict(kwargs), report=report, build_s=build_s,
                         parallel=workers, step_spec=step_spec, device=device, thread_check=check, latency=latency,
                         latency_stats=stats, transform=transform, timeline=timeline, backend=backend_of(loader))


__all__ = ["ProfileResult", "backend_of", "batch_build_time", "build_batch", "describe_loader", "parallelism",
           "run_profile"]
