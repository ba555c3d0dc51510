"""Each op's batch equivalent, and the per-batch plan of a pipeline's dynamic part: which ops run
per sample before the batch is stacked, and which run on the batch (once, with independent draws
per sample; an op without a batch equivalent that keeps the batch stackable runs per sample
inside it, ``wrappers.PerSample``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .batch import (
    BatchNormalize,
    BatchRandomCrop,
    BatchRandomHorizontalFlip,
    BatchRandomResizedCrop,
    BatchTransform,
)
from .recognise import conversion, library, mutates_input, name_of, size_rule, version
from .wrappers import PerSample, WholeBatch


def batch_equivalent(t: Any) -> BatchTransform | None:
    """The batch transform doing what op ``t`` does per sample (exactly, on uint8 input), or None.

    torchvision v1 and v2 ops map alike, each to its own arithmetic: v1 ``ConvertImageDtype``
    divides by 255 as v1 does (v2's ``ToDtype`` multiplies by 1/255); v1 ``RandomResizedCrop``
    resamples with v1's tensor kernel. timm's ``RandomResizedCropAndInterpolation`` with
    bilinear interpolation draws as torchvision does and calls v1's kernel.
    """
    import torch

    lib, name = library(t), name_of(t)
    if lib == "timm":
        if name == "RandomResizedCropAndInterpolation" and getattr(t.interpolation, "value", None) == "bilinear":
            return BatchRandomResizedCrop(list(t.size), t.scale, t.ratio, antialias=True, kernel="v1")
        return None
    if lib != "torchvision":
        return None
    if name == "RandomCrop":
        return _random_crop(t)
    if name == "RandomHorizontalFlip":
        return BatchRandomHorizontalFlip(t.p)
    if name == "RandomResizedCrop":
        interpolation = getattr(t.interpolation, "value", t.interpolation)
        if interpolation != "bilinear":
            return None
        antialias = True if t.antialias is None else bool(t.antialias)
        return BatchRandomResizedCrop(list(t.size), t.scale, t.ratio, antialias=antialias, kernel=version(t))
    if name in ("ToDtype", "ConvertImageDtype"):
        dtype = t.dtype
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            return None
        if name == "ConvertImageDtype" and version(t) == "v1":   # x.to(dtype) / 255, in that dtype
            return BatchNormalize(dtype=dtype, scale=True, divide=True) if dtype == torch.float32 else None
        return BatchNormalize(dtype=dtype, scale=bool(getattr(t, "scale", True)))
    if name == "Normalize" and not getattr(t, "inplace", False):
        return BatchNormalize([float(m) for m in t.mean], [float(s) for s in t.std], dtype=None, scale=False)
    return None


def _random_crop(t: Any) -> BatchRandomCrop | None:
    return random_crop_op(t, getattr(t, "fill", 0))


def random_crop_op(t: Any, fill: Any) -> BatchRandomCrop | None:
    """The batch equivalent of the RandomCrop ``t`` padding with ``fill`` (a segmentation plan gives
    the image's fill of ``t``'s per-type fills), or None where torchvision must run it."""
    per_channel = isinstance(fill, (list, tuple)) and len(fill) > 0 \
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in fill)
    if not (per_channel or (isinstance(fill, (int, float)) and not isinstance(fill, bool))):
        return None   # a dict of fills per input type, or None
    padding: Any = t.padding if t.padding is not None else 0
    if version(t) == "v2" and isinstance(padding, list) and len(padding) == 4:
        # v2 keeps padding parsed as torch.nn.functional.pad's [left, right, top, bottom]
        padding = [padding[0], padding[2], padding[1], padding[3]]
    if per_channel and len(fill) > 1 and t.padding_mode != "constant":
        return None   # torchvision refuses this combination (when it has to pad): let it say so
    if version(t) == "v1" and t.pad_if_needed and padding and t.padding_mode in ("reflect", "symmetric"):
        return None   # v1 pads twice (padding, then pad_if_needed), reflecting the first padding: per sample
    return BatchRandomCrop(list(t.size), padding=padding, pad_if_needed=bool(getattr(t, "pad_if_needed", False)),
                           fill=fill, padding_mode=t.padding_mode)


def batch_step(t: Any) -> Any:
    """``t`` as a step on a stacked batch, or None where it may not keep the batch stackable: its
    batch equivalent; a dlstore batch transform as given; timm's RandomErasing (which takes a batch
    itself) once; another op whose output size follows from its input's, per sample."""
    mapped = batch_equivalent(t)
    if mapped is not None:
        return mapped
    if isinstance(t, BatchTransform):
        return t
    if mutates_input(t) and int(getattr(t, "num_splits", 0) or 0) <= 1:
        return WholeBatch(t)
    if size_rule(t) is not None:
        return PerSample(t)
    return None


