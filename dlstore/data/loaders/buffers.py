"""The memory a loader builds batches in, reused once nothing the user holds reaches it.

A fresh allocation of a large batch (over glibc's 32 MiB mmap threshold, e.g.
256x3x224x224) is page-faulted and zeroed by the kernel on first touch, which costs
more than the copy that fills it; so a loader keeps a few buffers and hands each to
``get_batch(..., out=)`` again once it is free.

Free is decided by lifetime, not reference counts: each hand-out wraps the buffer in
a new numpy view and gives ``torch.from_numpy(view)``. The tensor's storage keeps that
view alive, and so does every tensor, view or ``.numpy()`` array made from it; the
pool keeps only a weak reference. Once nothing reaches the view, the buffer is free
(the shared-memory ring's slots work the same way: ``ring_slots.Ring``). When every
buffer is held (``list(loader)``), a new one is made and the pool never waits.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch


class BatchBuffers:
    """Up to ``keep`` reusable uint8 buffers; ``take(shape)`` gives a tensor over a free one.

    Args:
        keep: buffers kept for reuse (those in flight, the one the user holds, the one before it).
        pin: page-locked buffers (for ``pin_memory``; CUDA only).
    """

    def __init__(self, keep: int, *, pin: bool = False):
        self.keep = max(1, int(keep))
        self.pin = pin
        self._buffers: list[np.ndarray] = []
        self._held: list[weakref.ref | None] = []
        self._lock = threading.Lock()     # loader threads take buffers at once

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A uint8 tensor of ``shape`` over a buffer that nothing handed out before still reaches."""
        nbytes = int(np.prod(shape))
        with self._lock:
            for j, buf in enumerate(self._buffers):
                ref = self._held[j]
                if buf.nbytes >= nbytes and (ref is None or ref() is None):
                    return self._hand_out(j, shape, nbytes)
            buf = self._new(nbytes)
            if len(self._buffers) < self.keep:
                self._buffers.append(buf)
                self._held.append(None)
                return self._hand_out(len(self._buffers) - 1, shape, nbytes)
            # every kept buffer is held, or too small: replace the smallest free one, else make one apart
            free = [j for j, ref in enumerate(self._held) if ref is None or ref() is None]
            if free:
                j = min(free, key=lambda k: self._buffers[k].nbytes)
                self._buffers[j] = buf
                return self._hand_out(j, shape, nbytes)
        return torch.from_numpy(buf[:nbytes].reshape(shape))

    def _new(self, nbytes: int) -> np.ndarray:
        if self.pin:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        return np.empty(nbytes, dtype=np.uint8)

    def _hand_out(self, j: int, shape: tuple[int, ...], nbytes: int) -> torch.Tensor:
        view = self._buffers[j][:nbytes].reshape(shape)    # a new object per hand-out: its life is the batch's
        self._held[j] = weakref.ref(view)
        return torch.from_numpy(view)
