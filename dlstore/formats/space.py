"""A full disk, one error: the ways ENOSPC reaches a writer turned into DiskFullError naming the path."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ..errors import DiskFullError, StoreWriteError

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
