"""What every format's Writer and Reader share: full-disk errors, index checks, store pins,
fork-safe handles, synced writes.

Where a Writer's staging path lies and how it is published is the conversion's
business (``conversion/destination.py``). A conversion that may resume keeps per-sample integers (labels, shapes, the
shards index) in memory and appends them to ``.partial`` files beside the
staging store at each checkpoint (``PartialRows``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import threading
import weakref
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import (
    ArgumentError,
    DiskFullError,
    DlstoreError,
    SampleIndexError,
    StoreCorruptError,
    StoreNotFoundError,
    StoreWriteError,
)


# --- full disks ------------------------------------------------------------------------
# A full disk reaches a writer in several guises: OSError ENOSPC/EDQUOT (Python's own
# writes, h5py), or an LMDB commit failing with EIO (LMDB reports a short write, which is
# what ENOSPC looks like to pwrite, as EIO). `write_error` turns each into one DlstoreError
# that says "disk full" and names the path; `ensure_space` lets a writer whose library
# cannot survive a failed write (HDF5: see hdf5/writer.py) refuse before writing.

SPACE_MARGIN = 64 << 10  # bytes kept free for a library's metadata after a data write (HDF5: one block's index entries)


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path`` (None if unknown)."""
    path = Path(path)
    for folder in (path, *path.parents):
        try:
            st = os.statvfs(folder)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return None


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding ``path`` (or its nearest existing parent)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def disk_full(path: Path, needed: int | None = None) -> DiskFullError:
    """The DiskFullError for a store written at ``path``."""
    from ..units import human_bytes

    free = free_bytes(path)
    numbers = f"{human_bytes(free)} free" if free is not None else "free space unknown"
    if needed:
        numbers += f", {human_bytes(needed)} needed for the next write"
    return DiskFullError(errno.ENOSPC, f"{path}: disk full: no space left on the filesystem at {mount_point(path)} "
                         f"({numbers}); free space or write the store elsewhere, then rerun")


def ensure_space(path: Path, nbytes: int) -> None:
    """Raise DiskFullError unless ``nbytes`` (plus a margin for metadata) fit beside ``path``."""
    needed = int(nbytes) + int(nbytes) // 64 + SPACE_MARGIN
    free = free_bytes(path)
    if free is not None and free < needed:
        raise disk_full(path, needed)


def write_error(path: Path, exc: BaseException, *, nbytes: int = 0) -> StoreWriteError | None:
    """The DlstoreError a failed store write ``exc`` means, or None if it is not an I/O failure.

    ENOSPC/EDQUOT, and EIO (or a library's "Input/output error") while less than ``nbytes``
    plus a margin is free, mean a full disk; EFBIG and other EIO are write errors naming
    ``path``. ``exc`` may be an OSError or a library's own error (``lmdb.Error``).
    """
    if isinstance(exc, StoreWriteError):
        return exc
    code = getattr(exc, "errno", None)
    text = str(exc)
    where = getattr(exc, "filename", None) or path
    if code in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in text or "Disk quota" in text:
        return disk_full(Path(where))
    if code == errno.EIO or "Input/output error" in text:
        free = free_bytes(Path(where))
        if free is not None and free < int(nbytes) + SPACE_MARGIN:
            return disk_full(Path(where), int(nbytes) or None)
        return StoreWriteError(f"{where}: input/output error while writing the store ({text}); "
                               "check the disk (dmesg), then rerun")
    if code == errno.EFBIG:
        return StoreWriteError(f"{where}: File too large: the filesystem or this process's file-size limit "
                               f"(ulimit -f) refuses a bigger file ({text}); use smaller data files "
                               "(--shard-size) or another filesystem")
    return None


# --- sample indices ----------------------------------------------------------------------
# Readers take positions 0..count-1 only: a negative index is refused like any other
# out-of-range one (SampleIndexError, an IndexError), never wrapped and never taken for
# damage. Python's negative indexing belongs to the Dataset (StoreDataset wraps, as a
# sequence does, then calls the reader with the position).

def check_index(path: Path, i: int, count: int) -> int:
    """``i`` as an int if ``0 <= i < count``, else SampleIndexError naming the store."""
    i = int(i)
    if not 0 <= i < count:
        raise SampleIndexError(f"{path}: index {i} out of range for a store of {count} samples "
                               f"(readers take 0..{count - 1}; negative indices are refused)")
    return i


def check_indices(path: Path, indices: Any, count: int) -> Any:
    """``indices`` as a flat int64 array, all within ``0..count-1``, else SampleIndexError."""

    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    if len(indices) and (indices.min() < 0 or indices.max() >= count):
        check_index(path, indices[(indices < 0) | (indices >= count)][0], count)
    return indices


