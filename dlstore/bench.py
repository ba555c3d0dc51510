"""Storage formats benchmarked on a given disk: ``dlstore bench``.

One run answers "which format should I use on *this* machine and *this*
disk?". In a work folder on the disk under test it writes an image folder (the
built-in demo, or a subset copied from the user's folder), converts it to each
format, measures the disk's raw sequential read bandwidth, then reads every
store (and the image folder through torchvision ``ImageFolder`` with the same
static transforms, decoded per sample: the baseline) in random and sequential
order, for each ``num_workers`` value, with a cold and a warm page cache.

Cold cache without root: before each cold run the store's files are fsynced
and dropped from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``
(``/proc/sys/vm/drop_caches`` as well when running as root and asked to), and
the eviction is verified: ``mincore`` over a fresh ``mmap`` of every file gives
the fraction of its pages still resident, which the report records for every
run. Pages mapped by a live process cannot be dropped, so each run opens its
store after the eviction, and the DataLoader's workers map the files themselves.

Timing: every run builds a fresh DataLoader. Its workers start, then wait at a
gate until all of them are up; the clock starts when the gate opens, so worker
start-up (reported separately) is not counted as reading. Runs are interleaved
in rounds (every cell once per round), so a noisy neighbour slows all formats
alike; the spread over rounds is reported.

Library code returns a :class:`BenchReport`; the CLI prints it and writes
``report.json``, ``report.md`` and, with matplotlib installed, ``report.png``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import importlib.util
import inspect
import json
import math
import mmap
import multiprocessing
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

REPORT_VERSION = 1
FORMAT_NAMES = ("imagefolder", "shards", "lmdb", "hdf5")
ENCODINGS = ("raw", "jpeg", "png")
CACHE_STATES = ("cold", "warm")
ORDERS = ("random", "sequential")
DEFAULT_STATIC = "resize=256,center_crop=224"
DEFAULT_SAMPLES = 256
DEFAULT_DISK_TEST_BYTES = 256 << 20
# A run counts as cold when at most this fraction of the store's pages was resident at its start.
COLD_RESIDENT_MAX = 0.02
# ... and as warm when at least this fraction was.
WARM_RESIDENT_MIN = 0.98
_SUFFIX = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}
_IO_BLOCK = 8 << 20  # bytes per read/write call of the raw disk test
_GATE_TIMEOUT = 120.0
# steady-state rates need this many batches per worker beyond each worker's first
STEADY_MIN_BATCHES = 8


# --------------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    """CPU model, cores, RAM and library versions, recorded with every result."""
    import h5py
    import lmdb
    import PIL
    import torch
    import torchvision

    from .tuning import cpu_info

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


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


# --------------------------------------------------------------------------- page cache


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def _resident_pages(libc: ctypes.CDLL, path: Path) -> tuple[int, int]:
    """(resident pages, pages) of one file, by ``mincore`` over a fresh read-only shared mapping."""
    size = path.stat().st_size
    if size == 0:
        return 0, 0
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        # libc's mmap, not Python's: a read-only mmap.mmap cannot give ctypes an address.
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {path} for mincore failed: {os.strerror(err)}")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore on {path} failed: {os.strerror(err)}")
            resident = int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1))
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return resident, pages


def store_files(path: str | os.PathLike) -> list[Path]:
    """The regular files of a store or an image folder (a file: itself), sorted."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"{path}: no such file or folder")
    return sorted(f for f in p.rglob("*") if f.is_file())


