"""This process's read-only LMDB environments, shared by every reader of a store.

py-lmdb refuses to open one environment twice in a process (LMDB's own rule: its
locks belong to the (process, file) pair), so readers of the same store in one
process share one Environment, found by (pid, device, inode) of ``data.mdb``.

Each one is counted: :func:`acquire` and :func:`release` (or :func:`held`) run
under the readers' open lock, and the last release closes the environment there
too. Closing where the last reference happened to die (a weak dictionary did this
before) left a gap: the entry was gone but the environment not yet closed, and a
thread opening the same store in that gap was refused ("already open").

Entries of another pid were inherited through a fork; the child closes its copies
(``lock=False``: nothing shared is touched) before it opens its own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import lmdb

from ..errors import StoreBusyError, StoreCorruptError
from ._common import open_lock

Key = tuple[int, int, int]

_ENVS: dict[Key, list] = {}   # key -> [environment, users]


def data_file(path: Path) -> Path:
    data = path / "data.mdb"
    if not data.is_file():
        raise StoreCorruptError(f"{path}: not an LMDB store (no data.mdb)")
    return data


def acquire(path: Path, readahead: bool) -> tuple[Key, lmdb.Environment]:
    """This process's environment for the store at ``path``, counted until :func:`release`."""
    with open_lock():
        pid = os.getpid()
        for key in [k for k in _ENVS if k[0] != pid]:
            inherited, _ = _ENVS.pop(key)
            inherited.close()
        st = data_file(path).stat()
        key = (pid, st.st_dev, st.st_ino)
        entry = _ENVS.get(key)
        if entry is None:
            entry = _ENVS[key] = [_open(path, st.st_size, readahead), 0]
        entry[1] += 1
        return key, entry[0]


def release(key: Key) -> None:
    """One user of ``key``'s environment is done; the last one closes it. A key this process
    does not hold (a reader's, inherited through a fork) is ignored."""
    with open_lock():
        entry = _ENVS.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _ENVS[key]
            entry[0].close()


@contextlib.contextmanager
def held(path: Path, readahead: bool = False) -> Iterator[lmdb.Environment]:
    """The environment for one short use (metadata), released after."""
    key, env = acquire(path, readahead)
    try:
        yield env
    finally:
        release(key)


def open_count() -> int:
    """How many environments this process holds open (for tests)."""
    return sum(1 for k in _ENVS if k[0] == os.getpid())


def _open(path: Path, size: int, readahead: bool) -> lmdb.Environment:
    try:
        env = lmdb.open(str(path), subdir=True, readonly=True, lock=False, readahead=readahead,
                        max_readers=1, max_spare_txns=1)
    except lmdb.Error as exc:
        if "already open" in str(exc):
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