def check_sample(where: Path, sample: np.ndarray, shape: tuple[int, ...] | None) -> None:
    """ArgumentError unless ``sample`` is a uint8 (C, H, W) array of the store's ``shape`` (None: any)."""
    if sample.dtype != np.uint8 or sample.ndim != 3:
        raise ArgumentError(f"{where}: sample must be a uint8 (C, H, W) array, got {sample.dtype} {sample.shape}")
    if shape is not None and tuple(sample.shape) != shape:
        raise ArgumentError(f"{where}: sample shape {tuple(sample.shape)} != store shape {shape}; "
                            "every sample of a fixed-shape store has its shape")


# --- a store replaced under an open reader ----------------------------------------------
# `publish` renames the old store aside and deletes it; a reader that already has a file open
# keeps reading it, but a file it opens later by name would come from the new store, beside
# the old one's manifest and labels: a mix. So a reader records the store's identity (device,
# inode of the folder or file) before it reads any of it, and checks it again after each later
# open: a path that still names the old store then named it at the open too (a replaced store
# never comes back), and one that names another store is a clear error, never a mix.
# The numbers alone are not enough: once the old store is deleted its inode is free, and ext4
# hands it to the next new file or folder, so after two overwrites the store at the path can
# carry the old store's identity (benchmarks/soak.py found a reader reading the third store's
# pixels with the first one's labels). A reader therefore holds a descriptor on the inode it
# recorded (StorePin) for as long as it lives: a held inode is never freed, so never reused.