def resident_fraction(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> float:
    """Fraction of the pages of the given files (or of every file under a folder) in the page cache.

    Measured with ``mincore(2)`` over a fresh mapping of each file, weighted by
    size. 1.0: everything cached (a read will not touch the disk); 0.0: nothing.
    Empty files count for nothing; no pages at all gives 0.0.
    """
    files = _expand(paths)
    libc = _libc()
    resident = total = 0
    for f in files:
        r, n = _resident_pages(libc, f)
        resident += r
        total += n
    return resident / total if total else 0.0


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
        raise OSError("evicting files from the page cache needs posix_fadvise (Linux); measure a warm "
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


def _stats(values: Sequence[float]) -> dict[str, Any]:
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
    block = rng.integers(0, 256, size=_IO_BLOCK, dtype=np.uint8)
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
    return {"file_bytes": size, "block_bytes": _IO_BLOCK, "write_mb_s": size / write_s / 1e6,
            "read_mb_s": _stats(reads), "resident_after_eviction": resident,
            "cold_verified": max(resident) <= COLD_RESIDENT_MAX}


# --------------------------------------------------------------------------- what is measured


@dataclass(frozen=True)
class Variant:
    """One thing to read: ``imagefolder``, or a store format with a sample encoding."""

    format: str
    encoding: str = "raw"

    @property
    def name(self) -> str:
        return self.format if self.encoding == "raw" else f"{self.format}+{self.encoding}"

    @property
    def is_store(self) -> bool:
        return self.format != "imagefolder"


def convert_supports_encoding() -> bool:
    """Whether ``dlstore.convert`` takes ``encoding=`` (encoded-sample stores)."""
    from .convert import convert

    return "encoding" in inspect.signature(convert).parameters


def default_formats() -> list[str]:
    """``imagefolder, shards, lmdb, hdf5``, plus ``shards+jpeg`` when encoded stores exist."""
    names = list(FORMAT_NAMES)
    if convert_supports_encoding():
        names.append("shards+jpeg")
    return names


def parse_variants(names: str | Iterable[str]) -> list[Variant]:
    """``"imagefolder,shards,lmdb+jpeg"`` (or a list of such names) -> variants, in order, unique.

    Raises:
        ValueError: an unknown format or encoding, naming the valid ones.
    """
    items = names.split(",") if isinstance(names, str) else list(names)
    out: list[Variant] = []
    for item in (i.strip().lower() for i in items):
        if not item:
            continue
        fmt, _, encoding = item.partition("+")
        encoding = encoding or "raw"
        if fmt not in FORMAT_NAMES:
            raise ValueError(f"unknown format {fmt!r} in {item!r}; valid: {', '.join(FORMAT_NAMES)} "
                             f"(a store format may take +ENCODING, e.g. shards+jpeg)")
        if encoding not in ENCODINGS:
            raise ValueError(f"unknown encoding {encoding!r} in {item!r}; valid: {', '.join(ENCODINGS)}")
        if fmt == "imagefolder" and encoding != "raw":
            raise ValueError(f"{item!r}: imagefolder reads the source files as they are; drop +{encoding}")
        if encoding != "raw" and not convert_supports_encoding():
            raise ValueError(f"{item!r}: this dlstore's convert cannot store encoded samples yet; "
                             f"use {fmt} (raw)")
        variant = Variant(fmt, encoding)
        if variant not in out:
            out.append(variant)
    if not out:
        raise ValueError(f"no format to benchmark; give some of {', '.join(FORMAT_NAMES)}")
    return out


def _parse_choices(values: str | Iterable[str], valid: Sequence[str], what: str) -> list[str]:
    items = values.split(",") if isinstance(values, str) else list(values)
    out = []
    for item in (str(i).strip().lower() for i in items):
        if not item:
            continue
        if item not in valid:
            raise ValueError(f"unknown {what} {item!r}; valid: {', '.join(valid)}")
        if item not in out:
            out.append(item)
    if not out:
        raise ValueError(f"no {what} given; valid: {', '.join(valid)}")
    return out


def _parse_workers(values: str | int | Iterable[int]) -> list[int]:
    if isinstance(values, int):
        values = [values]
    items = values.split(",") if isinstance(values, str) else list(values)
    out: list[int] = []
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"workers: {text!r} is not an integer (example: 0,2)") from None
        if n < 0:
            raise ValueError(f"workers: {n} is negative; num_workers is 0 (read in the main process) or more")
        if n not in out:
            out.append(n)
    if not out:
        raise ValueError("workers: give at least one num_workers value, e.g. 0,2")
    return out


# --------------------------------------------------------------------------- the report


@dataclass
class BenchReport:
    """Everything one ``run_bench`` measured; ``to_json()`` is what ``report.json`` holds.

    Attributes:
        machine: ``machine_info()`` plus ``disk``: ``disk_info()`` of the work folder.
        settings: what was asked for (formats, workers, cache states, ...).
        data: the image folder read (samples, classes, bytes, where it came from).
        disk: ``disk_bandwidth()`` of the work folder.
        stores: per variant name: size on disk, bytes/sample, conversion time and rate.
        reads: one dict per (variant, order, workers, cache) cell with every run.
        recommendation: the fastest format on this disk and its ratio to ImageFolder.
        notes: caveats found while running (unverified cold runs, no plot, ...).
    """

    machine: dict[str, Any]
    settings: dict[str, Any]
    data: dict[str, Any]
    disk: dict[str, Any]
    stores: dict[str, dict[str, Any]]
    reads: list[dict[str, Any]]
    recommendation: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    created: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"report_version": REPORT_VERSION, "created": self.created, "machine": self.machine,
                "settings": self.settings, "data": self.data, "disk": self.disk, "stores": self.stores,
                "reads": self.reads, "recommendation": self.recommendation, "notes": self.notes}

    def cell(self, variant: str, order: str, workers: int, cache: str) -> dict[str, Any] | None:
        for row in self.reads:
            if (row["format"], row["order"], row["workers"], row["cache"]) == (variant, order, workers, cache):
                return row
        return None

    # ---- text forms

    def _header(self) -> list[tuple[str, str]]:
        m, d, s = self.machine, self.machine.get("disk", {}), self.settings
        ram = f"{m['ram_bytes'] / 2**30:.1f} GiB RAM" if m.get("ram_bytes") else "RAM unknown"
        rot = {True: ", kernel reports rotational", False: ", non-rotational", None: ""}[d.get("rotational")]
        model = f" ({d['model']})" if d.get("model") else ""
        free = f", {d['free_bytes'] / 2**30:.0f} GiB free" if d.get("free_bytes") is not None else ""
        disk = self.disk
        verified = "" if disk["cold_verified"] else " (NOT verified cold: see notes)"
        return [
            ("machine", f"{m['cpu'] or 'unknown CPU'}, {m['usable_cpus']} usable CPU(s) of {m['logical_cpus']}, {ram}"),
            ("disk", f"{d.get('path')}: {d.get('fstype')} on {d.get('device')}{model}{rot}{free}"),
            ("raw disk", f"{disk['read_mb_s']['median']:,.0f} MB/s sequential read, cold (median of "
             f"{len(disk['read_mb_s']['runs'])}, {disk['read_mb_s']['min']:,.0f}-{disk['read_mb_s']['max']:,.0f})"
             f"{verified}; write+fsync {disk['write_mb_s']:,.0f} MB/s; {disk['file_bytes'] / 2**20:,.0f} MiB file"),
            ("data", f"{self.data['samples']} images in {self.data['classes']} classes from {self.data['source']}"),
            ("settings", f"static {s['static']}, batch {s['batch_size']}, {s['repeats']} round(s), "
             f"eviction {s['eviction']}, torch threads {s['torch_threads']}"),
            ("versions", f"dlstore {m.get('dlstore')}, torch {m['torch']}, torchvision {m['torchvision']}, "
             f"python {m['python']}"),
        ]

    def _store_rows(self) -> list[list[str]]:
        rows = []
        for name, st in self.stores.items():
            conv = st.get("convert")
            rows.append([name, st["encoding"], f"{st['bytes'] / 2**20:,.1f}", f"{st['bytes_per_sample']:,.0f}",
                         f"{st['size_vs_source']:.2f}x",
                         "-" if conv is None else f"{conv['seconds']:.2f}",
                         "-" if conv is None else f"{conv['images_per_s']:,.0f}"])
        return rows

    _STORE_HEAD = ["format", "encoding", "size MiB", "B/sample", "vs source", "convert s", "images/s"]
    _READ_HEAD = ["format", "order", "workers", "cache", "samples/s", "spread", "steady/s", "MB/s", "p50 ms", "p95 ms",
                  "resident", "% disk", "vs ImageFolder"]

    def _read_rows(self) -> list[list[str]]:
        rows = []
        for r in self.reads:
            sps = r["samples_per_s"]
            rows.append([
                r["format"], r["order"], str(r["workers"]), r["cache"] + ("" if r["verified"] else "?"),
                f"{sps['median']:,.0f}", f"{sps['spread'] * 100:.0f}%",
                "-" if r["steady_samples_per_s"] is None or r["cache"] == "cold"
                else f"{r['steady_samples_per_s']['median']:,.0f}",
                f"{r['mb_per_s']['median']:,.1f}",
                f"{r['batch_latency_ms']['p50']:.1f}", f"{r['batch_latency_ms']['p95']:.1f}",
                f"{max(r['resident_at_start']):.2f}" if r["cache"] == "cold" else f"{min(r['resident_at_start']):.2f}",
                "-" if r.get("disk_fraction") is None else f"{r['disk_fraction'] * 100:.0f}%",
                "-" if r.get("vs_imagefolder") is None else f"{r['vs_imagefolder']:,.1f}x",
            ])
        return rows

    def table(self) -> str:
        """The plain-text report the CLI prints."""
        lines = [f"{k:9s} {v}" for k, v in self._header()] + [""]
        lines += _text_table(self._STORE_HEAD, self._store_rows()) + [""]
        lines += _text_table(self._READ_HEAD, self._read_rows())
        lines += ["", _LEGEND]
        lines += ["", self.recommendation["text"]]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def markdown(self) -> str:
        """``report.md``: the same content as Markdown tables."""
        lines = ["# dlstore bench", ""]
        lines += [f"- {k}: {v}" for k, v in self._header()]
        lines += ["", f"**{self.recommendation['text']}**", "", "## Stores", ""]
        lines += _md_table(self._STORE_HEAD, self._store_rows())
        lines += ["", "## Reads", "",
                  _LEGEND, ""]
        lines += _md_table(self._READ_HEAD, self._read_rows())
        if self.notes:
            lines += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def write(self, out: str | os.PathLike) -> dict[str, Path]:
        """Write ``report.json``, ``report.md`` and (matplotlib installed) ``report.png`` into ``out``.

        Returns:
            kind (``json``, ``md``, ``png``) -> path written.
        """
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        written = {}
        if importlib.util.find_spec("matplotlib") is not None:
            written["png"] = _plot(self, out / "report.png")
        else:
            note = "matplotlib is not installed: report.png skipped (pip install 'dlstore[plot]')"
            if note not in self.notes:
                self.notes.append(note)
        written["json"] = out / "report.json"
        written["json"].write_text(json.dumps(self.to_json(), indent=1) + "\n")
        written["md"] = out / "report.md"
        written["md"].write_text(self.markdown())
        return written


