"""Too many threads for the CPUs: torch's intra-op pool times the processes, against the usable CPUs.

torch runs ``torch.stack`` (the default collate), copies and most kernels on an intra-op
thread pool of ``torch.get_num_threads()`` threads per process (the physical cores by
default). With several training processes on one host, or other jobs on the CPUs, those
threads outnumber the CPUs; a kernel split over them waits for its slowest thread, and a
descheduled one holds up the rest (docs/shared-machines.md has what it cost on a loaded
2-core machine).
torchrun sets ``OMP_NUM_THREADS=1`` per process for this reason; DataLoader workers run
one thread each.

``check_threads()`` says so by counting (threads x processes against the usable CPUs, and
the load average against them); ``probe_intra_op()`` measures it: the same stack with the
current thread count and with one, interleaved.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._system import usable_cpus

FIX = ("torch.set_num_threads(1) at the start of each training process, or OMP_NUM_THREADS=1 in "
       "its environment (torchrun sets it per process)")
# The probe calls it oversubscribed when N threads take this many times one thread's time.
PROBE_SLOWER = 1.5


@dataclass(frozen=True)
class ThreadCheck:
    """What ``check_threads`` found.

    Attributes:
        threads: torch intra-op threads per process.
        processes: training processes on this host sharing the CPUs (``LOCAL_WORLD_SIZE``).
        extra: worker processes or loader threads beside each of them (one thread each).
        usable: CPUs this process may use.
        load: 1-minute load average (None when unknown).
        probe: seconds of the probe's stacks with ``threads`` and with 1 thread, when measured.
    """

    threads: int
    processes: int
    usable: int
    extra: int = 0
    load: float | None = None
    probe: tuple[float, float] | None = None

    @property
    def counted(self) -> bool:
        """More runnable threads than CPUs, by count or by the load already on them."""
        busy = self.load is not None and self.load > self.usable
        wanted = self.processes * (self.threads + self.extra)
        return self.threads > 1 and (wanted > self.usable or busy)

    @property
    def measured(self) -> bool | None:
        """The probe's verdict: N threads slower than one by ``PROBE_SLOWER`` (None: not measured)."""
        if self.probe is None:
            return None
        many, one = self.probe
        return many > PROBE_SLOWER * one

    @property
    def oversubscribed(self) -> bool:
        return bool(self.measured) if self.probe is not None else self.counted

    def message(self) -> str | None:
        """A warning naming the numbers and the fix, or None when the threads fit."""
        if not self.oversubscribed:
            return None
        load = f", 1-minute load average {self.load:.1f}" if self.load is not None else ""
        beside = f" beside {self.extra} worker(s)/loader thread(s) each" if self.extra else ""
        said = (f"oversubscribed: torch runs {self.threads} intra-op threads in each of {self.processes} "
                f"training process(es){beside} on {self.usable} usable CPU(s){load}")
        if self.probe is not None:
            many, one = self.probe
            said += (f"; measured: a batch stack took {many / max(one, 1e-9):.1f}x as long with "
                     f"{self.threads} threads as with 1 ({many * 1e3:.1f} vs {one * 1e3:.1f} ms in all)")
        return f"{said}. Set {FIX}"


def local_processes() -> int:
    """Training processes this host runs side by side (torchrun's ``LOCAL_WORLD_SIZE``, else 1)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def probe_intra_op(samples: Sequence[Any], *, rounds: int = 15,
                   clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """Seconds to ``torch.stack(samples)`` ``rounds`` times with the current thread count and with one,
    interleaved (so outside load hits both alike); the totals, where a stall shows (not the median)."""
    import torch

    threads = torch.get_num_threads()
    totals = [0.0, 0.0]
    try:
        for _ in range(rounds):
            for k, count in enumerate((threads, 1)):
                torch.set_num_threads(count)
                start = clock()
                torch.stack(list(samples))
                totals[k] += clock() - start
    finally:
        torch.set_num_threads(threads)
    return totals[0], totals[1]


def check_threads(*, extra_processes: int = 0, samples: Sequence[Any] | None = None,
                  threads: int | None = None, usable: int | None = None,
                  load: float | None = None) -> ThreadCheck:
    """Whether torch's intra-op threads oversubscribe the CPUs here.

    Args:
        extra_processes: worker processes or loader threads that run beside each training process.
        samples: tensors to stack for a measured verdict (``probe_intra_op``); None: count only.
        threads, usable, load: override what is read from torch and the machine (tests).
    """
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    probe = probe_intra_op(samples) if samples is not None and threads > 1 else None
    return ThreadCheck(threads=threads, processes=local_processes(), extra=extra_processes,
                       usable=usable_cpus() if usable is None else usable,
                       load=_load() if load is None else load, probe=probe)


__all__ = ["FIX", "ThreadCheck", "check_threads", "local_processes", "probe_intra_op"]
