"""The shared memory of a ``ShmRingLoader``: how much a ring takes, whether ``/dev/shm`` holds it,
the fixed batch shape it is sized for (``batch_spec``), and the slots themselves (``Ring``).

The slots are torch tensors in shared memory (``share_memory_``), made once per ring and
mapped by every worker; the loader hands out numpy views of them whose lifetime says
whether the user still holds a slot (see ``shm_ring``).
"""

from __future__ import annotations

import shutil
import weakref
from typing import Any

import numpy as np
import torch

from ...errors import SharedMemoryError
from ...units import human_bytes

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
    fixed = getattr(dataset, "shape", None) is not None or getattr(dataset, "decode_crop", None) is not None
    if not fixed or len(dataset) == 0:      # (a decode-time crop fixes the size of a variable-shape store)
        return None
    with torch.random.fork_rng(devices=[]):
        images, _ = dataset.get_batch([0], generator=torch.Generator().manual_seed(0))
    if not isinstance(images, torch.Tensor) or images.dim() < 1 or images.shape[0] != 1 \
            or images.element_size() not in _SAME_SIZE:
        return None
    return tuple(images.shape[1:]), images.dtype




class Ring:
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


