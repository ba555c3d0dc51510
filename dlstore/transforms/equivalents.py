"""Each torchvision op's batch equivalent, and the per-batch plan of a pipeline's dynamic part:
which ops run per sample and which run once per batch with independent draws per sample."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .batch import (
    BatchNormalize,
    BatchRandomCrop,
    BatchRandomHorizontalFlip,
    BatchRandomResizedCrop,
    BatchTransform,
)
from .static import _TO_TENSOR_NAMES


def batch_equivalent(t: Any) -> BatchTransform | None:
    """The batch transform doing what torchvision transform ``t`` does per sample, or None."""
    import torch

    name = type(t).__name__
    if name == "RandomCrop":
        fill = getattr(t, "fill", 0)
        per_channel = isinstance(fill, (list, tuple)) and len(fill) > 0 \
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in fill)
        if not (per_channel or (isinstance(fill, (int, float)) and not isinstance(fill, bool))):
            return None   # a dict of fills per input type, or None
        padding: Any = t.padding if t.padding is not None else 0
        if ".v2." in type(t).__module__ and isinstance(padding, list) and len(padding) == 4:
            # v2 keeps padding parsed as torch.nn.functional.pad's [left, right, top, bottom]
            padding = [padding[0], padding[2], padding[1], padding[3]]
        if per_channel and len(fill) > 1 and t.padding_mode != "constant":
            return None   # torchvision refuses this combination (when it has to pad): let it say so
        return BatchRandomCrop(list(t.size), padding=padding, pad_if_needed=bool(getattr(t, "pad_if_needed", False)),
                               fill=fill, padding_mode=t.padding_mode)
    if name == "RandomHorizontalFlip":
        return BatchRandomHorizontalFlip(t.p)
    if name == "RandomResizedCrop":
        interpolation = getattr(t.interpolation, "value", t.interpolation)
        if interpolation != "bilinear":
            return None
        return BatchRandomResizedCrop(list(t.size), t.scale, t.ratio, antialias=bool(t.antialias))
    if name == "ToDtype":
        dtype = t.dtype
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            return BatchNormalize(dtype=dtype, scale=bool(t.scale))
        return None
    if name == "Normalize" and not getattr(t, "inplace", False):
        return BatchNormalize(list(t.mean), list(t.std), dtype=None, scale=False)
    return None


def batch_plan(ops: Sequence[Any], *, fixed_shape: bool) -> tuple[list[Any], list[BatchTransform]]:
    """Split dynamic ``ops`` into a per-sample head and a per-batch tail.

    The tail is the longest run of trailing ops with a batch equivalent (an op
    without one must run per sample, and so must everything before it, to keep
    the order). On a variable-shape store samples can only be stacked once
    they share a size, so the head also takes every op up to and including the
    first one that fixes the size (RandomCrop, RandomResizedCrop). A ``ToDtype``
    followed by ``Normalize`` becomes one ``BatchNormalize``.

    Returns:
        (per-sample torchvision ops, batch transforms).
    """
    ops = [t for t in ops if type(t).__name__ not in _TO_TENSOR_NAMES]
    mapped = [batch_equivalent(t) for t in ops]
    cut = len(ops)
    while cut > 0 and mapped[cut - 1] is not None:
        cut -= 1
    if not fixed_shape:
        sized = [k for k in range(cut, len(ops)) if isinstance(mapped[k], (BatchRandomCrop, BatchRandomResizedCrop))]
        if sized:
            cut = sized[0] + 1
    head, tail = list(ops[:cut]), [m for m in mapped[cut:] if m is not None]
    return head, _merge_normalize(tail)


def batch_steps(ops: Sequence[Any]) -> list[Any]:
    """Each dynamic op as its batch equivalent where it has one, else the op itself, in order.

    For a loader whose samples already share a shape and sit in one tensor (the
    GPU loader): an op without a batch equivalent runs per sample at its place in
    the sequence, the others per batch. A ``ToDtype`` followed by ``Normalize``
    becomes one ``BatchNormalize``.
    """
    ops = [t for t in ops if type(t).__name__ not in _TO_TENSOR_NAMES]
    steps: list[Any] = []
    for t in ops:
        m = batch_equivalent(t)
        if m is not None and steps and isinstance(steps[-1], BatchTransform):
            steps[-1:] = _merge_normalize([steps[-1], m])
        else:
            steps.append(t if m is None else m)
    return steps


def _merge_normalize(ops: list[BatchTransform]) -> list[BatchTransform]:
    """``BatchNormalize(dtype, scale)`` then ``BatchNormalize(mean, std)`` -> one ``BatchNormalize``."""
    merged: list[BatchTransform] = []
    for m in ops:
        prev = merged[-1] if merged else None
        if isinstance(m, BatchNormalize) and isinstance(prev, BatchNormalize) and prev.mean is None \
                and m.mean is not None and not m.scale:
            merged[-1] = BatchNormalize(m.mean, m.std, dtype=prev.dtype, scale=prev.scale)
        else:
            merged.append(m)
    return merged
