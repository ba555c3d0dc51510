"""Where the time of a training loop goes: waiting for data vs the step.

Per-sample fetch latency is ``timed_dataset.TimedDataset``'s.

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
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ArgumentError, UsageError
from .timed_dataset import LatencyStats, TimedDataset, ms


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
            f"waiting for data      {self.wait:.3f} s  (per step p50 {ms(self.wait_p50)}, "
            f"p95 {ms(self.wait_p95)})",
            f"in the step           {self.step:.3f} s  (per step p50 {ms(self.step_p50)}, "
            f"p95 {ms(self.step_p95)})",
            f"data-stall fraction   {self.stall_fraction:.1%}",
            f"speed-up if free      {self.speedup_if_free:.2f}x",
            f"verdict               {verdict}",
        ])


class LoaderProfile:
    """The object ``profile_loader`` yields: iterate it instead of the loader.

    After (or during) the loop, ``report()`` returns a ``LoaderReport`` and
    ``waits`` / ``steps`` hold the raw per-step seconds, ``starts`` when each step's wait began.
    """

    def __init__(self, loader: Any, *, sync: Callable[[], None] | None, skip_first: int,
                 record_function: bool):
        self.loader = loader
        self.waits: list[float] = []
        self.steps: list[float] = []
        self.starts: list[float] = []   # perf_counter() when each wait began: the timeline
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
            self.starts.append(start)
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
        num_classes: outputs of the conv net (labels are taken modulo this); with masks for labels (a
            segmentation store's), a class per pixel, 255 ignored.

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
        y = torch.as_tensor(y).to(dev, non_blocking=True)
        dense = y.dim() == 3   # a segmentation store's masks: a class per pixel, 255 ignored
        y = torch.where(y == 255, 255, y.long() % num_classes) if dense else y % num_classes
        if "model" not in state:  # built on first use: the channel count comes from the data
            head = [torch.nn.Conv2d(32, num_classes, 1)] if dense else \
                [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, num_classes)]
            model = torch.nn.Sequential(
                torch.nn.Conv2d(x.shape[1], 16, 3, stride=2, padding=1), torch.nn.ReLU(),
                torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(), *head,
            ).to(dev)
            state["model"] = model
            state["opt"] = torch.optim.SGD(model.parameters(), lr=0.01)
        out = state["model"](x)
        if dense:
            out = torch.nn.functional.interpolate(out, size=y.shape[-2:], mode="bilinear", align_corners=False)
        loss = torch.nn.functional.cross_entropy(out, y, ignore_index=255) if dense else \
            torch.nn.functional.cross_entropy(out, y)
        state["opt"].zero_grad(set_to_none=True)
        loss.backward()
        state["opt"].step()

    return step


__all__ = ["LatencyStats", "LoaderProfile", "LoaderReport", "TimedDataset", "profile_loader",
           "synthetic_step"]
