"""How ``StoreDataset.get_batch`` builds a batch: chosen once, from the plan and the store.

::

    records out    (device decode)  the records and drawn boxes/flips (device_decode.py)
    decode crop    (encoded store, leading RandomResizedCrop)  decode + crop + flip per record
    gather         (fixed shape, no per-sample op)  one copy from the reader, with a leading
                   RandomCrop (constant padding) and flip fused into it
    per sample     the samples, each op per sample, stacked
    then           the batch ops left (``rest``), once per batch

The first stage writes into ``out`` when the loader hands one in and its shape is
``out_shape(n)``: the loader owns that memory (its thread buffers, ring slots, pinned
buffers). Kernels get arrays (``transforms.functional``, ``transforms.compiled``); the
reader is asked only for samples.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import TransformSpecError
from ..formats.encoding import DecodingReader
from ..transforms import compiled
from ..transforms.batch import BatchRandomCrop, BatchRandomHorizontalFlip, BatchTransform
from ..transforms.functional import VECTORISED_MAX_PIXELS, crop_flip_loop, crop_flip_windows
from ..transforms.planner import PerSample, WholeBatch
from .decode_crop import decode_crop_batch, split_decode_crop
from .device_decode import draw_encoded
from .profiling_ranges import profiling_range


class BatchPath:
    """The stages of one dataset's batches (see the module doc).

    Args:
        reader: the store's reader.
        shape: (C, H, W) of every stored sample, or None (variable shapes).
        per_sample_ops: ops run on each sample (no batch equivalent).
        batch_ops: batch transforms run once per batch, after them.
        reduced_decode: decode-time crops at a DCT scale (``open_dataset(reduced_decode=)``).
        where: the store, named in errors.
    """

    def __init__(self, reader: Any, shape: tuple[int, int, int] | None, per_sample_ops: list[Any],
                 batch_ops: list[BatchTransform], *, reduced_decode: bool, where: Any):
        self.reader = reader
        self.shape = shape
        self.where = where
        self.reduced_decode = reduced_decode
        decodes = isinstance(reader, DecodingReader)
        self.decode_crop, self.per_sample_ops, rest = split_decode_crop(decodes, per_sample_ops, list(batch_ops))
        self.crop: BatchRandomCrop | None = None
        self.flip: BatchRandomHorizontalFlip | None = None
        if shape is not None and not self.per_sample_ops and self.decode_crop is None:
            if rest and isinstance(rest[0], BatchRandomCrop) and rest[0].padding_mode == "constant" \
                    and isinstance(rest[0].fill, int) and 0 <= rest[0].fill <= 255:
                self.crop = rest.pop(0)
            if rest and isinstance(rest[0], BatchRandomHorizontalFlip):
                self.flip = rest.pop(0)
        if self.decode_crop is not None and rest and isinstance(rest[0], BatchRandomHorizontalFlip):
            self.flip = rest.pop(0)                  # flipped in the copy of each crop
        self.rest: list[Any] = rest
        self._local = threading.local()              # .scratch: crop_flip_windows's padded buffer, per thread

    @property
    def fuses_crop_flip(self) -> bool:
        """True when a leading RandomCrop / HorizontalFlip runs inside the gather's copy."""
        return self.decode_crop is None and (self.crop is not None or self.flip is not None)

    @property
    def python_ops(self) -> list[Any]:
        """The ops this path runs sample by sample in Python (per-sample ops, and those the planner
        wraps to run inside a batch step): they hold the GIL between small kernels."""
        inside = [step.op for step in self.rest if isinstance(step, (PerSample, WholeBatch))]
        return list(self.per_sample_ops) + inside

    @property
    def gathers(self) -> bool:
        """True when a batch is one gather from the reader (fixed shape, no per-sample op)."""
        return self.shape is not None and not self.per_sample_ops and self.decode_crop is None

    def out_shape(self, n: int) -> tuple[int, ...] | None:
        """The (n, C, H, W) uint8 batch the first stage writes (into ``out`` when given), or None
        when it is not known before the batch is read."""
        if self.decode_crop is not None:
            channels = self.shape[0] if self.shape is not None else None
            return None if channels is None else (n, channels, *self.decode_crop.size)
        if not self.gathers:
            return None
        c, h, w = self.shape  # type: ignore[misc]
        return (n, c, *(self.crop.size if self.crop is not None else (h, w)))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_local"]             # scratch memory is per process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def build(self, idx: np.ndarray, generator: torch.Generator | None, out: torch.Tensor | None, *,
              records: bool = False) -> Any:
        """Samples ``idx`` (checked positions) through every stage but the labels."""
        alloc = allocator(out)
        with profiling_range("dlstore.read"):
            if self.decode_crop is not None and records:     # decoded where the batch goes
                images = draw_encoded(self.reader, idx.tolist(), self.decode_crop, generator, self.flip)
            elif self.decode_crop is not None:               # decode + RandomResizedCrop, record by record
                images = decode_crop_batch(self.reader, idx.tolist(), self.decode_crop, generator, alloc,
                                           flip=self.flip, reduced=self.reduced_decode)
            elif self.gathers:                               # with the fused crop/flip, inside the one copy
                images = self._gather(idx, generator, alloc)
            else:
                images = self.read_for_ops(idx.tolist())
        if not self.gathers and self.decode_crop is None:
            with profiling_range("dlstore.host_transforms"):
                for op in self.per_sample_ops:
                    images = [op(x) for x in images]
                images = stack(images, self.where, out)
        with profiling_range("dlstore.host_transforms"):
            for op in self.rest:
                images = op(images, generator)
        return images

    def read_for_ops(self, idx: list[int]) -> list[torch.Tensor]:
        """Samples ``idx`` as tensors for per-sample ops. An encoded store's come as torchvision
        decodes them, (C, H, W) views of (H, W, C) memory, without a copy to contiguous."""
        read = self.reader.get_many_views if isinstance(self.reader, DecodingReader) else self.reader.get_many
        return [torch.from_numpy(a) for a in read(idx)]

    def _gather(self, idx: np.ndarray, generator: torch.Generator | None,
                alloc: Callable[[tuple[int, ...]], torch.Tensor]) -> torch.Tensor:
        """One copy from the store into the batch, with the fused crop/flip."""
        crop, flip = self.crop, self.flip
        shape: tuple[int, int, int] = self.shape  # type: ignore[assignment]   # fixed: this path gathers
        if crop is None and flip is None:
            out = alloc((len(idx), *shape))
            self.reader.get_batch(idx, out=out.numpy())
            return out
        b = len(idx)
        c, h, w = shape
        th, tw, padding, tops, lefts, flips = draw_crop_flip(crop, flip, (b, c, h, w), generator)
        fill = crop.fill if crop is not None else 0
        fast = compiled.available()
        if not fast and th * tw <= VECTORISED_MAX_PIXELS:
            plain, flipped = np.flatnonzero(~flips), np.flatnonzero(flips)
            read = self.reader.get_batch
            batch, self._local.scratch = crop_flip_windows(
                read(idx[plain]) if len(plain) else None, read(idx[flipped]) if len(flipped) else None,
                shape, (th, tw), tops, lefts, flips, padding, fill, getattr(self._local, "scratch", None))
            return batch
        out = alloc((b, c, th, tw))
        if not fast:
            crop_flip_loop(self.reader.get_many(idx.tolist()), out.numpy(), tops, lefts, flips, padding, fill)
            return out
        # one GIL-free call for the batch, reading the samples in place where the reader can say
        # where they are (their memory mapped until the kernel returns), else from get_many's arrays
        located = self.reader.sample_addresses(idx) if hasattr(self.reader, "sample_addresses") else None
        if located is not None:
            addresses, _mapped = located
            compiled.crop_flip_at(addresses, shape, out.numpy(), tops, lefts, flips, padding, fill)
        else:
            compiled.crop_flip(self.reader.get_many(idx.tolist()), out.numpy(), tops, lefts, flips, padding, fill)
        return out


