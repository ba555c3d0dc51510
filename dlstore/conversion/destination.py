"""Where a conversion writes, and what it may replace there.

A Writer fills a staging path next to the destination (``.NAME.dlstore-tmp``);
``publish`` renames it into place only when complete, so a store that exists
under its real name is a store that is whole. A lock file
(``.NAME.dlstore-lock``, ``flock``) makes a second conversion to the same
destination refuse instead of interleaving. With ``overwrite``, only a store
dlstore wrote is replaced (``formats.ownership``), and never the source.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from ..errors import NotAStoreError, StoreBusyError, StoreExistsError
from ..formats.ownership import not_a_store


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
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise StoreBusyError(
                    f"{self.path.with_name(self.path.name[1:-len('.dlstore-lock')])}: another conversion "
                    f"to this destination is running (lock {self.path}); wait for it or stop it"
                ) from None
            # The holder before us unlinks the lock file when it releases it. If that happened
            # between our open and our flock, we hold a lock on a file nobody else can find, and
            # a third converter would create a new one and lock it too. So the lock counts only
            # if the path still names the inode we locked; otherwise try again with the new file.
            held = os.fstat(fd)
            try:
                named = os.stat(self.path)
            except FileNotFoundError:
                named = None
            if named is not None and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
                self._fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        if self._fd is not None:
            try:
                self.path.unlink(missing_ok=True)  # while still locked: see acquire
            finally:
                os.close(self._fd)
                self._fd = None


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_apart(dst: Path, src: Path, *, scanned: bool) -> None:
    """NotAStoreError if ``dst`` is the source ``src`` or contains it, or, for a folder that is
    scanned for images (``scanned``), lies inside it: the store would join the images (as a
    class folder) of the next conversion of that folder."""
    where, source = Path(os.path.realpath(dst)), Path(os.path.realpath(src))
    if where == source:
        problem = "is the source itself"
    elif where in source.parents:
        problem = f"contains the source {src}"
    elif scanned and source in where.parents:
        problem = (f"lies inside the source folder {src}: the store would be scanned as images of the "
                   "next conversion of that folder")
    else:
        return
    raise NotAStoreError(f"{dst}: the destination {problem}; write the store outside the source "
                         "(e.g. next to it); nothing was changed")


def check_destination(dst: Path, overwrite: bool) -> None:
    """StoreExistsError if something is at ``dst`` and it may not be replaced: ``overwrite`` is
    False, or what is there is not a dlstore store (NotAStoreError, which says what it is)."""
    if not (dst.exists() or dst.is_symlink()):
        return
    if not overwrite:
        raise StoreExistsError(f"{dst}: already exists; pass overwrite=True (--overwrite) to replace it")
    found = not_a_store(dst)
    if found is not None:
        raise NotAStoreError(f"{dst}: --overwrite (overwrite=True) replaces only a dlstore store, and this is "
                             f"{found}; nothing was changed")


def publish(staged: Path, dst: Path, overwrite: bool) -> None:
    """Move a complete staged store to ``dst``, replacing an old store if allowed.

    The old store is renamed aside first and deleted after the new one is in
    place: a reader that already has the old files open keeps reading them
    (their inodes live on), and a new reader sees either the old store or the new
    one, never a mix.
    """
    old = dst.with_name(f".{dst.name}.dlstore-old")
    if dst.exists() or dst.is_symlink():
        check_destination(dst, overwrite)   # again: something else may have been put there meanwhile
        remove_path(old)
        os.replace(dst, old)
    os.replace(staged, dst)
    fsync_dir(dst.parent)
    remove_path(old)
