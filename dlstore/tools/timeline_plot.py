"""``plot_timelines``: loop timelines one above the other (matplotlib, the optional ``plot`` extra).

Each panel shows, over the measured seconds, the spans the loop waited for data (red) and computed
(green); on CUDA the sampled GPU utilisation (0-100 %) as a line over them, which is the swing
nvidia-smi shows. The wait share (and the mean utilisation and the share of time at 0 %) is written
on the panel. The panels share the time axis, so the same steps done faster take less of it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..errors import UsageError
from .timeline import Timeline

__all__ = ["check_matplotlib", "plot_timelines"]

INSTALL = "pip install 'dlstore[plot]'"


def check_matplotlib() -> None:
    """Raise ``UsageError`` naming the extra to install when matplotlib is missing (call it before
    measuring, so a missing plot library does not cost the run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        why = "is not installed" if isinstance(exc, ModuleNotFoundError) else f"cannot be imported ({exc})"
        raise UsageError(f"--plot needs matplotlib, which {why}: {INSTALL}") from None


def panel_text(timeline: Timeline) -> str:
    """What a panel says: the wait (stall) share and, with readings, the utilisation numbers."""
    text = f"{len(timeline.steps)} steps in {timeline.duration:.2f} s   data stall (wait share) {timeline.wait_share():.0%}"
    stats = timeline.util_stats()
    if stats is not None:
        return text + f"   GPU util mean {stats.mean:.0f} %, at 0 % {stats.zero_share:.0%} of the time"
    return text + f"   mean step {1e3 * sum(timeline.steps) / max(len(timeline.steps), 1):.1f} ms, " \
                  f"mean wait {1e3 * sum(timeline.waits) / max(len(timeline.waits), 1):.1f} ms (no GPU utilisation)"


def plot_timelines(timelines: Sequence[Timeline], path: str | os.PathLike | None = None, *,
                   title: str = "") -> Any:
    """Draw ``timelines`` one above the other and save the PNG at ``path`` (when given).

    Returns:
        The matplotlib ``Figure`` (one axes per timeline, in order; the panel text is its ``texts``).

    Raises:
        UsageError: matplotlib is not installed (the message names ``pip install 'dlstore[plot]'``).
    """
    check_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=(10, 2.4 * len(timelines) + 0.6), layout="constrained")
    axes = fig.subplots(len(timelines), 1, squeeze=False, sharex=True)[:, 0]
    for ax, tl in zip(axes, timelines):
        ax.broken_barh([(s, w) for s, w in zip(tl.starts, tl.waits)], (0, 100), facecolors="#e8a0a0")
        ax.broken_barh([(s + w, d) for s, w, d in zip(tl.starts, tl.waits, tl.steps)], (0, 100),
                       facecolors="#a8d8a8")
        handles = [Patch(color="#e8a0a0", label="waiting for data"), Patch(color="#a8d8a8", label="step")]
        if tl.util:
            times, values = zip(*tl.util)
            (line,) = ax.plot(times, values, color="black", linewidth=1.2, label="GPU util %")
            handles.append(line)
            ax.set_ylabel("GPU util %")
        else:
            ax.set_yticks([])
        ax.set_ylim(0, 112)
        ax.set_title(tl.label, loc="left", fontsize=10)
        ax.text(0.995, 0.97, panel_text(tl), transform=ax.transAxes, ha="right", va="top", fontsize=9,
                bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none"})
        ax.legend(handles=handles, loc="lower right", fontsize=8, ncols=len(handles), framealpha=0.85)
    axes[-1].set_xlabel("seconds into the measured steps")
    if title:
        fig.suptitle(title, fontsize=10)
    if path is not None:
        fig.savefig(os.fspath(path), dpi=110)
    return fig
