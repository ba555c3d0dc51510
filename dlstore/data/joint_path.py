"""How a segmentation store's ``get_batch`` builds a batch of images and masks (``transforms.joint``).

::

    gather      one pass over the records: a leading RandomCrop (constant padding) and flip run
                inside it, the image's channels and the mask's planes each cropped by the kernel
                with its own fill (the mask's planes lie ``C*H*W`` bytes after the image's, so
                the same window of the same record); without them, the records as stored
    joint ops   the rest of the head, each drawn once and applied to both (the mask padded with
                its fill, resampled nearest by RandomResizedCrop as v2's Mask kernel does)
    image ops   the tail, per sample then per batch, on the images only

Draws happen in the pipeline's order (crop, then flip, ...), fused or not, so a batch equals v2's
``(Image, Mask)`` pipeline run on each sample with the drawn parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import VariableShapeError
from ..formats.fields import RecordFields, join_planes
from ..transforms import compiled
from ..transforms.batch import (
    BatchRandomCrop,
    BatchRandomHorizontalFlip,
    BatchRandomResizedCrop,
)
from ..transforms.functional import crop_flip_loop
from ..transforms.joint import JointCrop, JointPlan
from .batch_path import allocator, draw_crop_flip, stack
from .profiling_ranges import profiling_range


class JointBatchPath:
    """The stages of one segmentation dataset's batches (see the module doc).

    Args:
        reader: the store's reader (records of ``record_shape``).
        record_shape: (C + P, H, W) of every record, or None: a variable-shape store, whose samples
            ``ds[i]`` reads but which has no batches of its own (VariableShapeError).
        fields: how a record holds the image and the mask.
        joint: the planned pipeline.
        where: the store, named in errors.
    """

    decode_crop = None

    def __init__(self, reader: Any, record_shape: tuple[int, int, int] | None, fields: RecordFields, joint: JointPlan,
                 *, where: Any):
        self.reader = reader
        self.record_shape = record_shape
        self.fields = fields
        self.where = where
        head = list(joint.head)
        self.crop: BatchRandomCrop | None = None
        self.mask_fill = 0
        self.flip: BatchRandomHorizontalFlip | None = None
        if head and isinstance(head[0], JointCrop) and _fusable(head[0].crop):
            first = head.pop(0)
            self.crop, self.mask_fill = first.crop, first.mask_fill
        if head and isinstance(head[0], BatchRandomHorizontalFlip):
            self.flip = head.pop(0)
        self.joint_rest: list[Any] = head
        self.per_sample_ops, self.image_ops = joint.tail.split(fixed_shape=True)
        self.rest = self.joint_rest + self.image_ops

    @property
    def shape(self) -> tuple[int, int, int] | None:
        """(C, H, W) of the stored images (None: they vary)."""
        return self.fields.image_shape(self.record_shape)

    @property
    def fuses_crop_flip(self) -> bool:
        return self.crop is not None or self.flip is not None

    @property
    def python_ops(self) -> list[Any]:
        from ..transforms.wrappers import PerSample, WholeBatch

        return list(self.per_sample_ops) + [s.op for s in self.image_ops if isinstance(s, (PerSample, WholeBatch))]

    def out_shape(self, n: int) -> tuple[int, ...] | None:
        """The (n, C, H, W) uint8 images the gather writes, or None when a later joint op resizes them."""
        if self.joint_rest or self.shape is None:
            return None
        c, h, w = self.shape
        return (n, c, *(self.crop.size if self.crop is not None else (h, w)))

    def build(self, idx: np.ndarray, generator: torch.Generator | None, out: torch.Tensor | None) -> tuple[Any, Any]:
        """(images, masks) of samples ``idx`` (checked positions) through every stage."""
        if self.record_shape is None:
            raise VariableShapeError(
                f"{self.where}: its images vary in size, so they make no batch; convert with a size-fixing static "
                "op (resize=H,W or center_crop=...), which v2 applies to the image and its mask alike; "
                "ds[i] reads one sample")
        alloc = allocator(out)
        with profiling_range("dlstore.read"):
            images, planes = self._gather(idx, generator, alloc)
        with profiling_range("dlstore.host_transforms"):
            for op in self.joint_rest:
                images, planes = joint_op(op, images, planes, generator, self.fields)
            if self.per_sample_ops:
                done = [x for x in images]
                for op in self.per_sample_ops:
                    done = [op(x) for x in done]
                images = stack(done, self.where)
            for op in self.image_ops:
                images = op(images, generator)
        return images, join_planes(planes, self.fields.mask_dtype)

    def _gather(self, idx: np.ndarray, generator: torch.Generator | None,
                alloc: Callable[[tuple[int, ...]], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over the records: (images, mask planes), with the fused crop/flip (with neither, the
        compiled kernel still copies each field from the records where they lie, in one pass)."""
        c, h, w = self.shape
        p = self.fields.planes
        b = len(idx)
        if self.crop is None and self.flip is None and not compiled.available():
            records = self.reader.get_batch(idx)
            images = alloc((b, c, h, w))
            np.copyto(images.numpy(), records[:, :c])
            return images, torch.from_numpy(records[:, c:])
        crop = self.crop
        th, tw, padding, tops, lefts, flips = draw_crop_flip(crop, self.flip, (b, c, h, w), generator)
        images = alloc((b, c, th, tw))
        planes = [np.empty((b, 1, th, tw), dtype=np.uint8) for _ in range(p)]
        fills = [crop.fill if crop is not None else 0, *self.fields.mask_fill_planes(self.mask_fill)]
        outs = [images.numpy(), *planes]
        # (first channel, channels) of each kernel call: the image, then each mask plane
        spans = [(0, c)] + [(c + k, 1) for k in range(p)]
        located = self.reader.sample_addresses(idx) if compiled.available() else None
        if located is not None:
            addresses, _mapped = located     # the map stays open until the kernels return
            for (first, n), dst, fill in zip(spans, outs, fills):
                compiled.crop_flip_at(addresses + np.uintp(first * h * w), (n, h, w), dst, tops, lefts, flips,
                                      padding, int(fill))
        else:
            records = self.reader.get_many(idx.tolist())
            run = compiled.crop_flip if compiled.available() else crop_flip_loop
            for (first, n), dst, fill in zip(spans, outs, fills):
                run([r[first:first + n] for r in records], dst, tops, lefts, flips, padding, int(fill))
        mask_planes = planes[0] if p == 1 else np.concatenate(planes, axis=1)
        return images, torch.from_numpy(mask_planes)


