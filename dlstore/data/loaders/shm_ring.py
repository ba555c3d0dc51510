"""``ShmRingLoader``: batches built by worker processes straight into a ring of shared memory.

A DataLoader worker returns each batch as a tensor in a shared-memory segment of its
own: one segment created, mapped, page-faulted and passed (a file descriptor over a
socket) per batch, which can cost more than building a fixed-shape batch (see
docs/reading.md for the measurements). Here the main process allocates
the slots once, and only small messages cross the queues::

    main                                       worker w (a process)
    slots = R tensors (B, *sample shape) in shared memory, allocated once per loader
      tasks  <- (pass, k, slot j, indices, batch_seed(base, epoch, k))
                                               get_batch(indices, generator=seeded) written into slot j
      results -> (pass, k, slot j, rows, labels, error or None)   (a pipe per worker)
    hands out slot j[:rows] itself (no copy), in sampler order

A slot is in one of four states; only a free one is given a task::

    free --dispatch--> busy --reported--> ready --handed out--> held --last tensor gone--> free
                        (a worker may write it)                  (the user's)

Held: each hand-out wraps the slot in a new numpy view and gives the user
``torch.from_numpy(view)``. The tensor's storage keeps that view alive, and so does every
tensor, view or ``.numpy()`` array made from it; the ring keeps only a weak reference.
The slot is free again once the weak reference is dead, i.e. once nothing the user has
reaches that memory: loop variables, ``enumerate``'s cached tuple, a list of batches all
count, whatever their number (no reference counting by hand). When the user holds every
slot but the one being handed out (say ``list(loader)``) and no task is in flight, that
batch is copied out instead, so the loader never waits on the user; a pass that starts
with every slot held gets a new ring (the user keeps the old one). ``pin_memory`` copies
into pinned memory, and the slot is free at once.

Slots are handed out, not copied: a copy costs a few ms per 9.6 MB batch on two cores,
as much as building it. The worker asks the dataset for its batch buffer
(``StoreDataset._new_batch``) and is given the slot, so the gather writes into shared
memory directly; a batch built elsewhere (a crop into scratch memory, a transform
returning a new tensor) is copied in.

Reproducibility: batch k draws from a generator seeded with
``batch_seed(base, epoch, k)`` -- the ThreadLoader's scheme, base drawn from the
loader's generator once per pass -- and torch's global generator and Python's ``random``
are seeded with the same value before it (per-sample torchvision ops draw from them).
Batches are therefore equal to those of a ThreadLoader with the same generator, in
sampler order, whatever the number of workers. (The DataLoader path seeds per worker:
its random batches depend on the worker count.)

Shared memory is torch's (``share_memory_``): under the default ``file_descriptor``
strategy a segment is unlinked from ``/dev/shm`` as soon as it is created, so nothing
is left there whatever happens to the processes; the memory goes with the ring's last
tensor. The ring lives as long as the loader (or until ``close()``). Workers are started
per pass and stopped when it ends, breaks or fails (with ``persistent_workers``, kept
until ``close()`` or the loader is garbage collected), and die with the main process however
it ends, SIGTERM and SIGKILL included (``dlstore.processes``). An error in a worker is raised in
the main process, its type kept, with the batch, its indices and the worker's traceback
in a note; a worker that dies is a :class:`WorkerError` as soon as the main process waits.
One pass at a time: a pass started while another is suspended takes the workers and
slots over, and the old iterator raises ``UsageError`` when next resumed.
"""


from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler

from ...errors import SharedMemoryError, UsageError
from ..intraop import one_thread
from ..passes import LoaderIterator
from .ring_slots import Ring, batch_spec, ring_bytes, ring_size, shm_free, shm_message
from .ring_workers import WorkerPool
from .threads import ThreadLoader, batch_seed

# what dlstore.loader sizes and checks a ring with, here with the loader
__all__ = ["ShmRingLoader", "batch_spec", "ring_bytes", "ring_size", "shm_free", "shm_message"]


def _stop_unstarted(loader: ShmRingLoader, batches: Generator, passes_before: int) -> None:
    """Run as a pass's iterator is closed or dropped: one never advanced stops the workers ``iter()``
    started (unless persistent, or a later pass has begun), since a generator never advanced does not
    run its ``finally`` and they would run until the loader went away."""
    if (inspect.getgeneratorstate(batches) == inspect.GEN_CREATED and not loader.persistent_workers
            and loader._pass == passes_before):
        loader._stop_workers()


