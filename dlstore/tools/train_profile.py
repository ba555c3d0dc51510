"""Profile your own training step: ``profile_training`` runs it over one or more loaders and gives
the ``dlstore profile`` report, timeline, picture and trace for each.

::

    step = training_step(model, torch.nn.CrossEntropyLoss(), optimizer, device="cuda")
    result = profile_training({"ImageFolder": folder_loader, "dlstore": store_loader}, step,
                              steps=100, device="cuda", plot="profile.png", trace_dir="traces")
    print(result)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .profiling import LoaderReport
from .timeline import Timeline, record_timeline

__all__ = ["TrainingProfile", "profile_training", "training_step"]


def training_step(model: Any, loss_fn: Callable[[Any, Any], Any], optimizer: Any, *,
                  device: Any = "cpu", scale_uint8: bool = True) -> Callable[[Any, Any], None]:
    """``step(x, y)``: the batch to ``device`` (uint8 images as float ``x / 255`` when ``scale_uint8``),
    forward, ``loss_fn(model(x), y)``, backward, ``optimizer.step()``. Your model, loss and optimiser."""
    import torch

    dev = torch.device(device)

    def step(x: Any, y: Any) -> None:
        x = x.to(dev, non_blocking=True)
        if scale_uint8 and not x.is_floating_point():
            x = x.float().div_(255)
        y = torch.as_tensor(y).to(dev, non_blocking=True)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


@dataclass
class TrainingProfile:
    """One ``(label, LoaderReport, Timeline)`` per loader, in the order given; ``figure`` when plotted."""

    runs: list[tuple[str, LoaderReport, Timeline]]
    figure: Any = None

    def __str__(self) -> str:
        parts = [f"== {label} ==\n{report}\n{timeline}" for label, report, timeline in self.runs]
        if len(self.runs) > 1:
            parts.append("compare   " + "; ".join(f"{label}: {tl.summary()}, {tl.duration:.2f} s"
                                                  for label, _, tl in self.runs))
        return "\n\n".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {label: {"report": report.to_json(), "timeline": timeline.to_json()}
                for label, report, timeline in self.runs}


def profile_training(loaders: Mapping[str, Iterable[Any]] | Iterable[Any], step: Callable[[Any, Any], Any], *,
                     steps: int = 50, device: Any = None, skip_first: int = 1,
                     trace_dir: str | os.PathLike | None = None, plot: str | os.PathLike | None = None,
                     util_interval: float = 0.05, title: str = "") -> TrainingProfile:
    """Run ``steps`` steps of ``step(x, y)`` over each loader (``{label: loader}``, or one loader),
    one after the other, timing each step's wait for data and body; on CUDA sampling GPU utilisation.

    Args:
        loaders: the loaders to compare (the current pipeline first: the plot's top panel), or one.
        step: your training step, e.g. ``training_step(model, loss_fn, optimizer, device=...)``.
        steps: steps per loader (the loader restarts when an epoch is shorter); the first
            ``skip_first`` (worker start-up) are left out of the numbers.
        device: where the step runs: CUDA is synchronised at the step boundaries and sampled.
        trace_dir: write a ``torch.profiler`` trace per loader (a subfolder by label with several).
        plot: write the timelines as a PNG (needs ``pip install 'dlstore[plot]'``, checked first).
    """
    if plot is not None:
        from .timeline_plot import check_matplotlib

        check_matplotlib()
    named = dict(loaders) if isinstance(loaders, Mapping) else {"loader": loaders}
    runs = []
    for label, loader in named.items():
        where = trace_dir
        if trace_dir is not None and len(named) > 1:
            where = os.path.join(trace_dir, "".join(c if c.isalnum() or c in "-_." else "_" for c in label))
        report, timeline = record_timeline(loader, step, steps=steps, device=device, label=label,
                                           skip_first=skip_first, trace_dir=where, util_interval=util_interval)
        runs.append((label, report, timeline))
    result = TrainingProfile(runs)
    if plot is not None:
        from .timeline_plot import plot_timelines

        result.figure = plot_timelines([tl for _, _, tl in runs], plot, title=title)
    return result