def draw_crop_flip(crop: BatchRandomCrop | None, flip: BatchRandomHorizontalFlip | None, shape: tuple[int, ...],
                   generator: torch.Generator | None) -> tuple[int, int, Any, np.ndarray, np.ndarray, np.ndarray]:
    """(th, tw, padding, tops, lefts, flips) of a fused crop/flip on a batch of ``shape`` (B, C, H, W),
    drawn in the order ``BatchCompose([crop, flip])`` draws, so fused == unfused for one seed."""
    b, c, h, w = shape
    th, tw = crop.size if crop is not None else (h, w)
    padding = crop.padding_for(h, w) if crop is not None else (0, 0, 0, 0)
    if crop is not None:
        params = crop.sample((b, c, h, w), generator=generator)
        tops, lefts = params["top"].numpy(), params["left"].numpy()
    else:
        tops = lefts = np.zeros(b, dtype=np.int64)
    flips = flip.sample((b, c, th, tw), generator=generator)["flip"].numpy() if flip is not None \
        else np.zeros(b, dtype=bool)
    return th, tw, padding, tops, lefts, flips


def allocator(out: torch.Tensor | None) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """``out`` for a batch of its shape (the loader's memory), else a new uint8 tensor."""
    def alloc(shape: tuple[int, ...]) -> torch.Tensor:
        if out is not None and tuple(out.shape) == tuple(shape) and out.dtype == torch.uint8:
            return out
        return torch.empty(shape, dtype=torch.uint8)
    return alloc


def stack(samples: list[torch.Tensor], where: Any, out: torch.Tensor | None = None) -> torch.Tensor:
    """The samples as one batch (into ``out`` when it fits); TransformSpecError naming ``where`` when
    their shapes differ."""
    shapes = {tuple(x.shape) for x in samples}
    if len(shapes) > 1:
        raise TransformSpecError(
            f"{where}: cannot batch samples of different shapes {sorted(shapes)[:4]}; give the dynamic "
            f"part an op that fixes the size (RandomResizedCrop, RandomCrop, Resize to HxW), or convert "
            f"with a size-fixing static op (center_crop=...)")
    if out is not None and samples and tuple(out.shape) == (len(samples), *samples[0].shape) \
            and out.dtype == samples[0].dtype:
        return torch.stack(samples, out=out)
    return torch.stack(samples)
