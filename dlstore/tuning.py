"""How many CPUs this process may really use, and (later) DataLoader settings by measurement."""

from __future__ import annotations

import math
import os
from pathlib import Path


def _cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by the container's cgroup quota, or None when unlimited / unknown.

    cgroup v2: ``cpu.max`` holds ``"<quota> <period>"`` or ``"max <period>"``.
    cgroup v1: ``cpu/cpu.cfs_quota_us`` (-1 when unlimited) and ``cpu/cpu.cfs_period_us``.
    """
    try:
        quota_text, period_text = (root / "cpu.max").read_text().split()[:2]
        if quota_text != "max":
            return int(quota_text) / int(period_text)
        return None
    except (OSError, ValueError):
        pass
    for folder in (root / "cpu", root / "cpu,cpuacct"):
        try:
            quota = int((folder / "cpu.cfs_quota_us").read_text())
            period = int((folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota / period if quota > 0 and period > 0 else None
    return None


def usable_cpus() -> int:
    """CPUs this process may use: affinity mask, capped by the cgroup quota (at least 1).

    ``os.cpu_count()`` counts the host's cores, also inside a container limited to two.
    """
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        count = os.cpu_count() or 1
    limit = _cgroup_cpu_limit()
    if limit is not None:
        count = min(count, max(1, math.ceil(limit)))
    return max(1, count)
