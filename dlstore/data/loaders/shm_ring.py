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
it ends, SIGTERM and SIGKILL included (``lifeline``). An error in a worker is raised in
the main process, its type kept, with the batch, its indices and the worker's traceback
in a note; a worker that dies is a :class:`WorkerError` as soon as the main process waits.
One pass at a time: a pass started while another is suspended takes the workers and
slots over, and the old iterator raises ``UsageError`` when next resumed.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import pickle
import random
import shutil
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Generator, Iterator
from multiprocessing.connection import wait
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as tmp
from torch.utils.data import BatchSampler

from ...errors import ArgumentError, SharedMemoryError, UsageError, WorkerError
from ...units import human_bytes
from ..passes import LoaderIterator
from .lifeline import Parent, TaskQueue, parent_spec
from .threads import ThreadLoader, batch_seed

# Seconds the workers get to exit after being told to, before they are terminated.
_JOIN_S = 5.0
# numpy stands in for torch dtypes it lacks (bfloat16) by an integer type of the same size:
# the ring's numpy views are only handles whose lifetime says whether a slot is held.
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


SHM = "/dev/shm"


def shm_free() -> int | None:
    """Free bytes of the shared memory torch allocates from (``/dev/shm``), or None if unknown."""
    try:
        return shutil.disk_usage(SHM).free
    except OSError:
        return None


def ring_size(in_flight: int) -> int:
    """Slots of a ring with ``in_flight`` batches dispatched: those, the one the user holds and the one
    before it (still bound to the loop variable, and to enumerate's tuple, while next() runs), a spare."""
    return in_flight + 3


def ring_bytes(spec: tuple[tuple[int, ...], torch.dtype], rows: int, prefetch: int, workers: int) -> int:
    """Shared memory a ShmRingLoader of ``prefetch`` batches in flight takes (its slots)."""
    shape, dtype = spec
    size = ring_size(max(prefetch, workers))
    return size * rows * int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()


def shm_message(need: int, detail: str = "") -> str:
    free = shm_free()
    have = "unknown" if free is None else human_bytes(free)
    return (f"the loader's ring of batches needs {human_bytes(need)} of shared memory and {SHM} has {have} "
            f"free {detail}".rstrip() + "; in Docker raise it (docker run --shm-size=2g), or lower "
            "prefetch_factor / num_workers / batch_size, or read on threads (num_workers=0), or pass "
            "shm_ring=False (the DataLoader path, which also needs shared memory per batch)")


