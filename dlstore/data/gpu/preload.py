"""The preload's reading side: chunks read ahead on several threads into a ring of host buffers.

::

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
from typing import Any


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
