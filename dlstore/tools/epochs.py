"""Whole epochs timed so that a ratio between two loaders means something on a shared machine.

``time_epochs({"a": loader_a, "b": loader_b})`` first runs one epoch of each on its own (the
cold epoch: imports, opening the store, first page faults, thread start-up), then ``rounds``
rounds in which every loader runs epochs for at least ``min_seconds`` (a fast loader's epoch
of a few milliseconds is repeated, so one scheduler hiccup is a small part of the round).
Rounds interleave the loaders, so load from other jobs hits them alike; each loader's rate is
the median over rounds, which ignores one stalled round.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .._system import usable_cpus


@dataclass
class EpochRates:
    """Samples/s of one loader: its cold first epoch, and one rate per timed round after it."""

    first: float
    rounds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.rounds) if self.rounds else self.first

    @property
    def spread(self) -> tuple[float, float]:
        return (min(self.rounds), max(self.rounds)) if self.rounds else (self.first, self.first)


def _epoch(loader: Iterable[Any], count: Callable[[Any], int]) -> tuple[int, float]:
    start = time.perf_counter()
    samples = sum(count(batch) for batch in loader)
    return samples, time.perf_counter() - start


def _labels(batch: Any) -> int:
    return len(batch[1])


def time_epochs(
    loaders: dict[str, Iterable[Any]],
    *,
    rounds: int = 5,
    min_seconds: float = 0.25,
    count: Callable[[Any], int] = _labels,
    clock: Callable[[Iterable[Any], Callable[[Any], int]], tuple[int, float]] = _epoch,
) -> dict[str, EpochRates]:
    """The cold first epoch of each loader, then ``rounds`` interleaved rounds; see the module docstring.

    Args:
        loaders: name -> a re-iterable loader (one pass is one epoch).
        rounds: timed rounds after the cold epochs.
        min_seconds: the least time a loader runs epochs for in one round.
        count: samples in a batch (default: the length of its labels, ``batch[1]``).
        clock: times one epoch, ``(samples, seconds)``; tests give a fake one.
    """
    out: dict[str, EpochRates] = {}
    for name, loader in loaders.items():
        samples, seconds = clock(loader, count)
        out[name] = EpochRates(first=samples / max(seconds, 1e-9))
    for _ in range(rounds):
        for name, loader in loaders.items():
            samples = 0
            seconds = 0.0
            while seconds < min_seconds or samples == 0:
                got, took = clock(loader, count)
                samples, seconds = samples + got, seconds + took
            out[name].rounds.append(samples / max(seconds, 1e-9))
    return out


def load_note(load: float | None = None, usable: int | None = None) -> str | None:
    """A sentence when the machine is loaded (1-minute load average above the usable CPUs), else None."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            return None
    usable = usable_cpus() if usable is None else usable
    if load <= usable:
        return None
    return (f"the machine is loaded: 1-minute load average {load:.1f} on {usable} usable CPU(s); other "
            "jobs share the CPUs, so both rates are lower and vary more than on an idle machine")


__all__ = ["EpochRates", "load_note", "time_epochs"]
