"""What every format's Writer and Reader share: staging, publishing, locking, pid checks.

A Writer writes into a staging path next to the destination
(``.NAME.dlstore-tmp``) and renames it into place only when complete, so a
store that exists under its real name is a store that is whole. A lock file
(``.NAME.dlstore-lock``, ``flock``) makes a second conversion to the same
destination refuse instead of interleaving.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import StoreBusyError, StoreCorruptError, StoreExistsError


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
        raise ValueError(f"out must be a C-contiguous uint8 array of shape {(n, *shape)}, "
                         f"got {out.dtype} {out.shape}")
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
