"""The ring back-end: batches built by worker processes straight into a ring of shared memory.

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

Slots are handed out, not copied: a copy costs as much as building a static batch. The
worker hands the slot to ``get_batch(..., out=slot)``, so the gather writes into shared
memory directly; a batch built elsewhere (a crop into scratch memory, a transform
returning a new tensor) is copied in.

Reproducibility: batch k draws from a generator seeded with the pass's seed of batch k
(``seeds.py``), and torch's global generator, numpy's and Python's ``random`` are seeded
with the same value before it (per-sample torchvision ops draw from them). Batches are
therefore those of every other back-end with the same seed, whatever the number of workers.

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

import warnings
from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np
import torch

from ...errors import SharedMemoryError, UsageError
from ..intraop import one_thread
from .passes import PassPlan
from .ring_slots import BatchSpec, Ring, ring_size
from .ring_workers import IN_SLOT, WorkerPool
from .threads import advised


class RingBackend:
    """Builds a pass's batches in ``workers`` processes, into shared-memory slots handed out in order.

    Args:
        dataset: a StoreDataset (picklable; the workers get a copy).
        workers: worker processes (>= 1).
        prefetch: batches in flight (>= workers).
        spec: what the slots hold (``ring_slots.batch_spec``): the images, and masks where the targets are.
        batch_size: rows of a full batch (the slots' rows).
        pin_memory: copy each batch into page-locked memory (the slot is free at once).
        persistent_workers: keep the workers between passes.
        multiprocessing_context: ``"fork"``, ``"spawn"``, ``"forkserver"``, a context, or None.
        worker_init_fn: called with the worker id in each worker, before its first batch.
        fallback: makes the back-end to use instead when /dev/shm cannot hold the ring (auto's choice).
        timeout: seconds to wait for a batch from the workers (0: no limit).

    The Loader's worker arguments pass through as they are: hence more than ten.
    """

    name = "ring"

    def __init__(self, dataset: Any, *, workers: int, prefetch: int, spec: BatchSpec,
                 batch_size: int, pin_memory: bool = False, persistent_workers: bool = False,
                 multiprocessing_context: Any = None, worker_init_fn: Callable[[int], None] | None = None,
                 fallback: Callable[[], Any] | None = None, timeout: float = 0):
        self.dataset = dataset
        self.timeout = timeout
        self.workers = workers
        self.prefetch = max(prefetch, workers)
        self.spec = spec
        self.batch_size = batch_size
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.multiprocessing_context = multiprocessing_context
        self.worker_init_fn = worker_init_fn
        self.fallback = fallback
        self.fallen_back: Any = None      # the back-end that took over (SharedMemoryError at a start)
        self.ring_size = ring_size(self.prefetch)
        self._ring: Ring | None = None
        self._pool: WorkerPool | None = None
        self._pass = 0

    def _start(self) -> tuple[Ring, WorkerPool]:
        if self._ring is None:
            self._ring = Ring(self.ring_size, self.batch_size, self.spec)
        if self._pool is None:
            self._pool = WorkerPool(self.dataset, self._ring, self.workers, self.multiprocessing_context,
                                    self.worker_init_fn, self.timeout)
        return self._ring, self._pool

    def _stop_workers(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool = None

    def close(self) -> None:
        """Stop the workers (persistent ones too) and drop the ring; batches the user holds stay valid."""
        self._stop_workers()
        self._ring = None
        if self.fallen_back is not None:
            self.fallen_back.close()

    def describe(self) -> str:
        if self.fallen_back is not None:
            return f"ring, fell back to {self.fallen_back.describe()}"
        return f"workers={self.workers}, prefetch={self.prefetch}, slots={self.ring_size}"

    def prepare(self) -> int | None:
        """Start the workers (``iter()`` of the loader, as a DataLoader's start there); a token for ``release``."""
        if self.fallen_back is not None:
            return None
        try:
            self._start()
        except SharedMemoryError as exc:
            if self.fallback is None:
                raise
            # other loaders took the shared memory since this one was made: the DataLoader path
            warnings.warn(f"dlstore.loader: {exc}; this loader takes the DataLoader path", stacklevel=3)
            self.fallen_back = self.fallback()
            return None
        self._pass += 1
        return self._pass

    def release(self, token: int | None) -> None:
        """An iterator dropped before its first batch: stop the workers its ``prepare`` started, unless
        they are persistent or a later pass has begun (or been prepared) since."""
        if token is not None and token == self._pass and not self.persistent_workers:
            self._stop_workers()

    def begin(self, run: PassPlan) -> Iterator[tuple[Any, Any]]:
        """The pass's batches, from the workers ``prepare`` started (started again if stopped since)."""
        if self.fallen_back is not None:
            return self.fallen_back.begin(run)
        self._pass += 1
        return self._batches(run, self._pass)

    def _free(self, ring: Ring, pool: WorkerPool, exclude: int = -1) -> int | None:
        for j in range(self.ring_size):
            if j != exclude and j not in pool.busy and not ring.is_held(j):
                return j
        return None

    def _batches(self, run: PassPlan, pass_id: int) -> Generator[tuple[Any, Any], None, None]:
        ring, pool = self._start()
        pool.current.value = pass_id
        # a pass left suspended (an iterator not run to its end) gives up the batches it had
        # received and not handed out; resumed, it raises (below)
        pool.busy -= pool.ready
        pool.ready.clear()
        batches, _ = advised(run.batches, self.dataset, self.batch_size)
        pending: dict[int, int] = {}      # k -> slot: dispatched this pass, not yet handed out
        ready: dict[int, tuple] = {}      # k -> (slot, rows, labels, error): reported this pass
        exhausted = False

        def dispatch() -> None:
            # keeps `prefetch` batches in flight while free slots last; called before each
            # batch is handed out, so the sampler is pulled as the threads pull it
            nonlocal exhausted
            while not exhausted and len(pending) < self.prefetch:
                j = self._free(ring, pool)
                if j is None:
                    return
                item = next(batches, None)
                if item is None:
                    exhausted = True
                    return
                pool.tasks.put((pass_id, item[0], j, np.asarray(item[1], dtype=np.int64), run.seed(item[0])))
                pending[item[0]] = j
                pool.busy.add(j)

        try:
            dispatch()
            k = run.first
            while True:
                if k not in pending:      # then nothing of this pass is in flight
                    if exhausted:
                        return
                    if pool.busy:         # slots busy with a pass that ended: they come back
                        self._receive(pool, pass_id, ready, pending)
                    else:
                        # the user holds every slot (batches kept from an earlier pass): they
                        # keep them, and this pass gets a new ring and workers
                        self._stop_workers()
                        self._ring = None
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
                copy = not pending and not exhausted and self._free(ring, pool, exclude=j) is None
                images = self._hand_out(ring, pool, j, rows, copy=copy)
                if isinstance(labels, bytes) and labels == IN_SLOT:
                    labels = self._hand_out(ring, pool, j, rows, copy=copy, targets=True)
                elif isinstance(labels, np.ndarray):
                    labels = torch.from_numpy(labels)
                    if self.pin_memory:
                        labels = labels.pin_memory()
                dispatch()
                k += 1
                yield images, labels
                del images, labels    # this frame keeps no reference to a batch handed out
                if self._pass != pass_id:
                    raise UsageError(f"dlstore.loader: another pass over this loader started while this one was "
                                     f"at batch {k}; the ring runs one pass at a time (finish or close() this "
                                     "iterator first, or use two loaders)")
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

    def _hand_out(self, ring: Ring, pool: WorkerPool, j: int, rows: int, *, copy: bool,
                  targets: bool = False) -> torch.Tensor:
        """Slot ``j``'s batch (``targets``: its targets) as the user gets it: the slot itself (held from
        here: dispatch skips it), a pinned copy, or a copy when the user holds every other slot (the
        loader never waits on them)."""
        slots = ring.target_slots if targets else ring.slots
        with one_thread():    # the copies, in the caller's thread: on it alone
            if self.pin_memory:
                return slots[j][:rows].pin_memory()
            if copy:
                return slots[j][:rows].clone()
            return ring.hand_out_targets(j, rows) if targets else ring.hand_out(j, rows)

    def _receive(self, pool: WorkerPool, pass_id: int, ready: dict[int, tuple], pending: dict[int, int]) -> None:
        got_pass, k, j, rows, labels, error = pool.get(sorted(pending))
        if got_pass == pass_id and k in pending and (rows or error):
            ready[k] = (j, rows, labels, error)   # the slot stays busy until handed out
            pool.ready.add(j)
        else:
            pool.busy.discard(j)                  # a task of a pass that ended, skipped: the slot is free

