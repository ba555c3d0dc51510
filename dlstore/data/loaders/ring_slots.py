"""The shared memory of a ``ShmRingLoader``: how much a ring takes, whether ``/dev/shm`` holds it,
the fixed batch shape it is sized for (``batch_spec``), and the slots themselves (``Ring``).

The slots are torch tensors in shared memory (``share_memory_``), made once per ring and
mapped by every worker; the loader hands out numpy views of them whose lifetime says
whether the user still holds a slot (see ``shm_ring``).
"""

from __future__ import annotations

import shutil
import weakref
from typing import Any, NamedTuple

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


class BatchSpec(NamedTuple):
    """What a ring's slots hold: one sample's images (shape, dtype) and, where each sample's target is
    an array of its own (a segmentation mask), the targets' (shape, dtype) too (else None: the targets
    go through the workers' pipes)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    target: tuple[tuple[int, ...], torch.dtype] | None = None


def ring_bytes(spec: BatchSpec, rows: int, prefetch: int, workers: int) -> int:
    """Shared memory a ShmRingLoader of ``prefetch`` batches in flight takes (its slots)."""
    return _slot_bytes(ring_size(max(prefetch, workers)), rows, spec)


def _slot_bytes(size: int, rows: int, spec: BatchSpec) -> int:
    parts = [(spec.shape, spec.dtype)] + ([spec.target] if spec.target is not None else [])
    return sum(size * rows * int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
               for shape, dtype in parts)


def shm_message(need: int, detail: str = "") -> str:
    free = shm_free()
    have = "unknown" if free is None else human_bytes(free)
    return (f"the loader's ring of batches needs {human_bytes(need)} of shared memory and {SHM} has {have} "
            f"free {detail}".rstrip() + "; in Docker raise it (docker run --shm-size=2g), or lower "
            "prefetch_factor / num_workers / batch_size, or read on threads (num_workers=0), or pass "
            "shm_ring=False (the DataLoader path, which also needs shared memory per batch)")


def batch_spec(dataset: Any) -> BatchSpec | None:
    """(shape of one sample, dtype) of ``dataset.get_batch``'s images, with its targets' where each is an
    array of two or more dimensions (a mask), or None when the images' shape is not fixed.

    None for a variable-shape store, an empty one, or a batch path that does not return a
    tensor. Reads sample 0 once, with its own generator; torch's global generator is left
    as it was.
    """
    fixed = getattr(dataset, "shape", None) is not None or getattr(dataset, "decode_crop", None) is not None
    if not fixed or len(dataset) == 0:      # (a decode-time crop fixes the size of a variable-shape store)
        return None
    with torch.random.fork_rng(devices=[]):
        images, targets = dataset.get_batch([0], generator=torch.Generator().manual_seed(0))
    if not isinstance(images, torch.Tensor) or images.dim() < 1 or images.shape[0] != 1 \
            or images.element_size() not in _SAME_SIZE:
        return None
    # a fixed crop gives every batch's masks one shape; a per-sample target stays in the pipe
    slotted = isinstance(targets, torch.Tensor) and targets.dim() >= 3 and targets.element_size() in _SAME_SIZE \
        and getattr(dataset, "fields", None) is not None
    return BatchSpec(tuple(images.shape[1:]), images.dtype,
                     (tuple(targets.shape[1:]), targets.dtype) if slotted else None)




class Ring:
    """The slots, in shared memory (the images', and the targets' where ``BatchSpec.target`` says),
    and weak references to the views each hand-out wraps: a slot is held while any is alive."""

    def __init__(self, size: int, rows: int, spec: BatchSpec):
        self.dtype = spec.dtype
        self.slots = self._make(size, rows, spec.shape, spec.dtype, spec)
        self.target_dtype = None if spec.target is None else spec.target[1]
        self.target_slots = None if spec.target is None else self._make(size, rows, *spec.target, spec)
        self.arrays = [_handle(s) for s in self.slots]
        self.target_arrays = None if self.target_slots is None else [_handle(s) for s in self.target_slots]
        self.held: list[list[weakref.ref]] = [[] for _ in range(size)]

    @staticmethod
    def _make(size: int, rows: int, shape: tuple[int, ...], dtype: torch.dtype, spec: BatchSpec) -> list[torch.Tensor]:
        try:
            return [torch.empty((rows, *shape), dtype=dtype).share_memory_() for _ in range(size)]
        except RuntimeError as exc:   # torch: "unable to allocate shared memory(shm) ... No space left"
            raise SharedMemoryError(shm_message(_slot_bytes(size, rows, spec), f"({exc})")) from None

    def is_held(self, j: int) -> bool:
        return any(ref() is not None for ref in self.held[j])

    def hand_out(self, j: int, rows: int) -> torch.Tensor:
        """Slot ``j``'s first ``rows`` rows as a tensor the ring tracks (held until it and its views are gone)."""
        self.held[j] = []
        return self._track(j, self.arrays[j][:rows], self.dtype)

    def hand_out_targets(self, j: int, rows: int) -> torch.Tensor:
        """Slot ``j``'s targets, tracked as ``hand_out``'s images are (call it after ``hand_out``)."""
        return self._track(j, self.target_arrays[j][:rows], self.target_dtype)

    def _track(self, j: int, view: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        self.held[j].append(weakref.ref(view))   # a new object per hand-out: its life is the batch's
        return torch.from_numpy(view).view(dtype)


def _handle(slot: torch.Tensor) -> np.ndarray:
    """A numpy view of a slot, whose lifetime says whether the user holds it (see the module doc)."""
    return slot.view(_SAME_SIZE[slot.element_size()]).numpy()
