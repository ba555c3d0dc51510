"""torch's intra-op thread pool, per thread: dlstore's batch assembly runs its torch ops on one.

A torch op on a large CPU tensor (``stack``, ``copy_``, ``where``, a resize) splits its
loop over an OpenMP team: the calling thread and ``torch.get_num_threads() - 1`` others,
joined at a barrier when the op ends. The op lasts as long as its slowest member, so on
a busy machine, where any member may wait a scheduler slice (milliseconds) for a core,
every op waits for the unluckiest one (docs/shared-machines.md measures it: a plain
``DataLoader``'s ``default_collate`` stalled this way). A loader's own threads each
calling such ops start a team each, oversubscribing the cores.

dlstore's read paths already parallelise across batches (loader threads, worker
processes), so within a batch one thread is the right count. ``torch.set_num_threads`` is
not the way to get it from a library: it sets the default of every thread started later
in the process, and the pthreadpool's size, for the user's code too. OpenMP keeps the
team size per thread instead (the ``nthreads-var`` ICV, which torch reads back through
``omp_get_max_threads`` once each thread has initialised its count), so dlstore sets
that one thread's value, through the OpenMP runtime torch loaded:

    a thread of dlstore's own (a loader thread)   one_thread_here(): 1 for the thread's life
    a caller's thread (the main thread)           with one_thread(): 1 inside, restored after

Where torch's backend is not OpenMP (a native or TBB build), or its runtime cannot be
found, both do nothing and the ops use torch's setting (docs/reading.md, shared machines).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

# OpenMP runtimes torch builds link (GNU, Intel, LLVM), as they appear among the loaded libraries.
_RUNTIMES = ("libgomp", "libiomp5", "libomp")


@functools.cache
def runtime() -> Any:
    """The OpenMP runtime torch's ops run on (a ``ctypes.CDLL``), or None when there is none to set."""
    if "OpenMP" not in torch.__config__.parallel_info().rsplit("ATen parallel backend:", 1)[-1]:
        return None
    for path in _loaded_libraries():
        name = path.rsplit("/", 1)[-1]
        if name.startswith(_RUNTIMES):
            try:
                lib = ctypes.CDLL(path)     # already loaded: the same library, not a second copy
                lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                lib.omp_get_max_threads.restype = ctypes.c_int
                return lib
            except (OSError, AttributeError):
                continue
    return None


def _loaded_libraries() -> list[str]:
    if not sys.platform.startswith("linux"):
        return []
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if "/" in line and ".so" in line})
    except OSError:
        return []


def one_thread_here() -> None:
    """From now on torch's ops called in this thread run on it alone (a thread dlstore started)."""
    lib = runtime()
    if lib is not None and torch.get_num_threads() != 1:    # (get_num_threads: torch's per-thread init first)
        lib.omp_set_num_threads(1)


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's ops called in this thread inside the block run on it alone; its count is restored after."""
    lib = runtime()
    before = torch.get_num_threads() if lib is not None else 1
    if before == 1:
        yield
        return
    lib.omp_set_num_threads(1)
    try:
        yield
    finally:
        lib.omp_set_num_threads(before)
