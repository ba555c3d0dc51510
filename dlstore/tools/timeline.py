"""A training loop step by step: when each step waited for data, when it computed, and (on CUDA) the
GPU utilisation sampled beside it; optionally inside a ``torch.profiler`` trace.

``record_timeline(batches, step, steps=...)`` runs the loop through ``profile_loader`` and returns
the ``LoaderReport`` and a ``Timeline``; ``plot_timelines`` (``timeline_plot``) draws timelines one
above the other.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .gpu_util import UtilSampler, UtilStats, summarise_utilisation
from .profiling import LoaderReport, profile_loader

__all__ = ["Timeline", "record_timeline", "trace_schedule"]


@dataclass
class Timeline:
    """The measured steps of one loop. Times in seconds from the first measured step's start.

    Attributes:
        label: what ran (shown on the plot's panel).
        starts, waits, steps: per step, when its wait for data began, how long it waited, how long
            the loop body (the step) took.
        util: ``(seconds, percent)`` GPU utilisation readings over the same window (empty off CUDA).
        util_reason: why there are none (no CUDA, no NVML), else "".
    """

    label: str
    starts: list[float]
    waits: list[float]
    steps: list[float]
    util: list[tuple[float, float]] = field(default_factory=list)
    util_reason: str = ""

    @property
    def duration(self) -> float:
        return self.starts[-1] + self.waits[-1] + self.steps[-1] if self.starts else 0.0

    def wait_share(self) -> float:
        """The share of the measured time spent waiting for data (the data-stall fraction)."""
        wait, step = sum(self.waits), sum(self.steps)
        return wait / (wait + step) if wait + step > 0 else 0.0

    def util_stats(self) -> UtilStats | None:
        return summarise_utilisation(self.util, start=0.0, end=self.duration)

    def summary(self) -> str:
        """One line: the wait share and, on CUDA, mean utilisation and the share of time at 0 %."""
        text = f"wait share {self.wait_share():.0%}"
        stats = self.util_stats()
        if stats is not None:
            text += f", GPU util mean {stats.mean:.0f} %, at 0 % {stats.zero_share:.0%}"
        return text

    def __str__(self) -> str:
        stats = self.util_stats()
        lines = [f"timeline            {len(self.steps)} steps over {self.duration:.3f} s: "
                 f"waiting for data {self.wait_share():.1%} of the time"]
        lines.append(str(stats) if stats is not None else
                     f"GPU utilisation     not sampled ({self.util_reason or 'no readings'})")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        stats = self.util_stats()
        return {"label": self.label, "wait_share": self.wait_share(), "duration": self.duration,
                "util": stats.to_json() if stats is not None else None, "util_reason": self.util_reason,
                "starts": self.starts, "waits": self.waits, "steps": self.steps, "util_samples": self.util}


def trace_schedule(steps: int) -> dict[str, int]:
    """``torch.profiler.schedule`` arguments covering ``steps`` steps: the first one skipped (worker
    start-up, as the report skips it) when there are three or more, one warm-up, the rest active."""
    wait = 1 if steps >= 3 else 0
    return {"wait": wait, "warmup": 1, "active": max(steps - wait - 1, 1), "repeat": 1}


def _tracing(trace_dir: str | os.PathLike | None, steps: int) -> contextlib.AbstractContextManager:
    if trace_dir is None:
        return contextlib.nullcontext()
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    extra: dict[str, Any] = {}
    try:   # the loader's builder threads too (torch >= 2.6; before, the loop's thread only)
        extra["experimental_config"] = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        pass
    return torch.profiler.profile(activities=activities, schedule=torch.profiler.schedule(**trace_schedule(steps)),
                                  on_trace_ready=torch.profiler.tensorboard_trace_handler(os.fspath(trace_dir)),
                                  **extra)


def record_timeline(batches: Iterable[Any], step: Callable[[Any, Any], Any], *, steps: int, device: Any = None,
                    label: str = "", skip_first: int = 1, trace_dir: str | os.PathLike | None = None,
                    util_interval: float = 0.05) -> tuple[LoaderReport, Timeline]:
    """Run ``steps`` steps of ``step(x, y)`` over ``batches`` (restarted when shorter), timing each
    step's wait and body; on CUDA sample GPU utilisation every ``util_interval`` s beside it.

    With ``trace_dir`` the loop runs inside ``torch.profiler.profile`` (``trace_schedule(steps)``)
    and a trace JSON is written there (``tensorboard_trace_handler``: open it in TensorBoard, Perfetto
    or chrome://tracing), with the phases and dlstore's loader stages as named ranges.

    Returns:
        The ``LoaderReport`` (the first ``skip_first`` steps left out) and the ``Timeline`` of the
        steps it counts.
    """
    def forever() -> Iterator[Any]:
        while True:
            empty = True
            for batch in batches:
                empty = False
                yield batch
            if empty:
                return

    sampler = UtilSampler(device, interval=util_interval)
    with _tracing(trace_dir, steps) as prof, sampler, \
            profile_loader(itertools.islice(forever(), steps), device=device, skip_first=skip_first,
                           record_function=trace_dir is not None) as p:
        for x, y in p:
            step(x, y)
            if prof is not None:
                prof.step()
    report = p.report()
    skip = len(p.steps) - report.steps
    origin = p.starts[skip]
    timeline = Timeline(label=label, starts=[t - origin for t in p.starts[skip:len(p.steps)]],
                        waits=list(p.waits[skip:len(p.steps)]), steps=list(p.steps[skip:]),
                        util=[(t - origin, u) for t, u in sampler.samples], util_reason=sampler.reason)
    return report, timeline
