"""A reader pins the store it opened: a store replaced under it is a clear error, never a mix."""

from __future__ import annotations

import os
import weakref
from pathlib import Path

from ..errors import StoreCorruptError, StoreNotFoundError

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