_LEGEND = ("samples/s: one pass over the data, median over rounds; spread: (max-min)/median; steady/s: "
           "after each worker's first batch (which pays per-epoch set-up), warm runs with 8+ further batches per "
           "worker only (cold, readahead during the first batches fetches much of a small store); MB/s: samples/s x the store's "
           "bytes/sample on disk; p50/p95: per-batch latency; resident: fraction of the store's pages in the "
           "page cache when the run started (cold: max over rounds, warm: min); % disk: cold MB/s over the raw "
           "sequential read bandwidth; vs ImageFolder: same order, workers and cache; '?' after cache: not verified")


def _text_table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 or not _numeric(c) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def _numeric(text: str) -> bool:
    return bool(text) and (text[0].isdigit() or text == "-")


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    right = [bool(rows) and _numeric(rows[0][i]) for i in range(len(head))]
    return (["| " + " | ".join(head) + " |", "|" + "|".join("---:" if r else "---" for r in right) + "|"]
            + ["| " + " | ".join(r) + " |" for r in rows])


def _plot(report: BenchReport, path: Path) -> Path:
    """Bar chart: samples/s per format, cold vs warm (random order when measured, best workers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = "random" if "random" in report.settings["orders"] else report.settings["orders"][0]
    names = list(report.stores)
    caches = report.settings["cache"]
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(names), 4))
    width = 0.8 / len(caches)
    for k, cache in enumerate(caches):
        values = [_best(report.reads, name, order, cache)[0] for name in names]
        ax.bar([i + (k - (len(caches) - 1) / 2) * width for i in range(len(names))], values, width, label=cache)
    ax.set_xticks(range(len(names)), names)
    ax.set_yscale("log")
    ax.set_ylabel("samples/s (best num_workers)")
    ax.set_title(f"dlstore bench: {order} order, batch {report.settings['batch_size']}, "
                 f"{report.machine.get('disk', {}).get('fstype')} at {report.machine.get('disk', {}).get('path')}",
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _best(reads: list[dict[str, Any]], name: str, order: str, cache: str) -> tuple[float, int | None]:
    """(median samples/s, workers) of the best workers value of a format in one (order, cache)."""
    best: tuple[float, int | None] = (0.0, None)
    for r in reads:
        if (r["format"], r["order"], r["cache"]) == (name, order, cache):
            if r["samples_per_s"]["median"] > best[0]:
                best = (r["samples_per_s"]["median"], r["workers"])
    return best


def _overlap(reads: list[dict[str, Any]], a: tuple, b: tuple) -> bool:
    """Whether two cells' samples/s ranges (min..max over rounds) overlap."""
    rows = {(r["format"], r["order"], r["workers"], r["cache"]): r["samples_per_s"] for r in reads}
    ra, rb = rows[a], rows[b]
    return ra["min"] <= rb["max"] and rb["min"] <= ra["max"]