def joint_op(op: Any, images: torch.Tensor, planes: torch.Tensor, generator: torch.Generator | None,
             fields: RecordFields) -> tuple[torch.Tensor, torch.Tensor]:
    """One joint op of a plan's head (``transforms.joint``) on a batch's images and mask planes, drawn
    once on their device: a RandomCrop padding each with its own fill, RandomResizedCrop resampling
    the masks nearest, a flip of both."""
    device = images.device
    if isinstance(op, JointCrop):
        params = op.crop.sample(images.shape, generator=generator, device=device)
        crop = op.crop
        fill = fields.mask_fill_planes(op.mask_fill)
        twin = BatchRandomCrop(list(crop.size), crop.padding, pad_if_needed=crop.pad_if_needed,
                               fill=fill[0] if len(fill) == 1 else tuple(fill), padding_mode=crop.padding_mode)
        return crop.apply(images, params), twin.apply(planes, params)
    params = op.sample(images.shape, generator=generator, device=device)
    if isinstance(op, BatchRandomResizedCrop):
        return op.apply(images, params), _resized_crop_masks(planes, params, op.size)
    return op.apply(images, params), op.apply(planes, params)


def _resized_crop_masks(planes: torch.Tensor, params: dict[str, Any], size: tuple[int, int]) -> torch.Tensor:
    """Each sample's mask planes cropped to its box and resized to ``size`` by v2's Mask kernel (nearest)."""
    from torchvision import tv_tensors
    from torchvision.transforms.v2 import functional as F

    boxes = zip(*(params[k].tolist() for k in ("top", "left", "height", "width")))
    done = [F.resized_crop(tv_tensors.Mask(planes[k]), t, left, h, w, list(size)).as_subclass(torch.Tensor)
            for k, (t, left, h, w) in enumerate(boxes)]
    return torch.stack(done) if done else planes.new_empty((0, planes.shape[1], *size))


def _fusable(crop: BatchRandomCrop) -> bool:
    """Whether the gather's kernel can run ``crop``: constant padding with one fill byte."""
    return crop.padding_mode == "constant" and isinstance(crop.fill, int) and 0 <= crop.fill <= 255

