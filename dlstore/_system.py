"""What the library itself needs to know of the machine: the CPUs this process may use (affinity,
cgroup quotas), its memory limit, and which pages of a file are cached. The benchmark probes
live in ``dlstore.tools.bench.probes``."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import math
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import SystemProbeError

_CGROUP_ROOT = Path("/sys/fs/cgroup")


# --------------------------------------------------------------------------- CPUs


def _read_cgroup_v2(folder: Path) -> float | None | bool:
    """CPUs from ``folder/cpu.max``: a float, None for "max", False when absent/unreadable."""
    try:
        fields = (folder / "cpu.max").read_text().split()
    except OSError:
        return False
    if not fields:
        return False
    if fields[0] == "max":
        return None
    try:
        quota = int(fields[0])
        period = int(fields[1]) if len(fields) > 1 else 100_000
    except ValueError:
        return False
    return quota / period if quota > 0 and period > 0 else None


def _self_cgroup_path(proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> str:
    """This process's cgroup v2 path (``"0::/a/b"`` -> ``"a/b"``), ``""`` when unknown."""
    try:
        for line in proc_self_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                return line[3:].strip().strip("/")
    except OSError:
        pass
    return ""


def _cgroup_cpu_limit(root: Path = _CGROUP_ROOT, *, cgroup_path: str = "") -> float | None:
    """CPUs allowed by the container's cgroup quota, or None when unlimited / unknown.

    cgroup v2: ``cpu.max`` holds ``"<quota> <period>"`` or ``"max <period>"``;
    every level from ``root/cgroup_path`` up to ``root`` is checked and the
    tightest quota wins (inside a container the process's own cgroup is usually
    ``root`` itself).
    cgroup v1: ``cpu/cpu.cfs_quota_us`` (-1 when unlimited) and ``cpu/cpu.cfs_period_us``
    (also under ``cpu,cpuacct/``).

    Args:
        root: the cgroup mount point (a fixture folder in tests).
        cgroup_path: this process's cgroup below ``root`` (from ``/proc/self/cgroup``).
    """
    root = Path(root)
    parts = [p for p in cgroup_path.split("/") if p]
    found_v2 = False
    limits: list[float] = []
    for depth in range(len(parts), -1, -1):
        value = _read_cgroup_v2(root.joinpath(*parts[:depth]))
        if value is False:
            continue
        found_v2 = True
        if value is not None:
            limits.append(value)
    if found_v2:
        return min(limits) if limits else None
    for folder in (root / "cpu", root / "cpu,cpuacct"):
        try:
            quota = int((folder / "cpu.cfs_quota_us").read_text())
            period = int((folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota / period if quota > 0 and period > 0 else None
    return None


def _physical_cores(cpuinfo: Path = Path("/proc/cpuinfo"),
                    sys_cpu: Path = Path("/sys/devices/system/cpu")) -> int | None:
    """Distinct physical cores: (physical id, core id) pairs in ``/proc/cpuinfo``,
    else distinct ``topology/core_cpus_list`` (``thread_siblings_list``) in sysfs, else None."""
    try:
        cores: set[tuple[str, str]] = set()
        physical = core = None
        for line in cpuinfo.read_text().splitlines() + [""]:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "physical id":
                physical = value.strip()
            elif key == "core id":
                core = value.strip()
            elif not key:  # blank line: end of one processor's block
                if core is not None:
                    cores.add((physical or "0", core))
                physical = core = None
        if cores:
            return len(cores)
    except OSError:
        pass
    siblings: set[str] = set()
    for topology in sys_cpu.glob("cpu[0-9]*/topology"):
        for name in ("core_cpus_list", "thread_siblings_list"):
            try:
                siblings.add((topology / name).read_text().strip())
                break
            except OSError:
                continue
    return len(siblings) or None


@dataclass(frozen=True)
class CpuInfo:
    """What ``cpu_info()`` found.

    Attributes:
        logical: logical CPUs of the machine (``os.cpu_count()``: the host's, also in a container).
        physical: physical cores (hyper-threads counted once), or None when unknown.
        affinity: CPUs this process may be scheduled on (``os.sched_getaffinity``).
        cgroup_quota: CPUs' worth of time the cgroup quota allows (e.g. 2.5), None when unlimited.
        usable: what to size a process pool by: affinity capped by the rounded-up quota, at least 1.
    """

    logical: int
    physical: int | None
    affinity: int
    cgroup_quota: float | None
    usable: int

    def __str__(self) -> str:
        quota = "none" if self.cgroup_quota is None else f"{self.cgroup_quota:g} CPUs"
        return (f"{self.usable} usable CPU(s): {self.logical} logical, "
                f"{self.physical if self.physical is not None else '?'} physical core(s), "
                f"affinity {self.affinity}, cgroup quota {quota}")


def cpu_info(
    cgroup_root: str | os.PathLike = _CGROUP_ROOT,
    *,
    cgroup_path: str | None = None,
    cpuinfo: str | os.PathLike = "/proc/cpuinfo",
    sys_cpu: str | os.PathLike = "/sys/devices/system/cpu",
) -> CpuInfo:
    """Logical CPUs, physical cores, affinity, cgroup quota and the usable count.

    ``os.cpu_count()`` reports the host's cores inside a container; this does not.

    Args:
        cgroup_root: cgroup mount point; tests pass a folder of fixture files.
        cgroup_path: this process's cgroup below the root (default: read from
            ``/proc/self/cgroup`` when ``cgroup_root`` is the real mount, else ``""``).
        cpuinfo: file in ``/proc/cpuinfo`` format, for the physical core count.
        sys_cpu: sysfs CPU folder, the fallback for the physical core count.
    """
    root = Path(cgroup_root)
    if cgroup_path is None:
        cgroup_path = _self_cgroup_path() if root == _CGROUP_ROOT else ""
    logical = os.cpu_count() or 1
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        affinity = logical
    quota = _cgroup_cpu_limit(root, cgroup_path=cgroup_path)
    usable = affinity if quota is None else min(affinity, max(1, math.ceil(quota)))
    return CpuInfo(logical=logical, physical=_physical_cores(Path(cpuinfo), Path(sys_cpu)),
                   affinity=affinity, cgroup_quota=quota, usable=max(1, usable))


def usable_cpus() -> int:
    """CPUs this process may use: affinity mask, capped by the cgroup quota (at least 1).

    ``os.cpu_count()`` counts the host's cores, also inside a container limited to two.
    """
    return cpu_info().usable


def _own_memory_cgroups(proc: Path, cgroup_root: Path) -> Iterator[tuple[Path, str, str]]:
    """(folder, limit file, usage file) of each memory cgroup this process is in (v2 and v1)."""
    try:
        groups = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return
    for line in groups:
        try:
            _, controllers, path = line.split(":", 2)
        except ValueError:
            continue
        if controllers == "":          # v2: one unified hierarchy
            yield cgroup_root / path.lstrip("/"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            yield cgroup_root / "memory" / path.lstrip("/"), "memory.limit_in_bytes", "memory.usage_in_bytes"


def _limit(folder: Path, name: str) -> int | None:
    try:
        limit = int((folder / name).read_text().strip())
    except (OSError, ValueError):   # absent, or "max"
        return None
    return limit if limit < (1 << 60) else None   # v1 writes "no limit" as a huge number


def memory_limit_bytes(cgroup_root: Path = _CGROUP_ROOT, proc: Path = Path("/proc")) -> int | None:
    """Physical memory, capped by the memory limit of this process's cgroup (v2 ``memory.max``,
    v1 ``memory.limit_in_bytes``); None when unknown."""
    try:
        total: int | None = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = None
    for folder, limit_file, _ in _own_memory_cgroups(proc, cgroup_root):
        limit = _limit(folder, limit_file)
        if limit is not None:
            total = limit if total is None else min(total, limit)
    return total


def memory_available(proc: Path = Path("/proc"), cgroup_root: Path = _CGROUP_ROOT) -> int | None:
    """Bytes this process can still fill without evicting its own page cache: the kernel's
    ``MemAvailable``, capped by what its own memory cgroup (v2 ``memory.max`` - ``memory.current``,
    v1 ``limit_in_bytes`` - ``usage_in_bytes``, plus its inactive page cache) leaves; None when neither is known."""
    found: list[int] = []
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for folder, limit_file, usage_file in _own_memory_cgroups(proc, cgroup_root):
        limit = _limit(folder, limit_file)
        try:
            usage = int((folder / usage_file).read_text().strip())
            stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
        except (OSError, ValueError):
            continue
        if limit is not None:
            # inactive page cache is reclaimed before anything is evicted that is in use
            idle = int(stat.get("total_inactive_file", stat.get("inactive_file", 0)))
            found.append(max(0, limit - usage + idle))
    return min(found) if found else None


# --------------------------------------------------------------------------- the page cache
#
# Which pages of a file are in the page cache: ``cachestat(2)`` (Linux 6.5+) per page asked,
# else ``mincore(2)`` over a read-only shared mapping (3x the cost for a few pages: it maps the file).
#
# Both only look: they start no read. (A one-byte ``preadv(RWF_NOWAIT)`` looks too, but
# on a miss it starts the read of that page, and on a fast disk the read is done before the call
# checks the page, so it reports a hit: one probe in five on this VM's disk, more on a faster
# one, which made a cold batch look cached and left it unadvised.)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    libc.syscall.restype = ctypes.c_long
    return libc


_CACHESTAT = 451   # the same number in every architecture's table (the generic one)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


HAS_CACHESTAT = hasattr(os, "uname") and os.uname().sysname == "Linux"   # until a call says ENOSYS


def _cachestat(fd: int, offsets: list[int]) -> np.ndarray | None:
    """Per offset, whether its page is cached (past the end: no); None where this kernel has no
    cachestat."""
    libc, span, stat = _libc(), _Range(0, mmap.PAGESIZE), _Stat()
    out = np.zeros(len(offsets), dtype=bool)
    for k, offset in enumerate(offsets):
        if offset >= 0:
            span.off = offset - offset % mmap.PAGESIZE
            if libc.syscall(_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
                if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):   # (EPERM: a seccomp filter)
                    global HAS_CACHESTAT
                    HAS_CACHESTAT = False
                    return None
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            out[k] = stat.cache > 0
    return out


def resident(fd: int, offsets: np.ndarray | None = None, *, name: object = None) -> np.ndarray:
    """For each byte offset in ``offsets``, whether its page is cached; without offsets, one bool per
    page of the file. Raises ``SystemProbeError`` (naming ``name``, else the fd) where the file
    cannot be mapped; an offset past the end reads as not cached."""
    if offsets is not None and HAS_CACHESTAT:
        out = _cachestat(fd, np.asarray(offsets, dtype=np.int64).tolist())
        if out is not None:
            return out
    size = os.fstat(fd).st_size
    pages = -(-size // mmap.PAGESIZE)
    if pages == 0:
        return np.zeros(0 if offsets is None else len(offsets), dtype=bool)
    libc, label = _libc(), name or f"fd {fd}"
    # libc's mmap, not Python's: a read-only mmap.mmap cannot give ctypes an address.
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise SystemProbeError(err, f"mmap of {label} for mincore failed: {os.strerror(err)}")
    try:
        if offsets is None:
            vec = (ctypes.c_ubyte * pages)()
            _mincore(libc, addr, 0, pages, vec, label)
            return (np.frombuffer(vec, dtype=np.uint8) & 1).astype(bool)
        # one page a call: probes spread over a large file would otherwise walk all of it
        page = np.asarray(offsets, dtype=np.int64) // mmap.PAGESIZE
        out = np.zeros(len(page), dtype=bool)
        vec = (ctypes.c_ubyte * 1)()
        for k, p in enumerate(page.tolist()):
            if 0 <= p < pages:
                _mincore(libc, addr, p, 1, vec, label)
                out[k] = vec[0] & 1
        return out
    finally:
        libc.munmap(addr, size)


def _mincore(libc: ctypes.CDLL, addr: int, first: int, count: int, vec: ctypes.Array, name: object) -> None:
    if libc.mincore(addr + first * mmap.PAGESIZE, count * mmap.PAGESIZE, vec) != 0:
        err = ctypes.get_errno()
        raise SystemProbeError(err, f"mincore on {name} failed: {os.strerror(err)}")