def _recommend(reads: list[dict[str, Any]], names: list[str], orders: list[str], caches: list[str],
               disk: dict[str, Any]) -> dict[str, Any]:
    cache = "cold" if "cold" in caches else caches[0]
    order = "random" if "random" in orders else orders[0]
    stores = [n for n in names if n != "imagefolder"]
    where = f"{disk.get('fstype')} at {disk.get('path')}"
    setting = f"{cache} cache, {order} order, best num_workers"
    if not stores:
        rate, workers = _best(reads, "imagefolder", order, cache)
        return {"format": None, "cache": cache, "order": order, "workers": workers, "samples_per_s": rate,
                "vs_imagefolder": None,
                "text": f"Recommendation: none (only imagefolder measured: {rate:,.0f} samples/s, {setting})"}
    ranked = sorted(((_best(reads, n, order, cache), n) for n in stores), key=lambda t: -t[0][0])
    (rate, workers), name = ranked[0]
    result: dict[str, Any] = {"format": name, "cache": cache, "order": order, "workers": workers,
                              "samples_per_s": rate, "vs_imagefolder": None}
    text = (f"Recommendation: {name} is the fastest format on this disk ({where}): {rate:,.0f} samples/s "
            f"({setting}: {workers})")
    if "imagefolder" in names:
        base, base_workers = _best(reads, "imagefolder", order, cache)
        if base > 0:
            result["vs_imagefolder"] = rate / base
            text += f", {rate / base:,.1f}x ImageFolder ({base:,.0f} samples/s with num_workers={base_workers})"
    if len(ranked) > 1:
        (second_rate, second_workers), second = ranked[1]
        if second_rate > 0:
            tie = _overlap(reads, (name, order, workers, cache), (second, order, second_workers, cache))
            result["tied_with"] = second if tie else None
            text += f"; next: {second} ({rate / second_rate:.2f}x slower" + (
                "; their ranges over rounds overlap: a tie in this run)" if tie else ")")
    if cache == "cold" and "warm" in caches:  # the answer when the data fits in the page cache
        (w_rate, w_workers), w_name = max(((_best(reads, n, order, "warm"), n) for n in stores),
                                          key=lambda t: t[0][0])
        result["warm"] = {"format": w_name, "workers": w_workers, "samples_per_s": w_rate, "vs_imagefolder": None}
        text += f". With a warm cache (data fits in RAM): {w_name}, {w_rate:,.0f} samples/s"
        w_base, _ = _best(reads, "imagefolder", order, "warm") if "imagefolder" in names else (0.0, None)
        if w_base > 0:
            result["warm"]["vs_imagefolder"] = w_rate / w_base
            text += f", {w_rate / w_base:,.1f}x ImageFolder"
    result["text"] = text
    return result


