"""What ``dlstore bench`` and the benchmarks measure of a machine: its hardware and library
versions, mounts and block devices, page-cache residency and eviction, raw disk bandwidth.
Knows nothing about stores or transforms; what the library itself needs (usable CPUs,
cgroup quotas, memory) is in ``dlstore._system``."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..._system import cpu_info, resident
from ...errors import StoreNotFoundError, SystemProbeError

DEFAULT_DISK_TEST_BYTES = 256 << 20
# A run counts as cold when at most this fraction of the store's pages was resident at its start.
COLD_RESIDENT_MAX = 0.02
IO_BLOCK = 8 << 20  # bytes per read/write call of the raw disk test


# --------------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    """CPU model, cores, RAM and library versions, recorded with every result."""
    import h5py
    import lmdb
    import PIL
    import torchvision


    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = None
    cpus = cpu_info()
    try:
        from importlib.metadata import version

        dlstore_version = version("dlstore")
    except Exception:  # noqa: BLE001 - metadata missing in a source checkout: not worth failing for
        dlstore_version = None
    return {
        "cpu": cpu, "logical_cpus": os.cpu_count(), "physical_cores": cpus.physical,
        "usable_cpus": cpus.usable, "cgroup_cpu_quota": cpus.cgroup_quota, "ram_bytes": mem,
        "python": platform.python_version(), "platform": platform.platform(),
        "dlstore": dlstore_version, "torch": torch.__version__, "torchvision": torchvision.__version__,
        "numpy": np.__version__, "pillow": PIL.__version__, "lmdb": lmdb.__version__,
        "h5py": h5py.__version__, "cuda": torch.cuda.is_available(),
    }


def _unescape_mount(text: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as octal escapes (\040 ...)
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 3 < len(text) and text[i + 1:i + 4].isdigit():
            out.append(chr(int(text[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _block_device_facts(device: str) -> dict[str, Any]:
    """Rotational flag and model of the block device behind ``/dev/NAME`` (None when unknown)."""
    facts: dict[str, Any] = {"rotational": None, "model": None}
    if not device.startswith("/dev/"):
        return facts
    name = Path(os.path.realpath(device)).name
    sys_block = Path("/sys/class/block") / name
    if not sys_block.exists():
        return facts
    disk = Path(os.path.realpath(sys_block))
    if (disk / "partition").exists():  # a partition: the queue belongs to the whole disk
        disk = disk.parent
    try:
        facts["rotational"] = (disk / "queue" / "rotational").read_text().strip() == "1"
    except OSError:
        pass
    try:
        facts["model"] = (disk / "device" / "model").read_text().strip() or None
    except OSError:
        pass
    return facts


def disk_info(path: str | os.PathLike, *, mounts: str | os.PathLike = "/proc/mounts") -> dict[str, Any]:
    """Mount point, device, filesystem, mount options and capacity of the disk holding ``path``.

    Args:
        path: an existing file or folder on the disk.
        mounts: a file in ``/proc/mounts`` format (tests pass a fixture).
    """
    real = os.path.realpath(path)
    best: tuple[str, str, str, str] | None = None
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        device, mount_point, fstype, options = (_unescape_mount(f) for f in fields[:4])
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        # the longest mount point wins; among equals the last line (the mount on top)
        if inside and (best is None or len(mount_point) >= len(best[1])):
            best = (device, mount_point, fstype, options)
    info: dict[str, Any] = {"path": real, "mount_point": None, "device": None, "fstype": None,
                            "options": None, "total_bytes": None, "free_bytes": None}
    if best is not None:
        info.update(device=best[0], mount_point=best[1], fstype=best[2], options=best[3])
        info.update(_block_device_facts(best[0]))
    try:
        st = os.statvfs(real)
        info["total_bytes"] = st.f_blocks * st.f_frsize
        info["free_bytes"] = st.f_bavail * st.f_frsize
    except OSError:
        pass
    return info


def load_average() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


# --------------------------------------------------------------------------- page cache


def _resident_pages(path: Path) -> tuple[int, int]:
    """(resident pages, pages) of one file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        cached = resident(fd, name=path)
    finally:
        os.close(fd)
    return int(np.count_nonzero(cached)), len(cached)


