"""A segmentation store held by a GPUDataset: each batch's images and masks augmented together there.

The device holds the records as stored (uint8: the image's channels, then the mask's planes;
``formats.fields``). Per batch, on the device: the plan's joint ops on the images and the mask
planes with the same draws (``data.joint_path.joint_op``), the image-only ops of its tail, then the
dataset's conversion (``dtype``, ``normalize``) of the images, unless the tail made them float
already (they are then cast to ``dtype``). The masks stay integers.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import ArgumentError
from ...formats.fields import join_planes
from ...transforms.joint import plan_joint
from ...transforms.planner import accepts_generator
from ..joint_path import joint_op


def check_joint_options(where: Any, *, padding: Any, shard: bool) -> None:
    """ArgumentError naming what a GPUDataset of a segmentation store cannot do yet."""
    if any(padding):
        raise ArgumentError(f"{where}: padding= holds the images padded with their fill, and the masks of a "
                            "segmentation store need their own; leave padding out (RandomCrop(padding=...) pads "
                            "each batch, with a fill per type)")
    if shard:
        raise ArgumentError(f"{where}: shard=True with a segmentation store is not supported yet; hold the whole "
                            "store on each rank and pass a DistributedSampler to dlstore.loader")


class JointDeviceStep:
    """``step(records, generator) -> (images, masks)`` of a GPUDataset holding a segmentation store."""

    def __init__(self, ds: Any, transform: Any):
        where = getattr(ds.source, "path", "the GPUDataset's store")
        manifest = getattr(ds.source, "manifest", {})
        self.plan = plan_joint(transform, manifest.get("static") or [], where=where,
                               static_mismatch=ds.static_mismatch)
        self.fields, self.conversion, self.dtype = ds.fields, ds.conversion, ds.dtype
        self.tail = [(step, accepts_generator(step)) for step in self.plan.tail.steps()]
        if ds.normalize is not None and any(_converts(step) for step, _ in self.tail):
            raise ArgumentError(f"{where}: the transform converts the images to float itself (ToDtype), and "
                                "normalize= would normalise them again; give one of them")

    def __call__(self, records: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.fields.channels
        images, planes = records[:, :c], records[:, c:]
        for op in self.plan.head:
            images, planes = joint_op(op, images, planes, generator, self.fields)
        for step, takes_generator in self.tail:
            images = step(images, generator=generator) if takes_generator else step(images)
        images = self.conversion(images.contiguous()) if images.dtype == torch.uint8 else images.to(self.dtype)
        return images, join_planes(planes, self.fields.mask_dtype)


def _converts(step: Any) -> bool:
    """Whether a batch step makes float images (a BatchNormalize that converts the dtype)."""
    return getattr(step, "dtype", None) is not None