# --------------------------------------------------------------------------- reading


class _Gate:
    """Holds DataLoader workers after start-up until the clock starts (``worker_init_fn``)."""

    def __init__(self, ctx: Any):
        self.ready = ctx.Semaphore(0)
        self.go = ctx.Event()

    def __call__(self, worker_id: int) -> None:  # noqa: ARG002 - DataLoader's signature
        self.ready.release()
        if not self.go.wait(_GATE_TIMEOUT):
            raise RuntimeError(f"dlstore bench: the timing gate did not open within {_GATE_TIMEOUT:.0f} s")

    def wait_ready(self, workers: int) -> None:
        deadline = time.monotonic() + _GATE_TIMEOUT
        for i in range(workers):
            if not self.ready.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"dlstore bench: only {i} of {workers} DataLoader workers started within "
                                   f"{_GATE_TIMEOUT:.0f} s (machine overloaded, or workers dying at start-up)")


def _imagefolder(folder: Path, spec: list[dict[str, Any]]) -> Any:
    from torchvision import datasets
    from torchvision.transforms import v2

    from .transforms import to_torchvision

    return datasets.ImageFolder(str(folder), transform=v2.Compose(list(to_torchvision(spec)) + [v2.PILToTensor()]))


def _make_loader(dataset: Any, *, store: bool, shuffle: bool, workers: int, batch_size: int, seed: int,
                 gate: _Gate | None) -> Any:
    import torch
    from torch.utils.data import DataLoader

    from .dataset import loader

    generator = torch.Generator().manual_seed(seed)
    if store:
        return loader(dataset, batch_size, shuffle=shuffle, num_workers=workers, generator=generator,
                      worker_init_fn=gate)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=workers, generator=generator,
                      worker_init_fn=gate)


def _read_once(opener: Callable[[], Any], files: list[Path], *, store: bool, cache: str, order: str,
               workers: int, batch_size: int, seed: int, drop_caches: bool) -> dict[str, Any]:
    """One timed pass over a dataset; evicts its files first when ``cache == "cold"``."""
    dataset = opener()  # before the eviction: reads the manifest/labels, maps no data
    if cache == "cold":
        resident = evict(files, drop_caches=drop_caches)
    else:
        resident = resident_fraction(files)
    gate = _Gate(multiprocessing.get_context()) if workers > 0 else None
    loader = _make_loader(dataset, store=store, shuffle=order == "random", workers=workers,
                          batch_size=batch_size, seed=seed, gate=gate)
    start = time.perf_counter()
    it = iter(loader)
    gaps: list[float] = []
    sizes: list[int] = []
    try:
        if gate is not None:
            try:
                gate.wait_ready(workers)
            finally:
                t0 = time.perf_counter()
                gate.go.set()  # also on failure: no worker stays parked at the gate
        else:
            t0 = time.perf_counter()
        last = t0
        for batch in it:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            sizes.append(len(batch[1]))
    finally:
        del it, loader, dataset  # shut the workers down and unmap the store before the next eviction
        gc.collect()
    return {"samples": sum(sizes), "seconds": last - t0, "startup_s": t0 - start, "batch_s": gaps,
            "batch_sizes": sizes, "workers": workers, "resident": resident}


def _read_files(files: list[Path]) -> None:
    """Read files whole (into the page cache)."""
    buf = bytearray(_IO_BLOCK)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


# --------------------------------------------------------------------------- the run