def store_files(path: str | os.PathLike) -> list[Path]:
    """The regular files of a store or an image folder (a file: itself), sorted."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise StoreNotFoundError(f"{path}: no such file or folder")
    return sorted(f for f in p.rglob("*") if f.is_file())


def resident_fraction(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> float:
    """Fraction of the pages of the given files (or of every file under a folder) in the page cache.

    Measured with ``mincore(2)`` over a fresh mapping of each file, weighted by
    size. 1.0: everything cached (a read will not touch the disk); 0.0: nothing.
    Empty files count for nothing; no pages at all gives 0.0.
    """
    files = _expand(paths)
    cached = total = 0
    for f in files:
        r, n = _resident_pages(f)
        cached += r
        total += n
    return cached / total if total else 0.0


def _expand(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        return store_files(paths)
    files: list[Path] = []
    for p in paths:
        files.extend(store_files(p))
    return files


def can_drop_caches() -> bool:
    """True when this process may write ``/proc/sys/vm/drop_caches`` (root, writable procfs)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def evict(paths: str | os.PathLike | Iterable[str | os.PathLike], *, drop_caches: bool = False) -> float:
    """Drop files from the page cache; return the resident fraction measured afterwards.

    Each file is fsynced (dirty pages cannot be dropped) and then
    ``posix_fadvise(POSIX_FADV_DONTNEED)``-ed, which needs no privileges. With
    ``drop_caches`` (root only) ``/proc/sys/vm/drop_caches`` is written as well,
    which also drops the filesystem's metadata caches (dentries, inodes).
    Pages that a live process has mapped stay: close readers first.

    Raises:
        PermissionError: ``drop_caches`` without the right to write /proc/sys/vm/drop_caches.
    """
    files = _expand(paths)
    if not hasattr(os, "posix_fadvise"):
        raise SystemProbeError("evicting files from the page cache needs posix_fadvise (Linux); measure a warm "
                      "cache only (--cache warm) on this system")
    if drop_caches and not can_drop_caches():
        raise PermissionError("/proc/sys/vm/drop_caches is writable by root only; run as root, or leave "
                              "drop_caches off (posix_fadvise eviction needs no privileges)")
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if drop_caches:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    return resident_fraction(files)


# --------------------------------------------------------------------------- statistics


def run_stats(values: Sequence[float]) -> dict[str, Any]:
    """median, min, max, relative spread ((max - min) / median) and every run."""
    median = statistics.median(values)
    return {"median": median, "min": min(values), "max": max(values),
            "spread": (max(values) - min(values)) / median if median else 0.0, "runs": list(values)}


# --------------------------------------------------------------------------- raw disk bandwidth


def disk_bandwidth(folder: str | os.PathLike, *, size: int = DEFAULT_DISK_TEST_BYTES, repeats: int = 3,
                   drop_caches: bool = False) -> dict[str, Any]:
    """Raw sequential bandwidth of the disk holding ``folder``: the physical limit a store can reach.

    Writes ``size`` bytes of random data in 8 MiB calls and fsyncs them (write
    MB/s includes the fsync), evicts the file from the page cache, checks with
    ``mincore`` that it left, and reads it back with 8 MiB reads, ``repeats``
    times. The file is removed afterwards. MB is 10^6 bytes.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".dlstore-disk-test-{os.getpid()}.bin"
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, size=IO_BLOCK, dtype=np.uint8)
    stamps = block.view(np.uint64)[::512]  # the first 8 bytes of every 4 KiB page
    reads: list[float] = []
    resident: list[float] = []
    try:
        start = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            left = size
            while left > 0:
                # random bytes, and no two pages alike: compression and deduplication cannot help
                stamps[:] = np.arange(len(stamps), dtype=np.uint64) + np.uint64(left)
                left -= f.write(memoryview(block)[:min(left, len(block))])
            os.fsync(f.fileno())
        write_s = time.perf_counter() - start
        buf = bytearray(len(block))
        for _ in range(repeats):
            resident.append(evict(path, drop_caches=drop_caches))
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                start = time.perf_counter()
                got = 0
                with open(fd, "rb", buffering=0, closefd=False) as f:
                    while n := f.readinto(buf):
                        got += n
                reads.append(got / (time.perf_counter() - start) / 1e6)
            finally:
                os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return {"file_bytes": size, "block_bytes": IO_BLOCK, "write_mb_s": size / write_s / 1e6,
            "read_mb_s": run_stats(reads), "resident_after_eviction": resident,
            "cold_verified": max(resident) <= COLD_RESIDENT_MAX}



