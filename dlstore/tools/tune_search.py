"""The steps of ``tune``'s search (``tuning.py``'s module doc): the sweep, the refinement, the confirmation."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from typing import Any

from .throughput import Trial, loader_kwargs
from .tune_result import UNCOUNTED, paired_speedup

# Two measurements within this fraction of each other are considered equal.
NOISE = 0.05
# The confirmation measures the winner and the baseline in at least this many pairs.
CONFIRM_PAIRS = 5
# The least window of a trial (seconds): a rate over a shorter one is mostly start-up noise.
MIN_WINDOW = 0.25


class TuneSearch:
    """The steps of ``tune`` (module doc): the sweep, the refinement, the confirmation, over one
    list of trials; every trial window fixed up front, so the budget decides how many settings are
    measured, not how long each is. It takes ``tune``'s options as they are: hence many."""

    def __init__(self, measure: Callable[[dict[str, Any], float], Trial], clock: Callable[[], float], *,
                 budget: float, repeats: int, noise: float, log: Callable[[str], None] | None, batch_size: int,
                 cuda: bool, workers: list[int], thread_counts: list[int], usable: int, max_workers: int | None,
                 batches_per_epoch: int):
        self.measure, self.clock, self.budget, self.repeats, self.noise, self.log = \
            measure, clock, budget, repeats, noise, log
        self.batch_size, self.cuda, self.workers, self.thread_counts = batch_size, cuda, workers, thread_counts
        self.usable, self.max_workers, self.batches_per_epoch = usable, max_workers, batches_per_epoch
        # the shared-memory ring applies where threads do (a fixed-shape StoreDataset)
        self.ring_counts = [w for w in workers if w > 0] if thread_counts else []
        self.deadline = clock() + budget
        sweep_size = 1 + len(thread_counts) + len(workers) + len(self.ring_counts)
        # the confirmation gets a quarter of the budget, so its medians, the claim, come from the
        # longest windows rather than from what is left
        planned = 1 + repeats * (sweep_size + 6)
        self.window = max(MIN_WINDOW, 0.45 * budget / planned)
        self.confirm_pairs = max(repeats, CONFIRM_PAIRS)
        self.confirm_window = max(self.window, 0.25 * budget / (2 * self.confirm_pairs))
        self.trials: list[Trial] = []
        self.notes: list[str] = []
        self.skipped: list[str] = []
        self.persist_note = ""
        self.baseline = self.config(0)

    # --- measuring ------------------------------------------------------------------------

    def config(self, workers: int, prefetch: int = 2, pin: bool | None = None, persistent: bool = True
               ) -> dict[str, Any]:
        return loader_kwargs(self.batch_size, workers, prefetch_factor=prefetch,
                             pin_memory=self.cuda if pin is None else pin, persistent_workers=persistent)

    def like(self, kwargs: dict[str, Any], workers: int) -> dict[str, Any]:
        """``config(workers)`` through the same kind of loader as ``kwargs`` (the ring or the DataLoader)."""
        if kwargs.get("backend") == "ring" and workers > 0:
            return dict(self.config(workers), backend="ring")
        return self.config(workers)

    def run(self, kwargs: dict[str, Any], stage: str) -> Trial:
        trial = self.measure(kwargs, self.confirm_window if stage == "confirm" else self.window)
        trial.stage = stage
        self.trials.append(trial)
        if self.log is not None:
            self.log(f"{stage:<10} {short(kwargs):<52} {trial.batches_per_s:8.1f} batches/s "
                     f"(start-up {trial.startup_s:.2f} s)")
        return trial

    def measure_all(self, settings: list[tuple[dict[str, Any], str]], required: Iterable[dict[str, Any]] = ()) -> None:
        """``repeats`` round-robin rounds; a setting not required runs only while the budget lasts,
        and one left short of ``repeats`` measurements is not judged (``complete``)."""
        required = list(required)
        for _ in range(self.repeats):
            for kwargs, stage in settings:
                if kwargs in required or self.clock() < self.deadline:
                    self.run(kwargs, stage)
                elif f"{stage} {short(kwargs)}" not in self.skipped:
                    self.skipped.append(f"{stage} {short(kwargs)}")

    def counted(self, kwargs: dict[str, Any]) -> list[float]:
        return [t.batches_per_s for t in self.trials
                if t.kwargs == kwargs and t.stage not in UNCOUNTED + ("confirm",)]

    def rate(self, kwargs: dict[str, Any]) -> float:
        # The median: not the best (one setting may get a lucky quiet window the others never had),
        # not the mean (one stalled run would sink it).
        return statistics.median(self.counted(kwargs))

    def complete(self) -> list[dict[str, Any]]:
        unique: list[dict[str, Any]] = []
        for t in self.trials:
            if t.kwargs not in unique and len(self.counted(t.kwargs)) >= self.repeats:
                unique.append(t.kwargs)
        return unique

    def pick(self, pool: Iterable[dict[str, Any]]) -> dict[str, Any]:
        """The cheapest setting within the noise margin of the fastest: more workers and deeper queues
        must earn their memory by a clear margin."""
        pool = list(pool)
        top = max(self.rate(k) for k in pool)
        return min((k for k in pool if self.rate(k) >= top / (1 + self.noise)),
                   key=lambda k: (int(k.get("num_workers", 0)), int(k.get("num_threads") or 0),
                                  int(k.get("prefetch_factor") or 0),
                                  bool(k.get("pin_memory")), not k.get("persistent_workers", True)))

    # --- the steps ------------------------------------------------------------------------

    def sweep(self) -> dict[str, Any]:
        """A warm-up, then the baseline and the default loader (always measured), then the rest."""
        self.run(self.baseline, "warm-up")
        usable = max(self.usable, 1)
        default = (dict(self.config(0), backend="threads", num_threads=max(self.thread_counts)) if self.thread_counts
                   else self.config(max(c for c in self.workers if c <= usable)))
        sweep = [(self.baseline, "baseline"), (default, "default")]
        sweep += [(dict(self.config(0), backend="threads", num_threads=t), "threads") for t in self.thread_counts]
        sweep += [(self.config(w), "workers") for w in self.workers]
        sweep += [(dict(self.config(w), backend="ring"), "ring") for w in self.ring_counts]
        seen: list[dict[str, Any]] = []
        sweep = [(k, s) for k, s in sweep if not (k in seen or seen.append(k))]
        self.measure_all(sweep, required=[self.baseline, default])
        return self.pick(self.complete())

    def refine(self, best: dict[str, Any]) -> dict[str, Any]:
        """More workers while the top count wins, the midpoints next to the best count, prefetch,
        pin_memory (CUDA), persistent_workers."""
        # The best at the top of the range: the trend may go on (workers that wait on I/O, or a busy
        # machine where more processes get more CPU time), so double while it pays.
        top_count = self.workers[-1]
        while (self.max_workers is None and int(best["num_workers"]) == top_count
               and top_count < 4 * self.usable and self.clock() < self.deadline):
            top_count = min(2 * top_count, 4 * self.usable)
            self.measure_all([(self.like(best, top_count), "extend")])
            best = self.pick(self.complete())
        counts = sorted({int(k["num_workers"]) for k in self.complete() if k.get("backend") == best.get("backend")})
        best_workers = int(best["num_workers"])
        if best_workers > 0 and best_workers in counts:
            i = counts.index(best_workers)
            mids = {(best_workers + nb) // 2 for nb in (counts[i - 1] if i > 0 else None,
                                                        counts[i + 1] if i + 1 < len(counts) else None) if nb is not None}
            self.measure_all([(self.like(best, m), "refine") for m in sorted(mids) if m >= 1 and m not in counts])
            best = self.pick(self.complete())
        # prefetch around the best worker setting, when one came within 30 % of the best
        with_workers = [k for k in self.complete() if int(k["num_workers"]) > 0]
        if with_workers:
            local = self.pick(with_workers)
            if self.rate(local) >= 0.7 * self.rate(best):
                self.measure_all([(dict(local, prefetch_factor=p), "prefetch") for p in (1, 4, 8)])
                best = self.pick(self.complete())
        if self.cuda:  # pin_memory: on by default for CUDA; check that it pays
            self.measure_all([(dict(best, pin_memory=not best.get("pin_memory")), "pin")])
            best = self.pick(self.complete())
        if int(best["num_workers"]) > 0:
            last = [t for t in self.trials if t.kwargs == best][-1]
            if last.batches >= self.batches_per_epoch:
                self.measure_all([(dict(best, persistent_workers=False), "persistent")])
                best = self.pick(self.complete())
            else:
                self.persist_note = (f"persistent_workers=True keeps the workers between epochs: saves their "
                                     f"start-up (~{last.startup_s:.2f} s measured) once per epoch of "
                                     f"{self.batches_per_epoch} batches (~{self.batches_per_epoch / self.rate(best):.1f} s)")
        return best

    def confirm(self, best: dict[str, Any]) -> dict[str, Any]:
        """The winner and the baseline in turn, in pairs; the claim is the median of the pairs' ratios
        (each pair shares the minute it ran in, so drift in the load cancels). Also the notes on what
        was slower than the baseline and what the budget left out."""
        if best != self.baseline:
            for _ in range(self.confirm_pairs):
                self.run(self.baseline, "confirm")
                self.run(best, "confirm")
            claim = paired_speedup(self.trials, best, self.baseline)
            if claim < 1 + self.noise:
                self.notes.append(f"the sweep's winner ({short(best)}, {self.rate(best):.1f} batches/s) was not "
                                  f"faster than num_workers=0 when measured in turn beside it ({claim:.2f}x, median of "
                                  f"{self.confirm_pairs} pairs): num_workers=0 is recommended")
                best = self.baseline
        base_rate = self.rate(self.baseline)
        slower = [k for k in self.complete() if k != self.baseline and self.rate(k) < base_rate * (1 - self.noise)]
        for t in self.trials:
            if t.kwargs in slower:
                t.note = (t.note + "; " if t.note else "") + "slower than workers=0"
        if slower:
            self.notes.append(f"{len(slower)} of {len(self.complete())} settings were slower than num_workers=0 "
                              f"at the median (e.g. {short(slower[0])}): more processes are not free here")
        if self.skipped:
            self.notes.append(f"budget of {self.budget:g} s spent before {len(self.skipped)} setting(s) had "
                              f"{self.repeats} measurements (first: {self.skipped[0]}); they were not compared: "
                              "give more --budget for a fuller search")
        return best


def short(kwargs: dict[str, Any]) -> str:
    """A setting as ``name=value, ...``, the batch size left out."""
    return ", ".join(f"{k}={v}" for k, v in kwargs.items() if k != "batch_size")