def batch_spec(dataset: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
    """(shape of one sample, dtype) of ``dataset.get_batch``'s images, or None when not fixed.

    None for a variable-shape store, an empty one, or a batch path that does not return a
    tensor. Reads sample 0 once, with its own generator; torch's global generator is left
    as it was.
    """
    if getattr(dataset, "shape", None) is None or len(dataset) == 0:
        return None
    with torch.random.fork_rng(devices=[]):
        images, _ = dataset.get_batch([0], generator=torch.Generator().manual_seed(0))
    if not isinstance(images, torch.Tensor) or images.dim() < 1 or images.shape[0] != 1 \
            or images.element_size() not in _SAME_SIZE:
        return None
    return tuple(images.shape[1:]), images.dtype


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - unpicklable state fails in many ways; type and message survive
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _work(wid: int, dataset: Any, slots: list[torch.Tensor], tasks: TaskQueue, results: Any, current: Any,
          worker_init_fn: Callable[[int], None] | None, parent_of: tuple[int | None, bool]) -> None:
    """A worker's loop: build each task's batch into its slot, report (pass, k, slot, rows, labels);
    returns when told to, or when the main process is gone (see ``lifeline``)."""
    parent = Parent(parent_of)
    if not parent.alive():
        return
    torch.set_num_threads(1)
    target: list[torch.Tensor | None] = [None]
    new_batch = getattr(dataset, "_new_batch", None)
    if new_batch is not None:
        def into_slot(shape: tuple[int, ...]) -> torch.Tensor:
            slot, target[0] = target[0], None
            if slot is not None and slot.dtype == torch.uint8 and tuple(shape[1:]) == tuple(slot.shape[1:]) \
                    and shape[0] <= slot.shape[0]:
                return slot[:shape[0]]
            return new_batch(shape)
        dataset._new_batch = into_slot          # this process's copy of the dataset only
    try:
        if worker_init_fn is not None:
            worker_init_fn(wid)
        _serve(dataset, slots, tasks, results, current, target, parent)
    except KeyboardInterrupt:       # Ctrl-C reaches the whole process group: the main process raises it
        return
    except (BrokenPipeError, ConnectionResetError):     # a report to a main process that has gone
        return


def _serve(dataset: Any, slots: list[torch.Tensor], tasks: TaskQueue, results: Any, current: Any,
           target: list[torch.Tensor | None], parent: Parent) -> None:
    while True:
        task = tasks.get(parent)
        if task is None:
            return
        pass_id, k, j, indices, seed = task
        if pass_id != current.value:            # a pass that ended (break, error): skip, free the slot
            results.send((pass_id, k, j, 0, None, None))
            continue
        try:
            slot = slots[j]
            generator = torch.Generator()
            generator.manual_seed(seed)
            # per-sample torchvision ops draw from the global generators (torch.manual_seed would
            # also seed every accelerator's, 0.14 ms a batch)
            torch.default_generator.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed % (1 << 32))   # as DataLoader workers seed numpy (np.random augmentations)
            target[0] = slot
            images, labels = dataset.get_batch(indices, generator=generator)
            target[0] = None
            rows = len(indices)
            if not isinstance(images, torch.Tensor) or tuple(images.shape) != (rows, *slot.shape[1:]) \
                    or images.dtype != slot.dtype:
                got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
                raise ArgumentError(
                    f"batch {k} is {got} {getattr(images, 'dtype', '')}, but the loader's shared-memory slots "
                    f"hold ({rows}, {', '.join(map(str, slot.shape[1:]))}) {slot.dtype} (the shape of sample 0's "
                    "batch): this pipeline's output shape varies; use dlstore.loader(..., shm_ring=False)")
            if images.data_ptr() != slot.data_ptr() or images.stride() != slot[:rows].stride():
                # another tensor, or a view of the slot in another layout (a transpose of square
                # images): copied through a contiguous copy, since the source may overlap the slot
                slot[:rows].copy_(images if images.data_ptr() != slot.data_ptr() else images.contiguous())
            del images
            if isinstance(labels, torch.Tensor):
                labels = labels.numpy()          # plain bytes through the pipe, not a shared segment
            results.send((pass_id, k, j, rows, labels, None))
        except Exception as exc:  # noqa: BLE001 - reported with its batch; the main process raises it
            target[0] = None
            text = "".join(traceback.format_exception(exc))
            results.send((pass_id, k, j, 0, None, (_picklable(exc), text, [int(i) for i in indices])))


class _Ring:
    """The slots, in shared memory, and a weak reference to the view each hand-out wraps."""

    def __init__(self, size: int, rows: int, shape: tuple[int, ...], dtype: torch.dtype):
        self.dtype = dtype
        try:
            self.slots = [torch.empty((rows, *shape), dtype=dtype).share_memory_() for _ in range(size)]
        except RuntimeError as exc:   # torch: "unable to allocate shared memory(shm) ... No space left"
            need = size * rows * int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            raise SharedMemoryError(shm_message(need, f"({exc})")) from None
        same = _SAME_SIZE[self.slots[0].element_size()]
        self.arrays = [s.view(same).numpy() for s in self.slots]
        self.held: list[weakref.ref | None] = [None] * size

    def is_held(self, j: int) -> bool:
        ref = self.held[j]
        return ref is not None and ref() is not None

    def hand_out(self, j: int, rows: int) -> torch.Tensor:
        """Slot ``j``'s first ``rows`` rows as a tensor the ring tracks (held until it and its views are gone)."""
        view = self.arrays[j][:rows]            # a new object per hand-out: its life is the batch's
        self.held[j] = weakref.ref(view)
        return torch.from_numpy(view).view(self.dtype)


