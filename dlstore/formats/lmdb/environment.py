"""This process's read-only LMDB environments, shared by every reader of a store.

py-lmdb refuses to open one environment twice in a process (LMDB's own rule: its
locks belong to the (process, file) pair), so readers of the same store in one
process share one Environment, found by (pid, device, inode) of ``data.mdb``
under the readers' open lock.

The values are weak: an environment closes when its last user lets go of it, in
whichever thread that happens. Closing it explicitly (when a count of readers
reached zero) was tried and crashed py-lmdb 1.4.1, the CI floor (a segfault in
4 threads opening and dropping readers): its close releases the GIL inside
``mdb_env_close`` while another thread may still be freeing a finished
transaction of that environment (py-lmdb #180; fixed by #417, March 2026).
Left to the garbage collector, the close happens only once no transaction
refers to the environment. The price is a short gap: the weak entry
is cleared just before the environment is closed, and a thread opening the same
store in that gap is refused ("already open"); :func:`_open` waits it out.

Entries of another pid were inherited through a fork; the child closes its copies
(``lock=False``: nothing shared is touched) before it opens its own.
"""

from __future__ import annotations

import os
import time
import weakref
from pathlib import Path

import lmdb

from ...errors import StoreBusyError, StoreCorruptError
from ..handles import open_lock

_ENVS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

# How long an "already open" refusal is taken for an environment of ours still closing
# in another thread (microseconds in practice) before it is reported as someone else's.
_CLOSING_WAIT_S = 2.0


def data_file(path: Path) -> Path:
    data = path / "data.mdb"
    if not data.is_file():
        raise StoreCorruptError(f"{path}: not an LMDB store (no data.mdb)")
    return data


def shared(path: Path, readahead: bool) -> lmdb.Environment:
    """This process's environment for the store at ``path``: open while anything refers to it."""
    with open_lock():
        pid = os.getpid()
        for key in [k for k in list(_ENVS.keys()) if k[0] != pid]:
            inherited = _ENVS.pop(key, None)
            if inherited is not None:
                inherited.close()
        st = data_file(path).stat()
        key = (pid, st.st_dev, st.st_ino)
        env = _ENVS.get(key)
        if env is None:
            env = _open(path, st.st_size, readahead)
            _ENVS[key] = env
        return env


def open_count() -> int:
    """How many environments this process holds open (for tests)."""
    return sum(1 for k in list(_ENVS.keys()) if k[0] == os.getpid())


def _open(path: Path, size: int, readahead: bool) -> lmdb.Environment:
    deadline = time.monotonic() + _CLOSING_WAIT_S
    while True:
        try:
            env = lmdb.open(str(path), subdir=True, readonly=True, lock=False, readahead=readahead,
                            max_readers=1, max_spare_txns=1)
            break
        except lmdb.Error as exc:
            busy = "already open" in str(exc)
            if busy and time.monotonic() < deadline:
                time.sleep(0.001)    # our last environment of this store is closing: it needs the GIL
                continue
            if busy:
                raise StoreBusyError(
                    f"{path}: this process already has the environment open outside dlstore, and py-lmdb "
                    "allows one open per process; close that lmdb.Environment first") from exc
            raise StoreCorruptError(f"{path}: cannot open the LMDB environment ({exc})") from exc
    # Pages are read through a memory map: one past the end of a truncated file would
    # kill the process with SIGBUS instead of raising, so check the length first.
    try:
        needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    except lmdb.Error as exc:
        env.close()
        raise StoreCorruptError(f"{path / 'data.mdb'}: damaged: LMDB reports {exc}") from exc
    if size < needed:
        env.close()
        raise StoreCorruptError(f"{path}: data.mdb is {size} bytes but its pages reach {needed}: "
                                "the file is truncated (an interrupted copy?); copy or convert it again")
    return env
