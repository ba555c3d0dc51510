"""Where the time of a training loop goes: per-sample fetch latency and loader stalls.

``TimedDataset(ds)`` wraps a map-style dataset and records the latency of every
``__getitem__`` (and ``__getitems__``, when the wrapped dataset has one) in
every DataLoader worker, readable from the main process.

How the numbers cross the process boundary: the wrapper allocates, before any
worker exists, a small block of shared memory (a torch tensor moved to shared
memory with ``share_memory_()``), one row per process: running count, sum and
maximum, plus a ring of the last ``capacity`` latencies for percentiles. A
worker writes only its own row (row = ``get_worker_info().id``; the main
process uses the last row), so no lock is needed. Under ``fork`` the workers
inherit the shared mapping; under ``spawn``/``forkserver`` the DataLoader
pickles the dataset with torch's multiprocessing reducers, which send the
shared-memory handle rather than a copy. Either way the parent's tensor sees the
workers' writes, including after the workers have exited. Reading while
workers write is safe but may see a row mid-update (one call more or less).

``profile_loader(loader)`` is a context manager around the iteration of a
loader: per step it measures the time blocked in ``next()`` waiting for data
and the time spent in the loop body (the step), synchronising CUDA at both
boundaries when CUDA is in use so asynchronous kernels are charged to the step
that launched them. It reports the data-stall fraction and the speed-up one
would get if loading were free.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from ..errors import ArgumentError, UsageError

_KINDS = ("__getitem__", "__getitems__")
# Per (process row, kind): calls, samples, sum of seconds, max seconds.
_CALLS, _SAMPLES, _SUM, _MAX = range(4)


@dataclass(frozen=True)
class LatencyStats:
    """Latency of one kind of call (``__getitem__`` or ``__getitems__``), in seconds.

    Attributes:
        calls: calls recorded.
        samples: samples those calls returned (= calls for ``__getitem__``).
        mean: mean seconds per call (over every call).
        p50, p95: percentiles per call, over the last ``capacity`` calls of each process.
        max: slowest call (over every call).
        per_sample: mean seconds per sample (``mean * calls / samples``).
        processes: processes that recorded calls (workers, plus the main process if it read).
    """

    calls: int
    samples: int
    mean: float
    p50: float
    p95: float
    max: float
    per_sample: float
    processes: int

    def __str__(self) -> str:
        return (f"{self.calls} calls in {self.processes} process(es): mean {_ms(self.mean)}, "
                f"p50 {_ms(self.p50)}, p95 {_ms(self.p95)}, max {_ms(self.max)}"
                + (f", {_ms(self.per_sample)}/sample" if self.samples != self.calls else ""))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.3g} us"


class TimedDataset(Dataset):
    """A dataset wrapper that times every fetch, in every DataLoader worker.

    ``len``, indexing and attributes pass through to the wrapped dataset
    (``timed.classes`` is ``ds.classes``). ``__getitems__`` exists on the
    wrapper exactly when it exists on the wrapped dataset, so the DataLoader
    takes the same path with or without the wrapper.

    Args:
        dataset: the map-style dataset to time.
        max_workers: the most DataLoader workers that will read it (worker ids
            must be below this); one more row is kept for the main process.
        capacity: latencies kept per process and kind for the percentiles.

    Example:
        >>> timed = TimedDataset(open_dataset("train.shards"))
        >>> for batch in DataLoader(timed, batch_size=64, num_workers=4): ...
        >>> print(timed.report())
    """

    def __init__(self, dataset: Any, *, max_workers: int = 64, capacity: int = 4096):
        if max_workers < 0 or capacity < 1:
            raise ArgumentError(f"max_workers must be >= 0 and capacity >= 1, got {max_workers}, {capacity}")
        self.dataset = dataset
        self.max_workers = max_workers
        self.capacity = capacity
        rows = max_workers + 1
        # Allocated here, in the parent, before any worker is started (see module docstring).
        self._totals = torch.zeros(rows, len(_KINDS), 4, dtype=torch.float64).share_memory_()
        self._ring = torch.zeros(rows, len(_KINDS), capacity, dtype=torch.float64).share_memory_()

    def _row(self) -> int:
        info = get_worker_info()
        if info is None:
            return self.max_workers
        if info.id >= self.max_workers:
            raise ArgumentError(f"DataLoader worker {info.id} is beyond TimedDataset(max_workers="
                             f"{self.max_workers}); create it with max_workers >= num_workers")
        return info.id

    def _views(self) -> tuple[np.ndarray, np.ndarray]:
        # numpy views of the shared tensors: element writes cost ~100 ns instead of ~5 us.
        views = self.__dict__.get("_np_views")
        if views is None:
            views = self.__dict__["_np_views"] = (self._totals.numpy(), self._ring.numpy())
        return views

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_np_views", None)
        return state

    def _record(self, kind: int, seconds: float, samples: int) -> None:
        totals, ring = self._views()
        row = self._row()
        t = totals[row, kind]
        calls = int(t[_CALLS])
        ring[row, kind, calls % self.capacity] = seconds
        t[_SAMPLES] += samples
        t[_SUM] += seconds
        if seconds > t[_MAX]:
            t[_MAX] = seconds
        t[_CALLS] = calls + 1  # last: a reader never counts a ring slot not yet written

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        start = time.perf_counter()
        item = self.dataset[index]
        self._record(0, time.perf_counter() - start, 1)
        return item

    @property
    def __getitems__(self) -> Callable[[Sequence[Any]], Any]:
        inner = getattr(self.dataset, "__getitems__", None)
        if inner is None:
            raise AttributeError(f"{type(self.dataset).__name__} has no __getitems__")

        def timed_getitems(indices: Sequence[Any]) -> Any:
            start = time.perf_counter()
            items = inner(indices)
            self._record(1, time.perf_counter() - start, len(indices))
            return items

        return timed_getitems

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes the wrapper lacks; guard against recursion while unpickling.
        if name.startswith("_") or name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def reset(self) -> None:
        """Forget every recorded latency (in every process: the memory is shared)."""
        self._totals.zero_()
        self._ring.zero_()

    def stats(self, *, per_process: bool = False) -> dict[str, LatencyStats] | dict[str, dict[str, LatencyStats]]:
        """Latency statistics per kind of call, all processes pooled.

        Args:
            per_process: instead return ``{process: {kind: LatencyStats}}`` with
                process ``"worker 0"``, ``"worker 1"``, ... and ``"main"``.

        Returns:
            ``{"__getitem__": LatencyStats, "__getitems__": LatencyStats}`` for the kinds
            that recorded calls.
        """
        totals, ring = self._views()
        totals = totals.copy()
        if per_process:
            out: dict[str, dict[str, LatencyStats]] = {}
            for row in range(totals.shape[0]):
                name = "main" if row == self.max_workers else f"worker {row}"
                stats = self._stats_of([row], totals, ring)
                if stats:
                    out[name] = stats
            return out
        return self._stats_of(range(totals.shape[0]), totals, ring)

    def _stats_of(self, rows: Any, totals: np.ndarray, ring: np.ndarray) -> dict[str, LatencyStats]:
        out = {}
        for k, kind in enumerate(_KINDS):
            active = [r for r in rows if totals[r, k, _CALLS] > 0]
            if not active:
                continue
            calls = int(sum(totals[r, k, _CALLS] for r in active))
            samples = int(sum(totals[r, k, _SAMPLES] for r in active))
            total = float(sum(totals[r, k, _SUM] for r in active))
            recent = np.concatenate([ring[r, k, :min(int(totals[r, k, _CALLS]), self.capacity)]
                                     for r in active])
            p50, p95 = np.percentile(recent, [50, 95]) if recent.size else (0.0, 0.0)
            out[kind] = LatencyStats(calls=calls, samples=samples, mean=total / calls, p50=float(p50),
                                     p95=float(p95), max=float(max(totals[r, k, _MAX] for r in active)),
                                     per_sample=total / max(samples, 1), processes=len(active))
        return out

    def report(self) -> str:
        """One line per kind of call, then one per process."""
        lines = []
        for kind, s in self.stats().items():
            lines.append(f"{kind}: {s}")
        per = self.stats(per_process=True)
        if len(per) > 1:
            for process, kinds in per.items():
                for kind, s in kinds.items():
                    lines.append(f"  {process:<9} {kind}: {s.calls} calls, mean {_ms(s.mean)}, "
                                 f"p95 {_ms(s.p95)}")
        return "\n".join(lines) or "no calls recorded"

    def __repr__(self) -> str:
        return f"TimedDataset({self.dataset!r})"


@dataclass(frozen=True)
class LoaderReport:
    """What ``profile_loader`` measured. Times in seconds.

    Attributes:
        steps: steps measured (after the skipped first ones).
        first_wait: wait for the first batch (worker start-up, first fetch), excluded from the rest.
        wait: total time blocked waiting for data over the measured steps.
        step: total time in the loop body over the measured steps.
        wait_p50, wait_p95, step_p50, step_p95: per-step percentiles.
        stall_fraction: ``wait / (wait + step)``: the share of the loop spent waiting for data.
        speedup_if_free: ``(wait + step) / step``: how much faster the loop would run if
            batches were ready instantly (an upper bound of what loader tuning can buy).
    """

    steps: int
    first_wait: float
    wait: float
    step: float
    wait_p50: float
    wait_p95: float
    step_p50: float
    step_p95: float
    stall_fraction: float
    speedup_if_free: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        verdict = ("input-bound: the step waits for data; tune the loader (dlstore tune) or move "
                   "per-sample work out of the loop" if self.stall_fraction > 0.25 else
                   "mostly compute-bound: faster loading would gain little" if self.stall_fraction > 0.05
                   else "compute-bound: loading is not the bottleneck")
        return "\n".join([
            f"steps measured        {self.steps} (first wait {self.first_wait:.3f} s excluded)",
            f"waiting for data      {self.wait:.3f} s  (per step p50 {_ms(self.wait_p50)}, "
            f"p95 {_ms(self.wait_p95)})",
            f"in the step           {self.step:.3f} s  (per step p50 {_ms(self.step_p50)}, "
            f"p95 {_ms(self.step_p95)})",
            f"data-stall fraction   {self.stall_fraction:.1%}",
            f"speed-up if free      {self.speedup_if_free:.2f}x",
            f"verdict               {verdict}",
        ])


class LoaderProfile:
    """The object ``profile_loader`` yields: iterate it instead of the loader.

    After (or during) the loop, ``report()`` returns a ``LoaderReport`` and
    ``waits`` / ``steps`` hold the raw per-step seconds.
    """

    def __init__(self, loader: Any, *, sync: Callable[[], None] | None, skip_first: int,
                 record_function: bool):
        self.loader = loader
        self.waits: list[float] = []
        self.steps: list[float] = []
        self._sync = sync
        self._skip_first = skip_first
        self._record = record_function
        self._generator: Iterator[Any] | None = None

    def _label(self, name: str) -> contextlib.AbstractContextManager:
        if not self._record:
            return contextlib.nullcontext()
        return torch.profiler.record_function(name)

    def __iter__(self) -> Iterator[Any]:
        self.close()
        self._generator = self._iterate()
        return self._generator

    def _iterate(self) -> Iterator[Any]:
        iterator = iter(self.loader)
        while True:
            if self._sync is not None:
                self._sync()
            start = time.perf_counter()
            with self._label("dlstore.wait_for_data"):
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
            got = time.perf_counter()
            self.waits.append(got - start)
            try:
                with self._label("dlstore.step"):
                    yield batch
                    if self._sync is not None:
                        self._sync()
            finally:  # also when the loop breaks early (GeneratorExit at the yield)
                self.steps.append(time.perf_counter() - got)

    def close(self) -> None:
        """Stop a running iteration (records the step in progress)."""
        if self._generator is not None:
            self._generator.close()
            self._generator = None

    def report(self) -> LoaderReport:
        """Stall fraction and estimated speed-up over the steps measured so far.

        Raises:
            ValueError: no step was measured past the skipped first ones.
        """
        skip = min(self._skip_first, max(len(self.steps) - 1, 0))
        waits = np.asarray(self.waits[skip:len(self.steps)], dtype=np.float64)
        steps = np.asarray(self.steps[skip:], dtype=np.float64)
        if steps.size == 0:
            raise UsageError("profile_loader measured no step: iterate the profiler "
                             "(`for batch in p:`), not the loader, inside the `with` block")
        wait, step = float(waits.sum()), float(steps.sum())
        total = wait + step
        return LoaderReport(
            steps=int(steps.size), first_wait=float(self.waits[0]) if skip else 0.0, wait=wait, step=step,
            wait_p50=float(np.percentile(waits, 50)), wait_p95=float(np.percentile(waits, 95)),
            step_p50=float(np.percentile(steps, 50)), step_p95=float(np.percentile(steps, 95)),
            stall_fraction=wait / total if total > 0 else 0.0,
            speedup_if_free=total / step if step > 0 else float("inf"))


@contextlib.contextmanager
def profile_loader(
    loader: Any,
    *,
    device: str | torch.device | None = None,
    skip_first: int = 1,
    record_function: bool = False,
) -> Iterator[LoaderProfile]:
    """Measure data wait vs step time of a training loop.

    ::

        with dlstore.profile_loader(loader, device="cuda") as p:
            for x, y in p:
                step(x, y)
        print(p.report())

    Args:
        loader: any iterable of batches (usually a DataLoader).
        device: the device the step runs on. With CUDA (given here, or CUDA already
            initialised in this process when None) the device is synchronised before
            each wait and after each step, so queued kernels count as step time.
        skip_first: steps left out of the statistics; the first wait includes worker
            start-up and is reported separately as ``first_wait``.
        record_function: label the phases ``dlstore.wait_for_data`` and ``dlstore.step``
            with ``torch.profiler.record_function`` so they show in a trace.

    Yields:
        A ``LoaderProfile`` to iterate instead of the loader; ``report()`` gives the numbers.
    """
    sync: Callable[[], None] | None = None
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
    elif dev is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        sync = torch.cuda.synchronize
    profile = LoaderProfile(loader, sync=sync, skip_first=skip_first, record_function=record_function)
    try:
        yield profile
    finally:
        profile.close()


def synthetic_step(spec: str = "conv", *, device: str | torch.device = "cpu",
                   num_classes: int = 10) -> Callable[[Any, Any], None]:
    """A stand-in training step for profiling a loader without your model.

    Args:
        spec: ``"conv"`` (a small conv net: forward, backward, SGD update on
            ``x / 255`` in float32), ``"matmul:N"`` (one N x N float32 matmul per step,
            cost ~2N^3 flops, independent of the batch), or ``"sleep:MS"`` (sleep MS
            milliseconds: an accelerator step that leaves the CPU free).
        device: where the step runs; the batch is copied there inside the step.
        num_classes: outputs of the conv net (labels are taken modulo this).

    Returns:
        ``step(x, y)``.

    Raises:
        ValueError: an unknown ``spec``, with the accepted forms.
    """
    dev = torch.device(device)
    kind, _, arg = spec.partition(":")
    try:
        if kind == "sleep":
            seconds = float(arg or 10) / 1e3
            return lambda x, y: time.sleep(seconds)
        if kind == "matmul":
            n = int(arg or 1024)
            a = torch.randn(n, n, device=dev)
            return lambda x, y: torch.mm(a, a)
    except ValueError:
        raise ArgumentError(f"step {spec!r}: expected sleep:MS or matmul:N with a number") from None
    if kind != "conv" or arg:
        raise ArgumentError(f"unknown step {spec!r}: use conv, matmul:N (e.g. matmul:1024) or sleep:MS "
                         "(e.g. sleep:20)")
    state: dict[str, Any] = {}

    def step(x: Any, y: Any) -> None:
        x = x.to(dev, non_blocking=True).float().div_(255)
        y = torch.as_tensor(y).to(dev, non_blocking=True) % num_classes
        if "model" not in state:  # built on first use: the channel count comes from the data
            model = torch.nn.Sequential(
                torch.nn.Conv2d(x.shape[1], 16, 3, stride=2, padding=1), torch.nn.ReLU(),
                torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, num_classes),
            ).to(dev)
            state["model"] = model
            state["opt"] = torch.optim.SGD(model.parameters(), lr=0.01)
        loss = torch.nn.functional.cross_entropy(state["model"](x), y)
        state["opt"].zero_grad(set_to_none=True)
        loss.backward()
        state["opt"].step()

    return step


__all__ = ["LatencyStats", "LoaderProfile", "LoaderReport", "TimedDataset", "profile_loader",
           "synthetic_step"]