class ShmRingLoader(ThreadLoader):
    """Iterates ``(images, labels)`` batches built by ``workers`` processes into shared-memory slots.

    The ThreadLoader's interface and batches (same seeds, same order), built in processes:
    for batch paths that hold the GIL (per-sample Python ops). ``dlstore.loader`` returns it
    for ``num_workers > 0`` and ``shm_ring=True`` on a batch path of fixed output shape.

    Args:
        dataset: a StoreDataset (picklable; the workers get a copy).
        batch_sampler: yields the index list of each batch (it may have ``set_epoch``).
        workers: worker processes (>= 1).
        prefetch: batches in flight (>= workers).
        spec: (shape of one sample, dtype) of the images, as :func:`batch_spec` gives it.
        generator: the per-pass base seed is drawn from it (None: torch's default generator).
        pin_memory: page-locked batches (a copy), when CUDA is available.
        persistent_workers: keep the workers between passes.
        multiprocessing_context: ``"fork"``, ``"spawn"``, ``"forkserver"``, a context, or None (the default).
        worker_init_fn: called with the worker id in each worker, before its first batch.
    """

    def __init__(self, dataset: Any, batch_sampler: BatchSampler, *, workers: int, prefetch: int,
                 spec: tuple[tuple[int, ...], torch.dtype], generator: torch.Generator | None = None,
                 pin_memory: bool = False, persistent_workers: bool = False, multiprocessing_context: Any = None,
                 worker_init_fn: Callable[[int], None] | None = None, fallback: Callable[[], Any] | None = None):
        super().__init__(dataset, batch_sampler, threads=workers, prefetch=prefetch, generator=generator,
                         pin_memory=pin_memory)
        # chosen by dlstore.loader (not asked for): the loader to use if /dev/shm cannot hold the ring
        self.fallback = fallback
        self._fallback_loader: Any = None
        self.workers = workers
        self.spec = spec
        self.persistent_workers = persistent_workers
        self.multiprocessing_context = multiprocessing_context
        self.worker_init_fn = worker_init_fn
        self.ring_size = ring_size(self.prefetch)
        self._ring: Ring | None = None
        self._pool: WorkerPool | None = None
        self._pass = 0

    def _start(self) -> tuple[Ring, WorkerPool]:
        if self._ring is None:
            shape, dtype = self.spec
            rows = int(getattr(self.batch_sampler, "batch_size", None) or 1)
            self._ring = Ring(self.ring_size, rows, shape, dtype)
        if self._pool is None:
            self._pool = WorkerPool(self.dataset, self._ring, self.workers, self.multiprocessing_context,
                               self.worker_init_fn)
        return self._ring, self._pool

    def _stop_workers(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool = None

    def state_dict(self) -> dict[str, Any]:
        if self._fallback_loader is not None:
            raise UsageError("dlstore.loader: this loader took the DataLoader path (the shared memory was "
                             "short), which cannot resume mid-epoch; free /dev/shm or use threads")
        return super().state_dict()

    def close(self) -> None:
        """Stop the workers (persistent ones too) and drop the ring; batches the user holds stay valid."""
        self._stop_workers()
        self._ring = None

    def _free(self, ring: Ring, pool: WorkerPool, exclude: int = -1) -> int | None:
        for j in range(self.ring_size):
            if j != exclude and j not in pool.busy and not ring.is_held(j):
                return j
        return None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, Any]]:
        if self._fallback_loader is not None:
            return iter(self._fallback_loader)
        try:
            self._start()   # the workers start here, as a DataLoader's do at iter(): worker_init_fn runs
        except SharedMemoryError as exc:   # before the first next() (dlstore bench gates on it)
            if self.fallback is None:
                raise
            # other loaders took the shared memory since this one was made: the DataLoader path
            warnings.warn(f"dlstore.loader: {exc}; this loader takes the DataLoader path", stacklevel=2)
            self._fallback_loader = self.fallback()
            return iter(self._fallback_loader)
        batches = self._pass_batches()
        return LoaderIterator(batches, functools.partial(_stop_unstarted, self, batches, self._pass))

    def _pass_batches(self) -> Iterator[tuple[torch.Tensor, Any]]:
        epoch = self._epoch()
        skip = self._state.begin(self.generator, epoch)
        base = int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
        self._pass += 1          # before _start: an unstarted iterator collected from here on
        pass_id = self._pass     # (its finalizer, _stop_unstarted) leaves this pass's workers alone
        ring, pool = self._start()
        pool.current.value = pass_id
        # a pass left suspended (an iterator not run to its end) gives up the batches it had
        # received and not handed out; resumed, it raises (below)
        pool.busy -= pool.ready
        pool.ready.clear()
        batches, _ = self._index_batches(skip)   # (resumed: past those; advised ahead with willneed)
        pending: dict[int, int] = {}      # k -> slot: dispatched this pass, not yet handed out
        ready: dict[int, tuple] = {}      # k -> (slot, rows, labels, error): reported this pass
        exhausted = False

        def dispatch() -> None:
            # keeps `prefetch` batches in flight while free slots last; called before each
            # batch is handed out, so the sampler is pulled as the ThreadLoader pulls it
            nonlocal exhausted
            while not exhausted and len(pending) < self.prefetch:
                j = self._free(ring, pool)
                if j is None:
                    return
                item = next(batches, None)
                if item is None:
                    exhausted = True
                    return
                pool.tasks.put((pass_id, item[0], j, np.asarray(item[1], dtype=np.int64),
                                batch_seed(base, epoch, item[0])))
                pending[item[0]] = j
                pool.busy.add(j)

        try:
            dispatch()
            k = skip
            while True:
                if k not in pending:      # then nothing of this pass is in flight
                    if exhausted:
                        self._state.end()
                        return
                    if pool.busy:         # slots busy with a pass that ended: they come back
                        self._receive(pool, pass_id, ready, pending)
                    else:
                        # the user holds every slot (batches kept from an earlier pass): they
                        # keep them, and this pass gets a new ring and workers
                        self.close()
                        ring, pool = self._start()
                        pool.current.value = pass_id
                    dispatch()
                    continue
                while k not in ready:
                    self._receive(pool, pass_id, ready, pending)
                j, rows, labels, error = ready.pop(k)
                del pending[k]
                pool.busy.discard(j)      # ready until here: no other task may take the slot
                pool.ready.discard(j)
                if error is not None:
                    exc, text, indices = error
                    exc.add_note(f"dlstore.loader: raised in a worker process building batch {k} "
                                 f"(indices {indices[:8]}{'...' if len(indices) > 8 else ''}); its traceback:\n"
                                 f"{text}")
                    raise exc
                with one_thread():    # the copies below, in the caller's thread: on it alone
                    if self.pin_memory:
                        images = ring.slots[j][:rows].pin_memory()
                    elif not pending and not exhausted and self._free(ring, pool, exclude=j) is None:
                        images = ring.slots[j][:rows].clone()    # the user holds every other slot
                    else:
                        images = ring.hand_out(j, rows)          # held from here: dispatch() skips it
                    if isinstance(labels, np.ndarray):
                        labels = torch.from_numpy(labels)
                        if self.pin_memory:
                            labels = labels.pin_memory()
                dispatch()
                k += 1
                self._state.served = k
                yield images, labels
                del images, labels    # this frame keeps no reference to a batch handed out
                if self._pass != pass_id:
                    raise UsageError(f"dlstore.loader: another pass over this loader started while this one was "
                                       f"at batch {k}; a ShmRingLoader runs one pass at a time (finish or "
                                       "close() this iterator first, or use two loaders)")
        finally:
            if self._pass == pass_id:            # (else a newer pass owns the pool)
                for j, *_ in ready.values():     # reported but never handed out (break, error): free
                    pool.busy.discard(j)
                    pool.ready.discard(j)
                if self._pool is not None:
                    self._pool.current.value = 0     # workers skip what is left of this pass
                if not self.persistent_workers or (self._pool is not None and
                                                   any(p.exitcode is not None for p in self._pool.procs)):
                    self._stop_workers()     # (persistent workers with a dead one: fresh ones next pass)

    def _receive(self, pool: WorkerPool, pass_id: int, ready: dict[int, tuple], pending: dict[int, int]) -> None:
        got_pass, k, j, rows, labels, error = pool.get(sorted(pending))
        if got_pass == pass_id and k in pending and (rows or error):
            ready[k] = (j, rows, labels, error)   # the slot stays busy until handed out
            pool.ready.add(j)
        else:
            pool.busy.discard(j)                  # a task of a pass that ended, skipped: the slot is free

    def __repr__(self) -> str:
        return (f"ShmRingLoader({self.dataset!r}, batches={len(self)}, workers={self.workers}, "
                f"prefetch={self.prefetch}, slots={self.ring_size}, pin_memory={self.pin_memory}, "
                f"persistent_workers={self.persistent_workers})")