def batch_plan(ops: Sequence[Any], *, fixed_shape: bool) -> tuple[list[Any], list[Any]]:
    """Split dynamic ``ops`` into a per-sample head and a batch tail.

    The tail is the longest run of trailing ops that have a batch step (``batch_step``: a batch
    equivalent, or per sample inside the batch for ops that keep it stackable); the head, every op
    before it, runs per sample before the batch is stacked (an op that may change sizes at random,
    or a callable dlstore cannot see into, must run there, and so must everything before it, to keep
    the order). On a variable-shape store samples can only be stacked once they share a size, so
    the head also takes every op up to and including the first one that fixes the size
    (RandomCrop, RandomResizedCrop, CenterCrop ...). A ``ToDtype`` followed by ``Normalize``
    becomes one ``BatchNormalize``. The tail's per-sample steps draw from the generator the batch
    is given (``wrappers.PerSample``); the head's ops from torch's global one.

    Returns:
        (per-sample ops, batch steps).
    """
    ops = [t for t in ops if conversion(t) != "uint8"]
    cut = len(ops)
    while cut > 0 and batch_step(ops[cut - 1]) is not None:
        cut -= 1
    if not fixed_shape:
        fixed = [k for k in range(cut, len(ops)) if size_rule(ops[k]) == "fixed"]
        cut = fixed[0] + 1 if fixed else len(ops)
    return list(ops[:cut]), batch_steps(ops[cut:], wrap=batch_step)


def batch_steps(ops: Sequence[Any], *, wrap: Callable[[Any], Any] | None = None) -> list[Any]:
    """Each dynamic op as its batch equivalent where it has one, else ``wrap(op)`` (the op itself
    without ``wrap``), in order.

    For a loader whose samples already share a shape and sit in one tensor (the
    GPU loader, the device stage): an op without a batch equivalent runs per sample at its
    place in the sequence, the others per batch. A ``ToDtype`` followed by ``Normalize``
    becomes one ``BatchNormalize``.
    """
    ops = [t for t in ops if conversion(t) != "uint8"]
    steps: list[Any] = []
    for t in ops:
        m = batch_equivalent(t)
        if m is not None and steps and isinstance(steps[-1], BatchTransform):
            steps[-1:] = _merge_normalize([steps[-1], m])
        else:
            steps.append(m if m is not None else wrap(t) if wrap is not None else t)
    return steps


def _merge_normalize(ops: list[BatchTransform]) -> list[BatchTransform]:
    """``BatchNormalize(dtype, scale)`` then ``BatchNormalize(mean, std)`` -> one ``BatchNormalize``."""
    merged: list[BatchTransform] = []
    for m in ops:
        prev = merged[-1] if merged else None
        if isinstance(m, BatchNormalize) and isinstance(prev, BatchNormalize) and prev.mean is None \
                and m.mean is not None and not m.scale:
            merged[-1] = BatchNormalize(m.mean, m.std, dtype=prev.dtype, scale=prev.scale, divide=prev.divide)
        else:
            merged.append(m)
    return merged