class StorePin:
    """A descriptor held on a store's folder or file: its inode cannot be reused while held.

    ``identity`` is the (device, inode) of what the descriptor holds, taken from the
    descriptor itself (no window between the stat and the pin). Pickling keeps the
    identity; unpickling (a spawned worker) pins the path again, and if the path names
    another inode by then, the identity stays the recorded one: the reader's next check
    then fails, as it must.
    """

    def __init__(self, path: Path, identity: tuple[int, int] | None = None):
        self.path = Path(path)
        try:   # O_PATH: no read permission needed, no data access; falls back to O_RDONLY off Linux
            fd = os.open(self.path, getattr(os, "O_PATH", os.O_RDONLY) | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            if identity is None:
                raise StoreNotFoundError(f"{path}: no such store") from None
            fd = None
        pinned = None
        if fd is not None:
            st = os.fstat(fd)
            pinned = (st.st_dev, st.st_ino)
        if identity is not None and pinned != identity:   # not the recorded store: hold nothing
            if fd is not None:
                os.close(fd)
            fd = None
        self.identity: tuple[int, int] = identity if identity is not None else pinned
        self._fd = fd
        if fd is not None:
            weakref.finalize(self, os.close, fd)

    def __reduce__(self):
        return (StorePin, (self.path, self.identity))


def store_identity(path: Path) -> tuple[int, int]:
    """(device, inode) of a store's folder or file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise StoreNotFoundError(f"{path}: no such store") from None
    return st.st_dev, st.st_ino


def check_identity(path: Path, identity: tuple[int, int] | None) -> None:
    """StoreCorruptError unless ``path`` is still the store whose identity a reader recorded."""
    if identity is None:
        return
    try:
        now = store_identity(path)
    except StoreNotFoundError:
        now = None
    if now != identity:
        raise StoreCorruptError(f"{path}: the store was replaced (converted again with overwrite, or moved) after "
                                "this reader opened it; the samples it has not read yet are gone with the old "
                                "files: open the store again")


@contextlib.contextmanager
def library_errors_as_damage(path: Path, errors: tuple[type[BaseException], ...] = (OSError, KeyError, RuntimeError)):
    """A C library's own errors while reading a published store's metadata (h5py: OSError "incorrect
    metadata checksum", KeyError "Unable to open object") mean a damaged file: StoreCorruptError naming it."""
    try:
        yield
    except DlstoreError:
        raise
    except errors as exc:
        raise StoreCorruptError(f"{path}: damaged: the library reports {type(exc).__name__}: {exc}; run dlstore "
                                "verify, then convert the store again or restore a copy") from exc


def safe_member(store: Path, name: Any) -> Path:
    """Path of a file a manifest names, refused if it could escape the store."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") \
            or "\x00" in name:
        raise StoreCorruptError(f"{store}: manifest names an unsafe file {name!r} (must be a plain name)")
    return store / name


# Held while a reader opens its handles. Threads that use a reader for the first time at
# once would otherwise all open it: one sees the handles another has just reset to None,
# and LMDB refuses a second open of the environment ("already open"). An RLock: an open
# may open another reader. A fork while some thread holds it would copy it held, so the
# child starts with a fresh one.
_OPEN_LOCK = threading.RLock()


def _fresh_open_lock() -> None:
    global _OPEN_LOCK
    _OPEN_LOCK = threading.RLock()


os.register_at_fork(after_in_child=_fresh_open_lock)


def open_lock() -> threading.RLock:
    """The lock every lazy open of a reader's handles holds (this process's)."""
    return _OPEN_LOCK


class ForkSafe:
    """Mixin for readers: handles opened lazily, once per process, dropped on pickling.

    Subclasses keep every open handle in attributes listed in ``_handles`` and
    call ``self._ensure_open()`` before use; it reopens after a fork. The first
    use may come from several threads at once: one opens, the others wait for it.
    """

    _handles: tuple[str, ...] = ()

    def _ensure_open(self) -> None:
        if getattr(self, "_pid", None) == os.getpid():
            return          # open in this process; _pid is set only once every handle is
        with open_lock():
            if getattr(self, "_pid", None) != os.getpid():
                for name in self._handles:
                    setattr(self, name, None)
                self._open()
                self._pid = os.getpid()

    def _open(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in self._handles:
            state[name] = None
        state["_pid"] = None
        return state


def sha256_file(path: Path) -> str:
    """sha256 hex digest of a file's bytes, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def batch_out(out: Any, n: int, shape: tuple[int, ...]) -> Any:
    """The (n, *shape) uint8 array a reader's ``get_batch`` fills: ``out`` checked, or a new one."""

    if out is None:
        return np.empty((n, *shape), dtype=np.uint8)
    if out.shape != (n, *shape) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ArgumentError(f"out must be a C-contiguous uint8 array of shape {(n, *shape)}, "
                            f"got {out.dtype} {out.shape}{'' if out.flags.c_contiguous else ' (not C-contiguous)'}; "
                            "pass out=None to get a new array")
    return out


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (a store is published only after this)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_npy_synced(path: Path, array: Any) -> str:
    """``np.save`` (never pickled) + fsync; return the file's sha256 for the manifest."""

    with open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    return sha256_file(path)


class PartialRows:
    """Rows of ``width`` int64 values saved beside a staging store, one checkpoint at a time.

    A writer keeps per-sample integers (a label; C, H, W; ...) in memory as a flat
    ``array('q')``, ``width`` values per sample. At each checkpoint ``append``
    writes the rows not saved yet and fsyncs them; on resume ``restore`` reads
    back the rows the checkpoint counts and cuts off any written after it.

    File layout (no header; the file never leaves the machine that writes it)::

        row r: int64 x width, native byte order   np.fromfile(path, np.int64).reshape(-1, width)
    """

    ITEMSIZE = 8

    def __init__(self, path: Path, width: int = 1):
        self.path = Path(path)
        self.width = int(width)
        self.saved = 0  # rows already in the file

    def append(self, values: array, rows: int) -> None:
        """Write rows ``[saved, rows)`` of ``values`` (flat, ``width`` per row) and fsync them."""
        if not self.saved <= rows <= len(values) // self.width:
            raise ArgumentError(f"{self.path}: cannot save up to row {rows}: {self.saved} rows are saved and "
                                f"{len(values) // self.width} held; rows must lie between the two")
        with open(self.path, "ab") as f:
            f.write(memoryview(values)[self.saved * self.width:rows * self.width])
            f.flush()
            os.fsync(f.fileno())
        self.saved = rows

    def restore(self, rows: int) -> array:
        """The first ``rows`` rows (flat), after truncating the file to them.

        A missing file is created empty when ``rows`` is 0 (a checkpoint before any
        row); a file holding fewer rows raises StoreCorruptError.
        """
        size = rows * self.width * self.ITEMSIZE
        try:
            with open(self.path, "r+b") as f:
                data = f.read(size)
                if len(data) == size:
                    f.truncate(size)  # rows appended after the checkpoint
        except FileNotFoundError:
            if rows:
                raise StoreCorruptError(f"{self.path}: missing, but the checkpoint counts {rows} rows; "
                                        "rerun without --resume to start over") from None
            self.path.touch()
            data = b""
        if len(data) < size:
            raise StoreCorruptError(
                f"{self.path}: holds {len(data) // (self.width * self.ITEMSIZE)} rows of {self.width} int64, "
                f"the checkpoint counts {rows}; rerun without --resume to start over")
        values = array("q")
        values.frombytes(data)
        self.saved = rows
        return values

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def next_prime(n: int) -> int:
    n = max(2, n)
    while any(n % d == 0 for d in range(2, int(n ** 0.5) + 1)):
        n += 1
    return n