def _prepare_images(src: str | os.PathLike | None, folder: Path, samples: int,
                    log: Callable[[str], None]) -> dict[str, Any]:
    """Write the image folder read by the bench (on the disk under test); describe it."""
    from .demo import make_image_folder
    from .source import scan

    if src is None:
        classes = min(8, samples)
        per_class = -(-samples // classes)
        make_image_folder(folder, classes=classes, per_class=per_class)
        # exactly `samples` images: drop the last image of as many classes as there are too many
        for c in range(classes * per_class - samples):
            (folder / f"class_{c:02d}" / f"img_{per_class - 1:04d}.jpg").unlink()
        described = {"source": "built-in demo (synthetic 500x375 JPEGs, quality 90)"}
    else:
        source = scan(src)
        chosen = source.samples
        if samples and samples < len(chosen):
            # spread evenly over the folder so every class keeps its share
            picks = np.unique(np.linspace(0, len(chosen) - 1, samples).round().astype(np.int64))
            chosen = [chosen[int(i)] for i in picks]
        root = Path(source.root)
        for path, _ in chosen:
            rel = Path(path).relative_to(root)
            if not source.labelled:  # ImageFolder needs class folders: one for all
                rel = Path("unlabelled") / rel
            target = folder / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        if len(chosen) < len(source):
            log(f"using {len(chosen)} of the {len(source)} images of {src} (--samples), copied to {folder}")
        described = {"source": str(Path(src).resolve())}
    files = store_files(folder)
    scanned = scan(folder)
    described.update(samples=len(scanned), classes=len(scanned.classes), files=len(files),
                     bytes=sum(f.stat().st_size for f in files), folder=str(folder))
    return described


def _convert_all(variants: list[Variant], images: Path, work: Path, data: dict[str, Any], *,
                 spec: list[dict[str, Any]], quality: int, workers: int | None, bar: Any,
                 log: Callable[[str], None]) -> tuple[dict[str, dict[str, Any]], dict[str, Path]]:
    """Convert ``images`` to every store variant; (per-name store facts, per-name path to read)."""
    from .convert import convert, decode_sample, disk_usage

    # Decode one image here first: imports and kernel set-up are then paid before the timed
    # conversions (and inherited by forked decode workers), not by whichever format goes first.
    decode_sample(str(store_files(images)[0]), spec)
    stores: dict[str, dict[str, Any]] = {}
    paths: dict[str, Path] = {}
    for v in variants:
        if not v.is_store:
            paths[v.name] = images
            stores[v.name] = {"format": "imagefolder", "encoding": "source files", "path": str(images),
                              "bytes": data["bytes"], "files": data["files"], "convert": None}
            continue
        bar.set_postfix_str(f"convert {v.name}")
        dst = work / f"bench-{v.name.replace('+', '-')}{_SUFFIX[v.format]}"
        options: dict[str, Any] = {}
        if v.encoding != "raw":
            options["encoding"] = v.encoding
            if v.encoding == "jpeg":
                options["quality"] = quality
        result = convert(images, dst, format=v.format, static=spec, workers=workers, overwrite=True,
                         progress=False, log=log, **options)
        paths[v.name] = dst
        stores[v.name] = {"format": v.format, "encoding": v.encoding, "path": str(dst), "bytes": disk_usage(dst),
                          "files": len(store_files(dst)),
                          "convert": {"seconds": result.seconds, "images_per_s": result.rate,
                                      "workers": result.workers, "runs": 1}}
        if v.encoding == "jpeg":
            stores[v.name]["quality"] = quality
        bar.update()
    for st in stores.values():
        st["bytes_per_sample"] = st["bytes"] / data["samples"]
        st["size_vs_source"] = st["bytes"] / data["bytes"]
    return stores, paths


def _measure(variants: list[Variant], cells: list[tuple], paths: dict[str, Path], images: Path, *,
             spec: list[dict[str, Any]], caches: list[str], repeats: int, batch_size: int, drop_caches: bool,
             bar: Any) -> dict[tuple, list[dict[str, Any]]]:
    """Every cell once per round, ``repeats`` rounds per cache state; cell -> its runs."""
    from .dataset import open_dataset

    files = {name: store_files(p) for name, p in paths.items()}

    def opener(v: Variant) -> Callable[[], Any]:
        if v.is_store:
            return lambda: open_dataset(paths[v.name])
        return lambda: _imagefolder(images, spec)

    # Fetch one sample of each in this process: lazily imported modules (numpy's, torchvision's)
    # are then loaded before DataLoader workers fork, so no worker's first batch pays for them.
    for v in variants:
        warm_up = opener(v)()
        if v.is_store:
            warm_up.get_batch([0])
        else:
            warm_up[0]
        del warm_up
    gc.collect()
    runs: dict[tuple, list[dict[str, Any]]] = {cell: [] for cell in cells}
    for c in caches:
        if c == "warm":
            # Cold runs cached what a read touches; read every file whole, so "warm" means all of
            # the store is cached (a reader may never touch some pages, e.g. free LMDB pages).
            bar.set_postfix_str("warm-up: reading every file")
            for v in variants:
                _read_files(files[v.name])
        for r in range(repeats):
            for cell in (x for x in cells if x[3] == c):
                v, o, w, _ = cell
                bar.set_postfix_str(f"{c} {v.name} {o} workers={w} round {r + 1}/{repeats}")
                runs[cell].append(_read_once(opener(v), files[v.name], store=v.is_store, cache=c, order=o,
                                             workers=w, batch_size=batch_size, seed=r, drop_caches=drop_caches))
                bar.update()
    return runs


def run_bench(
    src: str | os.PathLike | None = None,
    *,
    workdir: str | os.PathLike | None = None,
    formats: str | Iterable[str] | None = None,
    static: Any = DEFAULT_STATIC,
    workers: str | int | Iterable[int] = (0, 2),
    batch_size: int = 64,
    cache: str | Iterable[str] = CACHE_STATES,
    orders: str | Iterable[str] = ORDERS,
    samples: int = DEFAULT_SAMPLES,
    repeats: int = 3,
    quality: int = 90,
    convert_workers: int | None = None,
    disk_test_bytes: int = DEFAULT_DISK_TEST_BYTES,
    drop_caches: bool = False,
    keep: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> BenchReport:
    """Benchmark storage formats on the disk holding ``workdir``.

    Args:
        src: an image folder (ImageFolder layout); ``samples`` of its images, spread
            over the classes, are copied into ``workdir``. None: the built-in demo
            folder (synthetic 500x375 JPEGs) is written there.
        workdir: the folder on the disk under test; the bench writes into a new
            ``dlstore-bench-*`` folder inside it (default: the system temp folder).
        formats: names such as ``"imagefolder,shards,lmdb,hdf5,shards+jpeg"``;
            ``imagefolder`` is the baseline (torchvision ``ImageFolder``, decode and
            static transforms per sample). Default: :func:`default_formats`.
        static: static transforms (spec string, op dicts or torchvision transforms);
            must fix the sample size (end with a crop) so samples can be batched.
        workers: ``num_workers`` values to measure (``"0,2"`` or ints).
        batch_size: samples per batch.
        cache: ``"cold"`` and/or ``"warm"`` page cache.
        orders: ``"random"`` and/or ``"sequential"`` sample order.
        samples: images to use (0: all of ``src``).
        repeats: timed rounds; every cell runs once per round.
        quality: JPEG quality of ``+jpeg`` variants.
        convert_workers: decode processes of the conversions (default: usable CPUs).
        disk_test_bytes: size of the raw sequential bandwidth test file.
        drop_caches: also write ``/proc/sys/vm/drop_caches`` before cold runs (root only).
        keep: keep the images and stores (default: removed at the end).
        progress: show a tqdm progress bar.
        log: called with one-line notes while running.

    Raises:
        ValueError: an invalid setting (unknown format, spec without a fixed size, ...).
        PermissionError: ``drop_caches`` without root.
        SourceError: ``src`` is not a usable image folder.
    """
    import torch
    from tqdm.auto import tqdm

    from .transforms import describe, output_shape, parse_static
    from .tuning import usable_cpus

    log = log or (lambda message: None)
    variants = parse_variants(default_formats() if formats is None else formats)
    worker_values = _parse_workers(workers)
    caches = _parse_choices(cache, CACHE_STATES, "cache state")
    order_values = _parse_choices(orders, ORDERS, "order")
    spec = parse_static(static)
    if output_shape(spec) is None:
        raise ValueError(f"static {describe(spec)!r} leaves the sample size to the image; batching needs one size: "
                         f"end it with a crop, e.g. {DEFAULT_STATIC!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    if samples < 0 or (src is None and samples == 0):
        raise ValueError(f"samples must be positive (0 means all of SRC), got {samples}")
    if drop_caches and not can_drop_caches():
        raise PermissionError("drop_caches needs root (writing /proc/sys/vm/drop_caches); without it the "
                              "bench evicts with posix_fadvise, which needs no privileges")
    base = Path(workdir) if workdir is not None else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dlstore-bench-", dir=base))
    notes: list[str] = []
    load_start = _load_average()
    threads = torch.get_num_threads()
    # One intra-op thread, as in DataLoader workers: on a small shared machine more threads
    # spin at barriers in the batch copy and slow the main-process (num_workers=0) runs.
    torch.set_num_threads(1)
    cells = [(v, o, w, c) for c in caches for v in variants for o in order_values for w in worker_values]
    stores_total = sum(v.is_store for v in variants)
    bar = tqdm(total=2 + stores_total + len(cells) * repeats, desc="dlstore bench", unit="step",
               disable=not progress, dynamic_ncols=True, leave=False)
    try:
        bar.set_postfix_str("images")
        images = work / "images"
        data = _prepare_images(src, images, samples, log)
        bar.update()
        bar.set_postfix_str("raw disk bandwidth")
        disk = disk_bandwidth(work, size=disk_test_bytes, drop_caches=drop_caches)
        bar.update()
        if not disk["cold_verified"]:
            notes.append(f"the raw disk test file stayed {max(disk['resident_after_eviction']):.0%} resident after "
                         "eviction: its bandwidth may be the page cache's (a filesystem that ignores "
                         "posix_fadvise, e.g. tmpfs); try --drop-caches as root")

        stores, paths = _convert_all(variants, images, work, data, spec=spec, quality=quality,
                                     workers=convert_workers, bar=bar, log=log)
        runs = _measure(variants, cells, paths, images, spec=spec, caches=caches, repeats=repeats,
                        batch_size=batch_size, drop_caches=drop_caches, bar=bar)
    finally:
        bar.close()
        torch.set_num_threads(threads)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)

    reads = _summarise(runs, stores, disk, variants)
    unverified = [f"{r['format']} {r['order']} workers={r['workers']}" for r in reads if not r["verified"]]
    if unverified:
        notes.append(f"{len(unverified)} cell(s) did not start in the intended cache state (see 'resident'), "
                     f"e.g. {unverified[0]}: for warm, the data may not fit in the page cache; for cold, the "
                     "filesystem may ignore posix_fadvise (try --drop-caches as root)")
    load = {"start": load_start, "end": _load_average()}
    busiest = max((x for x in load.values() if x is not None), default=None)
    usable = usable_cpus()
    if busiest is not None and busiest > usable:
        notes.append(f"the machine was busy (1-minute load average up to {busiest:.1f} on {usable} usable CPU(s)): "
                     "other processes shared the CPUs, so rates are lower and spreads wider than on an idle machine")
    names = [v.name for v in variants]
    machine = machine_info()
    machine["disk"] = disk_info(base)
    recommendation = _recommend(reads, names, order_values, caches, machine["disk"])
    settings = {
        "formats": names, "static": describe(spec), "static_spec": spec, "workers": worker_values,
        "batch_size": batch_size, "cache": caches, "orders": order_values, "samples": samples, "repeats": repeats,
        "quality": quality, "convert_workers": convert_workers, "disk_test_bytes": disk_test_bytes,
        "drop_caches": drop_caches, "eviction": "posix_fadvise+drop_caches" if drop_caches else "posix_fadvise",
        "workdir": str(work), "kept": keep, "torch_threads": 1, "load_average_1min": load,
        "reader": {"stores": "dlstore.open_dataset + dlstore.loader (one get_batch per batch)",
                   "imagefolder": "torchvision ImageFolder + static transforms + PILToTensor, DataLoader"},
        "timing": "fresh DataLoader per run; clock starts when every worker is up (start-up in startup_s)",
    }
    return BenchReport(machine=machine, settings=settings, data=data, disk=disk, stores=stores, reads=reads,
                       recommendation=recommendation, notes=notes,
                       created=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def _steady(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """samples/s after every worker's first batch (which pays opening the store, first-touch
    page faults and shared-memory set-up once per epoch with non-persistent workers).

    None unless every run has at least ``STEADY_MIN_BATCHES`` batches per worker beyond those:
    batches prefetched while the first ones were made arrive at once and would inflate a
    rate taken over a few batches.
    """
    rates = []
    for r in runs:
        skip = max(r["workers"], 1)
        if len(r["batch_s"]) - skip < STEADY_MIN_BATCHES * skip:
            return None
        seconds = sum(r["batch_s"][skip:])
        rates.append(sum(r["batch_sizes"][skip:]) / seconds if seconds > 0 else math.inf)
    return _stats(rates)


def _summarise(runs: dict[tuple, list[dict[str, Any]]], stores: dict[str, dict[str, Any]], disk: dict[str, Any],
               variants: list[Variant]) -> list[dict[str, Any]]:
    reads = []
    disk_mb = disk["read_mb_s"]["median"]
    for (v, order, workers, cache), rs in runs.items():
        if not rs:
            continue
        per_sample = stores[v.name]["bytes_per_sample"]
        rates = [r["samples"] / r["seconds"] if r["seconds"] > 0 else math.inf for r in rs]
        gaps_ms = np.array([g for r in rs for g in r["batch_s"]]) * 1e3
        resident = [r["resident"] for r in rs]
        verified = max(resident) <= COLD_RESIDENT_MAX if cache == "cold" else min(resident) >= WARM_RESIDENT_MIN
        row: dict[str, Any] = {
            "format": v.name, "order": order, "workers": workers, "cache": cache,
            "samples": rs[0]["samples"], "batches": len(rs[0]["batch_s"]), "repeats": len(rs),
            "samples_per_s": _stats(rates),
            "mb_per_s": _stats([x * per_sample / 1e6 for x in rates]),
            "batch_latency_ms": {"p50": float(np.percentile(gaps_ms, 50)), "p95": float(np.percentile(gaps_ms, 95)),
                                 "max": float(gaps_ms.max()), "batches": int(len(gaps_ms))},
            "steady_samples_per_s": _steady(rs),
            "seconds": [r["seconds"] for r in rs], "startup_s": _stats([r["startup_s"] for r in rs]),
            "resident_at_start": resident, "verified": verified,
            "disk_fraction": None, "vs_imagefolder": None, "vs_imagefolder_runs": None,
        }
        if cache == "cold" and disk_mb > 0:
            row["disk_fraction"] = row["mb_per_s"]["median"] / disk_mb
        base = runs.get((Variant("imagefolder"), order, workers, cache))
        if base:
            base_rates = [r["samples"] / r["seconds"] for r in base]
            row["vs_imagefolder"] = row["samples_per_s"]["median"] / statistics.median(base_rates)
            row["vs_imagefolder_runs"] = [a / b for a, b in zip(rates, base_rates)]  # same round, same load
        reads.append(row)
    return reads


__all__ = ["BenchReport", "Variant", "can_drop_caches", "default_formats", "disk_bandwidth", "disk_info", "evict",
           "machine_info", "parse_variants", "resident_fraction", "run_bench", "store_files"]
