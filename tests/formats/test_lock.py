"""The destination lock holds under a race: at most one converter at a time, however they interleave.

The lock file is unlinked on release. A converter that opened the old file just
before the unlink, and locks it just after, must not count itself as the holder
(the classic flock/unlink race): ``DestinationLock.acquire`` checks that the
path still names the inode it locked.
"""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from dlstore.errors import StoreBusyError
from dlstore.conversion.lock import DestinationLock

ROUNDS = 300


def _contender(dst: str, marker: str, rounds: int, deadline: float, result) -> None:
    """Take the lock ``rounds`` times; while holding it, own ``marker`` exclusively."""
    overlaps = held = 0
    while held < rounds and time.monotonic() < deadline:
        lock = DestinationLock(__import__("pathlib").Path(dst))
        try:
            lock.acquire()
        except StoreBusyError:
            continue
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # fails if another holder has it
        except FileExistsError:
            overlaps += 1
        else:
            os.close(fd)
            os.unlink(marker)
        held += 1
        lock.release()
    result.put((held, overlaps))


@pytest.mark.slow
def test_two_processes_never_hold_the_lock_together(tmp_path):
    ctx = multiprocessing.get_context("fork")
    result = ctx.Queue()
    deadline = time.monotonic() + 60
    procs = [ctx.Process(target=_contender, args=(str(tmp_path / "s.shards"), str(tmp_path / "marker"), ROUNDS,
                                                  deadline, result)) for _ in range(3)]
    for p in procs:
        p.start()
    outcomes = [result.get(timeout=90) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert sum(o for _, o in outcomes) == 0, outcomes  # never two holders at once
    assert sum(h for h, _ in outcomes) >= ROUNDS, outcomes  # the race was run many times
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the lock file is gone after the last release
