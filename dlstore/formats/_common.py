"""What every format's Writer and Reader share: staging, publishing, locking, pid checks.

A Writer writes into a staging path next to the destination
(``.NAME.dlstore-tmp``) and renames it into place only when complete, so a
store that exists under its real name is a store that is whole. A lock file
(``.NAME.dlstore-lock``, ``flock``) makes a second conversion to the same
destination refuse instead of interleaving.

A conversion that may resume keeps per-sample integers (labels, shapes, the
shards index) in memory and appends them to ``.partial`` files beside the
staging store at each checkpoint (``PartialRows``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from array import array
from pathlib import Path
from typing import Any

from ..errors import ArgumentError, StoreBusyError, StoreCorruptError, StoreExistsError


def staging_path(dst: Path) -> Path:
    return dst.with_name(f".{dst.name}.dlstore-tmp")


def lock_path(dst: Path) -> Path:
    return dst.with_name(f".{dst.name}.dlstore-lock")


def remove_path(path: Path) -> None:
    """Remove a file or folder tree if present."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


class DestinationLock:
    """Exclusive, non-blocking lock on a destination; released on close or process death."""

    def __init__(self, dst: Path):
        self.path = lock_path(dst)
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreBusyError(
                f"{self.path.with_name(self.path.name[1:-len('.dlstore-lock')])}: another conversion "
                f"to this destination is running (lock {self.path}); wait for it or stop it"
            ) from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            try:
                self.path.unlink(missing_ok=True)
            finally:
                os.close(self._fd)
                self._fd = None


def check_destination(dst: Path, overwrite: bool) -> None:
    if dst.exists() and not overwrite:
        raise StoreExistsError(f"{dst}: already exists; pass overwrite=True (--overwrite) to replace it")


def publish(staged: Path, dst: Path, overwrite: bool) -> None:
    """Move a complete staged store to ``dst``, replacing an old store if allowed.

    The old store is renamed aside first and deleted after the new one is in
    place: a reader that already has the old files open keeps reading them
    (their inodes live on), and a new reader sees either the old store or the new
    one, never a mix.
    """
    old = dst.with_name(f".{dst.name}.dlstore-old")
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise StoreExistsError(f"{dst}: already exists; pass overwrite=True (--overwrite) to replace it")
        remove_path(old)
        os.replace(dst, old)
    os.replace(staged, dst)
    _fsync_dir(dst.parent)
    remove_path(old)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def safe_member(store: Path, name: Any) -> Path:
    """Path of a file a manifest names, refused if it could escape the store."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") \
            or "\x00" in name:
        raise StoreCorruptError(f"{store}: manifest names an unsafe file {name!r} (must be a plain name)")
    return store / name


class ForkSafe:
    """Mixin for readers: handles opened lazily, once per process, dropped on pickling.

    Subclasses keep every open handle in attributes listed in ``_handles`` and
    call ``self._ensure_open()`` before use; it reopens after a fork.
    """

    _handles: tuple[str, ...] = ()

    def _ensure_open(self) -> None:
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
    import numpy as np

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
    import numpy as np

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