class _Pool:
    """Worker processes, the task queue and a result pipe per worker; stopped by ``stop`` (or when collected).

    The workers take tasks from one queue (whoever is free) and each reports on a pipe of
    its own: no lock and no feeder thread on the way back, and the main process waits on
    the pipes and the processes' sentinels at once, so a worker's death is seen at once.
    """

    def __init__(self, dataset: Any, ring: _Ring, workers: int, context: Any,
                 worker_init_fn: Callable[[int], None] | None):
        ctx = context if not isinstance(context, (str, type(None))) else tmp.get_context(context)
        self.tasks = TaskQueue(ctx)
        pipes = [ctx.Pipe(duplex=False) for _ in range(workers)]
        self.results = [reader for reader, _ in pipes]
        self.current = ctx.Value("q", 0, lock=False)
        self.busy: set[int] = set()     # slots given a task (any pass) and not yet handed out or skipped
        self.ready: set[int] = set()    # of those, the ones reported: no worker writes them any more
        self.procs = [ctx.Process(target=_work, args=(w, dataset, ring.slots, self.tasks, writer, self.current,
                                                      worker_init_fn, parent_spec(ctx)),
                                  daemon=True, name=f"dlstore-loader-{w}")
                      for w, (_, writer) in enumerate(pipes)]
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.tasks, self.results)
        for p in self.procs:
            p.start()
        for _, writer in pipes:
            writer.close()              # the workers have theirs

    def get(self, waiting_for: list[int]) -> tuple:
        """The next report of any worker; WorkerError once a worker has exited (it may have died
        holding a task, or the task queue's lock, and the others would wait forever)."""
        sentinels = {p.sentinel: p for p in self.procs}
        while True:
            ready = wait([*self.results, *sentinels])
            # the dead first: while the others keep reporting, their results are always ready and
            # a pass the survivors can finish alone would end without a word (seen in CI)
            dead = [p for p in self.procs if p.sentinel in ready or p.exitcode is not None]
            if not dead:
                for conn in self.results:
                    if conn in ready:
                        try:
                            return conn.recv()
                        except EOFError:    # its worker is gone: the sentinel says how
                            pass
                continue
            dead[0].join()
            raise WorkerError(
                f"dlstore.loader: worker process {dead[0].name} (pid {dead[0].pid}) exited with code "
                f"{dead[0].exitcode} while batches {waiting_for} were being built (killed, out of "
                "memory, or crashed in native code)")

    def stop(self) -> None:
        self._finalizer()


def _stop(procs: list[Any], tasks: Any, results: list[Any]) -> None:
    """Tell the workers to exit, wait for them (reading what they still report), terminate stragglers."""
    for p in procs:
        if p.is_alive():
            try:
                tasks.put(None)
            except (OSError, ValueError):
                break
    deadline = time.monotonic() + _JOIN_S
    for p in procs:
        while p.is_alive() and time.monotonic() < deadline:
            _drain(results)             # a worker blocked on a full pipe exits once it is read
            p.join(0.02)
        if p.is_alive():
            p.terminate()
            p.join(_JOIN_S)
        if p.is_alive():
            p.kill()
            p.join()
    for conn in results:
        conn.close()
    tasks.close()


def _drain(results: list[Any]) -> None:
    for conn in results:
        try:
            while conn.poll():
                conn.recv()
        except (OSError, EOFError, pickle.UnpicklingError):   # a worker gone, or killed mid-write
            continue


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
        self._ring: _Ring | None = None
        self._pool: _Pool | None = None
        self._pass = 0

    def _start(self) -> tuple[_Ring, _Pool]:
        if self._ring is None:
            shape, dtype = self.spec
            rows = int(getattr(self.batch_sampler, "batch_size", None) or 1)
            self._ring = _Ring(self.ring_size, rows, shape, dtype)
        if self._pool is None:
            self._pool = _Pool(self.dataset, self._ring, self.workers, self.multiprocessing_context,
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

    def _free(self, ring: _Ring, pool: _Pool, exclude: int = -1) -> int | None:
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
        batches = itertools.islice(enumerate(iter(self.batch_sampler)), skip, None)   # (resumed: past those)
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

    def _receive(self, pool: _Pool, pass_id: int, ready: dict[int, tuple], pending: dict[int, int]) -> None:
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
