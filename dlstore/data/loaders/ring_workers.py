"""The worker side of a ``ShmRingLoader``: processes that build batches straight into the ring's slots.

Each worker takes ``(pass, k, slot, indices, seed)`` tasks from one queue (whoever is
free), builds batch k into slot j (the dataset's batch buffer *is* the slot, so the gather
writes shared memory directly) and reports ``(pass, k, slot, rows, labels, error)`` on a
pipe of its own. The pool starts, watches and stops them; a worker dies with the main
process (``dlstore.processes``), and runs torch on one intra-op thread (the processes are the
parallelism).
"""

from __future__ import annotations

import os
import pickle
import random
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as tmp

from ...errors import ArgumentError, WorkerError
from ...formats.readahead import batches_advised_ahead
from ...processes import Parent, TaskQueue, parent_spec
from .ring_slots import Ring

# Seconds the workers get to exit after being told to, before they are terminated.
_JOIN_S = 5.0


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - unpicklable state fails in many ways; type and message survive
        return RuntimeError(f"{type(exc).__name__}: {exc}")


# reported in place of the labels where a batch's targets were written into its target slot
IN_SLOT = b"dlstore: targets in their slot"


def _work(wid: int, dataset: Any, slots: list[Any], tasks: TaskQueue, results: Any, current: Any,
          worker_init_fn: Callable[[int], None] | None, parent_of: tuple[int | None, bool]) -> None:
    """A worker's loop: build each task's batch into its slot (``slots``: the ring's image slots and
    target slots, or None), report (pass, k, slot, rows, labels or ``IN_SLOT``);
    returns when told to, or when the main process is gone (see ``dlstore.processes``)."""
    parent = Parent(parent_of)
    if not parent.alive():
        return
    torch.set_num_threads(1)
    if dataset.advises_reads:   # the main process advises each batch ahead (shm_ring: threads.advised)
        batches_advised_ahead()
    try:
        if worker_init_fn is not None:
            worker_init_fn(wid)
        _serve(dataset, slots, tasks, results, current, parent)
    except KeyboardInterrupt:       # Ctrl-C reaches the whole process group: the main process raises it
        return
    except (BrokenPipeError, ConnectionResetError):     # a report to a main process that has gone
        return


def _serve(dataset: Any, slots: list[Any], tasks: TaskQueue, results: Any, current: Any, parent: Parent) -> None:
    """``slots``: (image slots, target slots or None)."""
    slots, target_slots = slots
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
            # also seed every accelerator's, a cost per batch for nothing)
            torch.default_generator.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed % (1 << 32))   # as DataLoader workers seed numpy (np.random augmentations)
            rows = len(indices)
            out = slot[:rows] if dataset.batch_shape(rows) == (rows, *slot.shape[1:]) \
                and slot.dtype == torch.uint8 else None
            images, labels = dataset.get_batch(indices, generator=generator, out=out)
            if not isinstance(images, torch.Tensor) or tuple(images.shape) != (rows, *slot.shape[1:]) \
                    or images.dtype != slot.dtype:
                got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
                raise ArgumentError(
                    f"batch {k} is {got} {getattr(images, 'dtype', '')}, but the loader's shared-memory slots "
                    f"hold ({rows}, {', '.join(map(str, slot.shape[1:]))}) {slot.dtype} (the shape of sample 0's "
                    "batch): this pipeline's output shape varies; use dlstore.loader(..., backend='dataloader')")
            if images.data_ptr() != slot.data_ptr() or images.stride() != slot[:rows].stride():
                # another tensor, or a view of the slot in another layout (a transpose of square
                # images): copied through a contiguous copy, since the source may overlap the slot
                slot[:rows].copy_(images if images.data_ptr() != slot.data_ptr() else images.contiguous())
            del images
            target = None if target_slots is None else target_slots[j][:rows]
            if target is not None and isinstance(labels, torch.Tensor) and labels.shape == target.shape \
                    and labels.dtype == target.dtype:
                target.copy_(labels)             # a mask per sample: through shared memory, as the images
                labels = IN_SLOT
            elif isinstance(labels, torch.Tensor):
                labels = labels.numpy()          # plain bytes through the pipe, not a shared segment
            results.send((pass_id, k, j, rows, labels, None))
        except Exception as exc:  # noqa: BLE001 - reported with its batch; the main process raises it
            text = "".join(traceback.format_exception(exc))
            results.send((pass_id, k, j, 0, None, (_picklable(exc), text, [int(i) for i in indices])))


class WorkerPool:
    """Worker processes, the task queue and a result pipe per worker; stopped by ``stop`` (or when collected).

    The workers take tasks from one queue (whoever is free) and each reports on a pipe of
    its own: no lock and no feeder thread on the way back, and the main process waits on
    the pipes and the processes' sentinels at once, so a worker's death is seen at once.
    """

    def __init__(self, dataset: Any, ring: Ring, workers: int, context: Any,
                 worker_init_fn: Callable[[int], None] | None, timeout: float = 0):
        self.timeout = timeout
        ctx = context if not isinstance(context, (str, type(None))) else tmp.get_context(context)
        self.tasks = TaskQueue(ctx)
        pipes = [ctx.Pipe(duplex=False) for _ in range(workers)]
        self.results = [reader for reader, _ in pipes]
        self.current = ctx.Value("q", 0, lock=False)
        self.busy: set[int] = set()     # slots given a task (any pass) and not yet handed out or skipped
        self.ready: set[int] = set()    # of those, the ones reported: no worker writes them any more
        slots = (ring.slots, ring.target_slots)
        self.procs = [ctx.Process(target=_work, args=(w, dataset, slots, self.tasks, writer, self.current,
                                                      worker_init_fn, parent_spec(ctx)),
                                  daemon=True, name=f"dlstore-loader-{w}")
                      for w, (_, writer) in enumerate(pipes)]
        self._finalizer = weakref.finalize(self, _stop, os.getpid(), self.procs, self.tasks, self.results)
        for p in self.procs:
            p.start()
        for _, writer in pipes:
            writer.close()              # the workers have theirs

    def get(self, waiting_for: list[int]) -> tuple:
        """The next report of any worker; WorkerError once a worker has exited (it may have died
        holding a task, or the task queue's lock, and the others would wait forever), or when none
        reported for ``timeout`` seconds (0: wait as long as it takes)."""
        sentinels = {p.sentinel: p for p in self.procs}
        while True:
            ready = wait([*self.results, *sentinels], timeout=self.timeout or None)
            if not ready:       # DataLoader's timeout: no worker reported for that long
                raise WorkerError(f"dlstore.loader: no batch from the worker processes in timeout={self.timeout} s "
                                  f"(waiting for batches {waiting_for})")
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


def _stop(owner: int, procs: list[Any], tasks: Any, results: list[Any]) -> None:
    """Tell the workers to exit, wait for them (reading what they still report), terminate stragglers.
    Only in the process that started them: a worker forked for a later loader inherits this
    finalizer, and collecting its copy of an unreachable pool there must not touch the pool."""
    if os.getpid() != owner:
        return
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


