"""Per-sample fetch latency, in every DataLoader worker: ``TimedDataset``.

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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from ..errors import ArgumentError

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
        return (f"{self.calls} calls in {self.processes} process(es): mean {ms(self.mean)}, "
                f"p50 {ms(self.p50)}, p95 {ms(self.p95)}, max {ms(self.max)}"
                + (f", {ms(self.per_sample)}/sample" if self.samples != self.calls else ""))


def ms(seconds: float) -> str:
    """Seconds as ms or us, three significant digits."""
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
        # numpy views of the shared tensors: an element write through numpy is far cheaper than torch's
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
                    lines.append(f"  {process:<9} {kind}: {s.calls} calls, mean {ms(s.mean)}, "
                                 f"p95 {ms(s.p95)}")
        return "\n".join(lines) or "no calls recorded"

    def __repr__(self) -> str:
        return f"TimedDataset({self.dataset!r})"



__all__ = ["LatencyStats", "TimedDataset", "ms"]
