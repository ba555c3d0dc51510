"""What ``tune`` returns: the recommended loader kwargs, the speed-up it confirmed, and every trial."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from .._system import CpuInfo
from .throughput import Trial

# Trials of these stages are not evidence for a rate: the warm-up pays the cold start.
UNCOUNTED = ("warm-up",)


def paired_speedup(trials: list[Trial], best: dict[str, Any], baseline: dict[str, Any]) -> float:
    """Median of ``best / baseline`` over the confirmation's pairs: each ``baseline`` confirm trial
    and the ``best`` one right after it (0.0 when there is no pair)."""
    confirm = [t for t in trials if t.stage == "confirm"]
    ratios = [b.batches_per_s / a.batches_per_s for a, b in zip(confirm, confirm[1:])
              if a.kwargs == baseline and b.kwargs == best and a.batches_per_s > 0]
    return statistics.median(ratios) if ratios else 0.0


class TuneResult(dict):
    """The recommended DataLoader kwargs (a dict: ``DataLoader(ds, **result)``), with the evidence.

    The speed-up is the confirmation's: the recommendation and the baseline re-measured in turn.

    With ``result["backend"]`` (dlstore's threads or ring won) they are for ``dlstore.loader(ds, **result)``.

    Attributes:
        trials: every measured configuration, in the order run.
        best: the recommended trial.
        baseline: the ``num_workers=0`` trial.
        thread_check: the intra-op oversubscription check (``oversubscription.ThreadCheck``), or None.
        one_thread: measured (and recommended) with ``torch.set_num_threads(1)``.
        batch_bytes: bytes of one collated batch on the host.
        warnings: human-readable warnings (memory-heavy recommendation, settings slower
            than workers=0, budget too small to finish the search).
        cpus: the ``CpuInfo`` the worker range was based on.
        device: the target device, or None.
    """

    def __init__(self, kwargs: dict[str, Any], *, trials: list[Trial], best: Trial, baseline: Trial,
                 batch_bytes: int, warnings: list[str], cpus: CpuInfo, device: str | None,
                 thread_check: Any = None, one_thread: bool = False):
        super().__init__(kwargs)
        self.trials = trials
        self.best = best
        self.baseline = baseline
        self.batch_bytes = batch_bytes
        self.warnings = warnings
        self.cpus = cpus
        self.device = device
        self.thread_check = thread_check
        self.one_thread = one_thread

    @property
    def kwargs(self) -> dict[str, Any]:
        """A plain-dict copy of the recommendation."""
        return dict(self)

    def call(self, name: str = "dataset") -> str:
        """The recommended loader as code: ``DataLoader(dataset, ...)`` or ``dlstore.loader(dataset, ...)``."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.items())
        store_loader = "backend" in self
        call = f"{'dlstore.loader' if store_loader else 'DataLoader'}({name}, {args})"
        return f"torch.set_num_threads(1); {call}" if self.one_thread else call

    def rate(self, kwargs: dict[str, Any], stage: str | None = None) -> float:
        """Median batches/s over the trials of exactly these kwargs, the warm-up left out, or of one
        ``stage`` only (0.0 if never measured)."""
        rates = [t.batches_per_s for t in self.trials if t.kwargs == dict(kwargs) and t.stage not in UNCOUNTED
                 and (stage is None or t.stage == stage)]
        return statistics.median(rates) if rates else 0.0

    @property
    def speedup(self) -> float:
        """The confirmation's claim: the median over its pairs (the baseline, then the recommendation,
        measured in turn) of recommendation / baseline; 1.0 when the baseline is the recommendation."""
        if self.best.kwargs == self.baseline.kwargs:
            return 1.0
        return paired_speedup(self.trials, self.best.kwargs, self.baseline.kwargs)

    def to_json(self) -> dict[str, Any]:
        """Everything as JSON-able data."""
        return {"kwargs": dict(self), "speedup_vs_workers0": self.speedup,
                "batch_bytes": self.batch_bytes, "device": self.device, "cpus": asdict(self.cpus),
                "warnings": list(self.warnings), "trials": [asdict(t) for t in self.trials],
                "one_thread": self.one_thread, "call": self.call(),
                "thread_check": asdict(self.thread_check) if self.thread_check is not None else None}

    def table(self) -> str:
        """The trials as an aligned text table, the recommendation marked with ``*``."""
        head = (f"  {'workers':>7} {'threads':>7} {'prefetch':>8} {'pin':>5} {'persist':>7} {'batches/s':>10} "
                f"{'samples/s':>10} {'vs w=0':>7} {'start s':>7}  stage / note")
        lines = [head]
        base = self.rate(self.baseline.kwargs, "confirm") or self.rate(self.baseline.kwargs)
        for t in self.trials:
            k = t.kwargs
            mark = "*" if t is self.best else " "
            note = t.stage + (f": {t.note}" if t.note else "")
            lines.append(
                f"{mark} {t.num_workers:>7} {'ring' if k.get('backend') == 'ring' else k.get('num_threads') or '-':>7} "
                f"{str(k.get('prefetch_factor', '-')):>8} "
                f"{'yes' if k.get('pin_memory') else 'no':>5} "
                f"{('yes' if k.get('persistent_workers') else 'no') if t.num_workers else '-':>7} "
                f"{t.batches_per_s:>10.1f} {t.samples_per_s:>10.0f} "
                f"{t.batches_per_s / base:>6.2f}x {t.startup_s:>7.2f}  {note}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"TuneResult({dict(self)!r}, speedup={self.speedup:.2f}x over workers=0)"



__all__ = ["TuneResult", "paired_speedup"]
