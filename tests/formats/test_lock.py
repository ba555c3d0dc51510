"""The destination lock holds under a race: at most one converter at a time, however they interleave.

The lock file is unlinked on release. A converter that opened the old file just
before the unlink, and locks it just after, must not count itself as the holder
(the classic flock/unlink race): ``DestinationLock.acquire`` checks that the
path still names the inode it locked.

The lock is its holder's alone: a process forked from it does not share it, one that
finds it busy is told who holds it, and one that finds a dead holder's lock takes it
over, saying whose it was. Real processes, real signals.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
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


# --- the holder: named while it runs, taken over once it is gone ---------------------------------

HOLD = """
import os, sys, time
from pathlib import Path
from dlstore.conversion.lock import DestinationLock
lock = DestinationLock(Path(sys.argv[1]))
lock.acquire()
if sys.argv[2] == "orphan":          # a raw fork (an older dlstore's worker): the child keeps the descriptor
    if os.fork() == 0:
        print(os.getpid(), flush=True)
        time.sleep(600)
    os._exit(0)
print(os.getpid(), flush=True)
time.sleep(600)
"""


def _holder(dst, how: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(dst), how], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def test_a_busy_lock_names_its_holder_and_a_dead_holders_lock_is_taken_over(tmp_path):
    dst = tmp_path / "s.shards"
    proc, pid = _holder(dst, "holder")
    try:
        with pytest.raises(StoreBusyError, match=rf"another conversion to this destination is running \(pid {pid} "
                                                 rf"on {socket.gethostname()} since "):
            DestinationLock(dst).acquire()
    finally:
        proc.kill()
        proc.wait()
    messages = []
    lock = DestinationLock(dst, messages.append)
    lock.acquire()
    assert len(messages) == 1 and f"taking over the lock .s.shards.dlstore-lock" in messages[0] \
        and f"(pid {pid} on {socket.gethostname()}" in messages[0], messages
    assert json.loads((tmp_path / ".s.shards.dlstore-lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert list(tmp_path.iterdir()) == []
    DestinationLock(dst, messages.append).acquire()       # a released lock is no takeover
    assert len(messages) == 1


def test_processes_still_holding_a_dead_holders_lock_are_named(tmp_path):
    dst = tmp_path / "s.shards"
    proc, orphan = _holder(dst, "orphan")
    proc.wait()
    try:
        with pytest.raises(StoreBusyError, match=rf"has ended, but process\(es\) {orphan} hold the lock .*kill {orphan}"):
            DestinationLock(dst).acquire()
    finally:
        os.kill(orphan, signal.SIGKILL)
    end = time.monotonic() + 5
    while time.monotonic() < end:
        try:
            DestinationLock(dst).acquire()
            break
        except StoreBusyError:
            time.sleep(0.05)      # (the orphan's descriptor closes as the kernel tears it down)
    else:
        pytest.fail("the lock stayed held after its last holder was killed")


def _sleep(started, seconds: float) -> None:
    started.set()
    time.sleep(seconds)


def test_a_process_forked_while_the_lock_is_held_does_not_hold_it(tmp_path):
    dst = tmp_path / "s.shards"
    lock = DestinationLock(dst)
    lock.acquire()
    ctx = multiprocessing.get_context("fork")
    started = ctx.Event()
    child = ctx.Process(target=_sleep, args=(started, 30))
    child.start()
    try:
        assert started.wait(30)
        held = [os.readlink(f"/proc/{child.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{child.pid}/fd")]
        assert str(lock.path) not in held
        lock.release()
        again = DestinationLock(dst)
        again.acquire()                 # the child, still alive, shares no lock
        again.release()
    finally:
        child.kill()
        child.join()
