"""A GPUDataset's preload: the store read in chunks, ahead, on threads, then uploaded and converted.

Bounded host memory: a ring of PRELOAD_RING host buffers (one chunk each) on CUDA, 2 on CPU::

    reader threads                   main thread (CUDA: a side stream)
    ──────────────                   ───────────────────────────────────
    store ─read─▶ host chunk k+1..   host chunk k ─copy, non_blocking─▶ device uint8
    (pinned when the device is       ─to float32, /255, (x-mean)/std─▶ dtype
     CUDA; a buffer is refilled      ─▶ data[start:stop] of one preallocated tensor
     once its copy's event is done)  (─▶ its border, when the dataset holds padding)

The reading side, :class:`ChunkRing`::

    readers (threads)                      consumer (the main thread)
    ─────────────────                      ─────────────────────────────────────────────
    chunk k+1 ─read─▶ buffer (k+1) % R      get(): chunk k, in order
    chunk k+2 ─read─▶ buffer (k+2) % R      enqueue its copy (CUDA: async, side stream)
    ...                                     done(event): buffer k % R may be refilled once
    a reader first waits for its             ``event`` has completed; chunk k+R is submitted
    buffer's event (the copy out of it)

Store reads (``preadv``, numpy copies) release the GIL, so the readers run in
parallel with each other and with the consumer's copies; at most R chunks of
host memory exist at a time, pinned on CUDA, allocated once per preload.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from functools import partial
from typing import Any

import numpy as np
import torch

from ..._system import usable_cpus
from .padding import NO_PADDING, interior, pad_border
from .resident import Resident

# Pinned host buffers of the CUDA preload (chunk_size samples each), filled by PRELOAD_RING - 1
# reader threads while the consumer copies one out: bounded host memory, reads in parallel.
PRELOAD_RING = 4


class ChunkRing:
    """Runs ``read(bounds, slot)`` for each of ``bounds`` on ``readers`` threads, ``ring`` ahead at most.

    ``read`` fills the host buffer of ``slot`` (``0 <= slot < ring``; the chunk ``k`` uses
    slot ``k % ring``) and returns what the consumer needs. The consumer calls :meth:`get`
    for each chunk in order, then :meth:`done` once it has enqueued its use of the
    buffer, with an event (anything with ``synchronize()``) that completes when the
    buffer is free, or None if it is free already. :meth:`close` (always: use
    ``try/finally``) cancels what has not started and waits for what has.
    An exception in ``read`` is raised by :meth:`get`.
    """

    def __init__(self, bounds: list[tuple[int, int]], read: Callable[[tuple[int, int], int], Any], *,
                 ring: int, readers: int):
        self._bounds = bounds
        self._read = read
        self._ring = max(1, int(ring))
        self._events: list[Any] = [None] * self._ring
        self._pool = ThreadPoolExecutor(max(1, min(int(readers), self._ring)), thread_name_prefix="dlstore-prefetch")
        self._pending: deque[Future] = deque()
        self._submitted = 0
        self._taken = 0
        for _ in range(min(self._ring, len(bounds))):
            self._submit()

    def _submit(self) -> None:
        k = self._submitted
        self._submitted += 1
        slot = k % self._ring
        self._pending.append(self._pool.submit(self._job, self._bounds[k], slot, self._events[slot]))

    def _job(self, bounds: tuple[int, int], slot: int, event: Any) -> Any:
        if event is not None:
            event.synchronize()  # the copy out of this buffer has finished
        return self._read(bounds, slot)

    def get(self) -> Any:
        """The next chunk's result, in order (waits for its reader)."""
        self._taken += 1
        return self._pending.popleft().result()

    def done(self, event: Any = None) -> None:
        """The last chunk from :meth:`get` is in use until ``event`` completes; read ahead one more."""
        self._events[(self._taken - 1) % self._ring] = event
        if self._submitted < len(self._bounds):
            self._submit()

    def close(self) -> None:
        for future in self._pending:
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)


def preload(ds: Resident, *, chunk_size: int, block: int) -> None:
    """Fill ``ds.data`` (allocated, its dtype the storage) with ``ds.source``'s samples, converted
    by ``ds.conversion`` where the storage is not uint8 (``block`` samples at a time), in chunks
    of ``chunk_size`` samples; then write each chunk's held padding."""
    n = len(ds)
    bounds = [(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]
    side = None
    if ds.device.type == "cuda":
        side = torch.cuda.Stream(ds.device)
        # The side stream must see what the default stream did first (the data tensor,
        # mean and std uploaded from pageable memory).
        side.wait_stream(torch.cuda.current_stream(ds.device))
    workspace = None
    if ds.data.dtype != torch.uint8:
        with torch.cuda.stream(side) if side is not None else nullcontext():
            workspace = torch.empty((block, *ds.record_shape), dtype=torch.float32, device=ds.device)
    ring_size = PRELOAD_RING if side is not None else 2
    readers = min(ring_size, len(bounds))
    buffers: list[torch.Tensor | None] = [None] * ring_size
    threads = max(1, min(8, usable_cpus() // max(1, readers)))
    ring = ChunkRing(bounds, partial(_read_chunk, ds, chunk_size, buffers, threads), ring=ring_size,
                     readers=readers - 1 if side is not None and readers > 1 else readers)
    convert, fill = ds.conversion, ds.held_fill
    try:
        for _ in bounds:
            start, stop, host = ring.get()
            chunk = ds.data[start:stop]
            target = interior(chunk, ds.padding, ds.record_shape)
            if side is None:
                if host.data_ptr() != target.data_ptr():
                    convert.into(host, target, workspace)
                pad_border(chunk, ds.padding, ds.record_shape, ds.padding_mode, fill)
                ring.done()
                continue
            with torch.cuda.stream(side):
                if workspace is None:
                    target.copy_(host, non_blocking=True)
                else:
                    convert.into(host.to(ds.device, non_blocking=True), target, workspace)
                pad_border(chunk, ds.padding, ds.record_shape, ds.padding_mode, fill)
                copied = torch.cuda.Event()
                copied.record(side)
            # The host buffer goes back to a reader once its copy is done (the reader waits
            # for the event); meanwhile the other readers have been filling the next ones.
            ring.done(copied)
    finally:
        ring.close()
        if side is not None:  # also on error: nothing may still write into freed memory
            side.synchronize()
    if side is not None:
        torch.cuda.current_stream(ds.device).wait_stream(side)


def _read_chunk(ds: Resident, chunk_size: int, buffers: list[torch.Tensor | None], threads: int,
                bounds: tuple[int, int], slot: int) -> tuple[int, int, torch.Tensor]:
    """Read chunk ``bounds`` into host buffer ``slot`` (made on first use), or straight into place."""
    start, stop = bounds
    if ds.device.type == "cpu" and ds.data.dtype == torch.uint8 and ds.padding == NO_PADDING:
        buf = ds.data[start:stop]  # nothing to convert or upload: read straight into place
    else:
        if buffers[slot] is None:
            buffers[slot] = torch.empty((chunk_size, *ds.record_shape), dtype=torch.uint8, pin_memory=ds.pin)
        buf = buffers[slot][:stop - start]
    read_range = getattr(getattr(ds.source, "reader", None), "read_range", None)
    if read_range is not None:  # every raw dlstore reader: shards reads with preadv in threads
        read_range(start, stop, out=buf.numpy(), threads=threads)
        return start, stop, buf
    return start, stop, ds.read_into(np.arange(start, stop, dtype=np.int64), buf)
