"""How dlstore opens an HDF5 file to read it: with the file locking of a plain ``h5py.File(path, "r")``.

HDF5 keeps one handle per file within a process and refuses a second open of the same file
whose locking flags differ (``file locking flag values don't match``); the sources of a
virtual dataset are opened with the flags of the file that maps them. So every read-only open
in dlstore goes through ``open_readonly``, which opens with h5py's defaults, that is HDF5's:
a shared lock, skipped where the filesystem reports locks unimplemented (ENOSYS), or what
``HDF5_USE_FILE_LOCKING`` says (HDF5 applies it to every open in the process, over any flags
passed). A user's default ``h5py.File(path, "r")`` then shares the file with an open dataset,
whichever opens first. Three fallbacks, each on one error HDF5 names exactly:

  flags differ      this process already holds the file with other flags (a user's
                    ``locking=False`` or ``locking=True`` before dlstore opened it): open with those.
  locks refused     the filesystem refuses locks with an errno HDF5 does not skip (ENOLCK: NFS
                    without a lock daemon; EOPNOTSUPP): open without locking, as HDF5 itself
                    does on ENOSYS. A published store is never modified in place (an overwrite
                    renames a new file over it), so the lock guards nothing a reader relies on.
  lock held         another process holds the file open for writing (EAGAIN): StoreBusyError,
                    rather than reading a file while it changes.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from ...errors import ArgumentError, StoreBusyError

_ENV = "HDF5_USE_FILE_LOCKING"
# errnos of flock(2) that mean "this filesystem does not lock", not "someone holds the lock"
_UNSUPPORTED = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP}
_OTHER_FLAGS = {   # HDF5's mismatch message -> the h5py setting of the handle already open
    "file locking flag values don't match": False,                  # opened with locking=False
    "file locking 'ignore disabled locks' flag values don't match": True,  # opened with locking=True
}


def open_readonly(path: str | os.PathLike, **kwargs: Any) -> Any:
    """``h5py.File(path, "r", **kwargs)`` with h5py's default locking and the fallbacks above.

    Raises:
        StoreBusyError: another process holds the file open for writing.
        ArgumentError: ``HDF5_USE_FILE_LOCKING`` asks for locks the filesystem refuses.
        OSError: what h5py raises otherwise (FileNotFoundError for a missing file).
    """
    import h5py  # (only HDF5 stores pay for h5py)

    try:
        return h5py.File(path, "r", **kwargs)
    except OSError as exc:
        message = str(exc)
        if "unable to lock file" in message and exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            raise StoreBusyError(
                f"{path}: another process holds this HDF5 file open for writing ({message}); a dlstore store "
                "is never written in place, so close the program writing it, or set HDF5_USE_FILE_LOCKING=FALSE "
                "to read it regardless") from exc
        if "unable to lock file" in message and exc.errno in _UNSUPPORTED:
            if _ENV in os.environ:   # HDF5 would apply it to the retry as well
                raise ArgumentError(f"{path}: {_ENV}={os.environ[_ENV]} asks for file locks, which this filesystem "
                                    f"refuses ({message}); set {_ENV}=FALSE or unset it") from exc
            return h5py.File(path, "r", locking=False, **kwargs)
        for text, locking in _OTHER_FLAGS.items():
            if text in message:
                return h5py.File(path, "r", locking=locking, **kwargs)
        raise
