"""Worker processes that die with the process that started them.

Every process dlstore starts (a loader's batch workers, a conversion's decode workers) uses
this module, the one place that knows how; it imports nothing from the package, so every
layer may use it.

A process killed by SIGTERM (Python's default action: no cleanup), SIGKILL or the
OOM killer never tells its workers to stop, and a worker blocked waiting for its
next task would wait forever, holding its copy of the dataset and its mappings of
the shared memory. Two ways out, as a worker sees it::

    Linux      prctl(PR_SET_PDEATHSIG, SIGKILL): the kernel kills the worker when the
               thread that started it exits (set only for a child of this process started
               from its main thread: a worker started from a thread that ends while the
               process lives on must not die with it)
    anywhere   the wait for a task wakes every POLL_S and checks that the parent is there:
               os.getppid() unchanged (a child whose parent dies is re-parented), and
               multiprocessing's parent sentinel not at end of file (under forkserver the
               worker's parent is the forkserver, which outlives the main process as long
               as its children hold its pipe)

The second is what torch.utils.data's workers do (``ManagerWatchdog``, every 5 s);
the first needs no polling and reaches a worker busy with a batch too. A worker of a pool
whose wait it does not own (``concurrent.futures.ProcessPoolExecutor``'s) gets both from
``Parent`` and ``watch``: a daemon thread that does the second check and ends the process.
Shared memory needs nothing more: torch unlinks a segment from ``/dev/shm`` as soon as it
is made (the ``file_descriptor`` strategy), so the kernel frees it with its last mapping,
the moment the last of these processes is gone; under the ``file_system`` strategy
``torch_shm_manager`` unlinks the segments once the processes it serves are gone.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import wait
from typing import Any

# Seconds between two checks of the parent by a worker waiting for a task.
POLL_S = 1.0
_PR_SET_PDEATHSIG = 1     # <linux/prctl.h>


def parent_spec(ctx: Any) -> tuple[int | None, bool]:
    """What a worker about to be started from here needs to watch its parent.

    Returns:
        (the pid the worker's parent has, or None when it is a forkserver's; whether
        the kernel's parent-death signal may be used: the worker is this process's child
        and the starting thread lives as long as the process).
    """
    if ctx.get_start_method() == "forkserver":
        return None, False
    return os.getpid(), threading.current_thread() is threading.main_thread()


class Parent:
    """In a worker: is the process that started it still there?"""

    def __init__(self, spec: tuple[int | None, bool]):
        expected, deathsig = spec
        if deathsig:
            _kill_me_with_parent()
        # read after prctl: a parent gone before it shows here, not as a missed signal
        self.pid = os.getppid() if expected is None else expected
        parent = multiprocessing.parent_process()
        self._sentinel = parent.sentinel if parent is not None else None

    def alive(self) -> bool:
        if os.getppid() != self.pid:
            return False
        # readable only at end of file: the main process never writes to it
        return self._sentinel is None or not wait([self._sentinel], timeout=0)


def watch(parent: Parent, exit_code: int = 1) -> threading.Thread:
    """In a worker whose main thread may block where it cannot poll (a pool's task queue): a daemon
    thread that ends the process, without cleanup, once ``parent`` is gone."""
    def run() -> None:
        while parent.alive():
            time.sleep(POLL_S)
        os._exit(exit_code)

    thread = threading.Thread(target=run, name="dlstore-parent-watch", daemon=True)
    thread.start()
    return thread


def _kill_me_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):    # no libc symbol (a static or unusual build): polling alone
        return
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


class TaskQueue:
    """Tasks for a pool of workers, whoever is free takes the next; ``get`` gives up when the parent is gone.

    ``multiprocessing.SimpleQueue``'s layout (a pipe, a lock for the readers, one for the
    writers) with a reader that never blocks longer than ``POLL_S``.
    """

    def __init__(self, ctx: Any):
        self._reader, self._writer = ctx.Pipe(duplex=False)
        self._rlock = ctx.Lock()
        self._wlock = ctx.Lock()

    def put(self, task: Any) -> None:
        with self._wlock:
            self._writer.send(task)

    def get(self, parent: Parent) -> Any:
        """The next task, or None once the parent has gone (as for the stop sentinel)."""
        while True:
            if self._rlock.acquire(timeout=POLL_S):
                try:
                    while not self._reader.poll(POLL_S):
                        if not parent.alive():
                            return None
                    return self._reader.recv()
                finally:
                    self._rlock.release()
            if not parent.alive():
                return None

    def close(self) -> None:
        self._reader.close()
        self._writer.close()
