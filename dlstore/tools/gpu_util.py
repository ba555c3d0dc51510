"""GPU utilisation sampled beside a training loop: what nvidia-smi's GPU-Util shows, over time.

``UtilSampler`` calls ``torch.cuda.utilization(device)`` (NVML, through nvidia-ml-py / pynvml) from a
daemon thread at a fixed rate and keeps ``(seconds, percent)`` pairs. NVML's figure is the share of
its last sample period (1/6 s to 1 s, by GPU) in which a kernel ran, so it swings 0-100 % when the
loop alternates waiting for data and computing. Without CUDA or NVML the sampler records nothing
and says why (``reason``). ``summarise_utilisation`` turns the pairs into the report's numbers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["UtilSampler", "UtilStats", "summarise_utilisation"]


@dataclass(frozen=True)
class UtilStats:
    """Utilisation over a window: ``samples`` readings, their ``mean`` (percent), ``zero_share``
    (the fraction of readings at 0 %: the GPU idle for a whole NVML period) and ``interval`` (s)."""

    samples: int
    mean: float
    zero_share: float
    interval: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return (f"GPU utilisation     mean {self.mean:.0f} %, at 0 % {self.zero_share:.0%} of the time "
                f"({self.samples} samples every {self.interval * 1e3:.0f} ms)")


def summarise_utilisation(samples: Sequence[tuple[float, float]], *, start: float | None = None,
                          end: float | None = None) -> UtilStats | None:
    """Mean, share at 0 % and sampling interval of the ``(seconds, percent)`` readings in
    ``[start, end]`` (all of them when not given); None when no reading falls there.

    Readings outside 0-100 (NVML's "not supported" comes back as a negative or absurd value on some
    drivers) are dropped. The interval is the median gap between kept readings (0 for one).
    """
    kept = sorted((t, float(u)) for t, u in samples
                  if (start is None or t >= start) and (end is None or t <= end) and 0 <= u <= 100)
    if not kept:
        return None
    values = [u for _, u in kept]
    gaps = sorted(b[0] - a[0] for a, b in zip(kept, kept[1:]))
    return UtilStats(samples=len(kept), mean=sum(values) / len(values),
                     zero_share=sum(u == 0 for u in values) / len(values),
                     interval=gaps[len(gaps) // 2] if gaps else 0.0)


class UtilSampler:
    """Sample GPU utilisation every ``interval`` seconds on a daemon thread, between ``start()`` and
    ``stop()`` (or as a ``with`` block). ``samples`` holds ``(clock(), percent)`` pairs.

    ``read`` replaces ``torch.cuda.utilization(device)`` (tests, other counters). Where CUDA or
    NVML is missing, ``available`` is False, ``reason`` says why and nothing is sampled.
    """

    def __init__(self, device: Any = None, *, interval: float = 0.05,
                 read: Callable[[], float] | None = None, clock: Callable[[], float] = time.perf_counter):
        self.interval = interval
        self.clock = clock
        self.samples: list[tuple[float, float]] = []
        self.reason = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._read = read if read is not None else self._nvml(device)

    def _nvml(self, device: Any) -> Callable[[], float] | None:
        import torch

        dev = torch.device(device) if device is not None else None
        if dev is not None and dev.type != "cuda":
            self.reason = f"the step runs on {dev}, not a CUDA device"
            return None
        if not torch.cuda.is_available():
            self.reason = "CUDA is not available"
            return None
        try:
            torch.cuda.utilization(dev)          # NVML present and answering?
        except Exception as exc:  # noqa: BLE001 - pynvml missing, NVML not loaded, unsupported GPU
            self.reason = f"torch.cuda.utilization failed ({exc}); pip install nvidia-ml-py"
            return None
        return lambda: torch.cuda.utilization(dev)

    @property
    def available(self) -> bool:
        return self._read is not None

    def _run(self) -> None:
        read, wait = self._read, self._stop.wait
        assert read is not None
        while True:
            try:
                self.samples.append((self.clock(), float(read())))
            except Exception as exc:  # noqa: BLE001 - stop sampling, keep the loop running
                self.reason = f"sampling stopped: {exc}"
                return
            if wait(self.interval):
                return

    def start(self) -> UtilSampler:
        if self.available and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="dlstore-gpu-util", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def __enter__(self) -> UtilSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
