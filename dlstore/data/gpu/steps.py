"""The GPU loader's transform steps: the planner's batch steps placed around the dataset's conversion.

The transform a GPU loader takes is what ``open_dataset`` takes (a torchvision
pipeline, a :class:`HybridTransform`) or dlstore batch transforms, or any callable.
The planner (``transforms/planner.py``) turns it into batch steps; :func:`plan_steps`
places them on this dataset, for each gathered group of batches:

* ops that move or overwrite pixels (crop, flip, resized crop, cutout) and
  per-sample torchvision ops see what torchvision would see: the uint8 pixels.
  Where the dataset holds its data converted (fp16, maybe normalised) the
  moving ops run on those values with their fill values mapped through the same
  conversion, so that padding is black in pixel space exactly as in
  torchvision; per-sample torchvision ops cannot run there and are refused;
* the dataset's conversion (uint8 -> ``dtype``, normalised) runs after the
  pixel ops where the data are held as uint8 (``dtype=torch.uint8``,
  ``on_overflow="uint8"`` or ``"stream"``), or before the first step that needs
  converted values (a ``BatchNormalize``, a plain callable).

The result is torchvision's per sample followed by the conversion, exactly
(fp16: torchvision's float32 values rounded once), except a resized crop on
data held converted: it resamples the converted values rather than uint8
pixels, within 1.05 / (255 * std) + 2**-10 * |value| of torchvision's
(tests/fidelity holds every path to this).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from ...errors import ArgumentError, TransformSpecError
from ...transforms.batch import (
    BatchCutout,
    BatchNormalize,
    BatchRandomCrop,
    BatchRandomHorizontalFlip,
    BatchRandomResizedCrop,
    BatchTransform,
)
from ...transforms.planner import PerSample, Plan, accepts_generator, plan
from .fused import FusedGather
from .resident import Resident

# Batch transforms that move or overwrite pixels: in torchvision they run on uint8 samples.
_PIXEL_OPS = (BatchRandomCrop, BatchRandomHorizontalFlip, BatchRandomResizedCrop, BatchCutout)

Steps = list[tuple[Callable[..., torch.Tensor], bool]]


def against_store(transform: Any, ds: Resident, *, static_mismatch: str = "error") -> Plan:
    """The planner's plan of ``transform`` on ``ds``'s store, checked as ``open_dataset`` checks it
    (a source that is not a store has no static spec to check against)."""
    manifest = getattr(ds.source, "manifest", None)
    if manifest is None:
        return plan(transform)
    where = getattr(ds.source, "path", None) or "the GPUDataset's store"
    return plan(transform, manifest.get("static") or [], where=where, static_mismatch=static_mismatch)


def _served_fill(op: BatchTransform, ds: Resident) -> BatchTransform:
    """``op`` with its fill values mapped from pixel values to the dataset's served values."""
    from torchvision.transforms.v2 import functional as F

    c = ds.shape[0]
    fill = list(op.fill) if isinstance(op.fill, tuple) else op.fill   # type: ignore[attr-defined]
    if isinstance(op, BatchRandomCrop):
        if op.padding_mode != "constant":
            return op
        # the value torchvision pads a uint8 image with
        pixel = F.pad(torch.zeros((c, 1, 1), dtype=torch.uint8), [1, 0, 0, 0], fill=fill)[:, 0, 0]
    else:
        # the value F.erase / masked_fill write into a uint8 image
        pixel = torch.tensor(fill).to(torch.uint8).expand(c).clone()
    served = ds.conversion(pixel.view(1, c, 1, 1).to(ds.device)).view(c).tolist()
    mapped = copy.copy(op)
    mapped.fill = tuple(served)  # type: ignore[attr-defined]
    return mapped


def plan_steps(steps: list[Any], ds: Resident) -> Steps:
    """The steps a gathered group goes through: (callable, whether it takes ``generator=``).

    ``steps``: the planner's batch steps (``Plan.steps``). Includes the dataset's
    conversion (``ds.conversion``: uint8 -> its dtype, normalised) at its place.
    """
    converts = ds.dtype != torch.uint8
    converted = converts and ds.mode == "preload"  # the data are held converted
    as_given = False   # an earlier step's output (not pixels) is what the following steps see
    out: Steps = []
    for op in steps:
        if isinstance(op, _PIXEL_OPS):
            if converted and not as_given and isinstance(op, (BatchRandomCrop, BatchCutout)):
                op = _served_fill(op, ds)
            out.append((op, True))
        elif isinstance(op, PerSample):
            if converted and not as_given:
                name = type(op.op).__name__
                raise TransformSpecError(
                    f"{name} has no batch equivalent, so it runs per sample on the pixels torchvision "
                    f"would give it, uint8; but this GPUDataset holds its data converted to "
                    f"{str(ds.dtype).removeprefix('torch.')}. Create it with dtype=torch.uint8 (and put "
                    f"v2.ToDtype / v2.Normalize at the end of the transform: they run per batch), or leave "
                    f"{name} out")
            out.append((op, True))
        else:
            if isinstance(op, BatchNormalize) and op.mean is not None and ds.normalize is not None:
                raise TransformSpecError(
                    f"the transform normalises ({op!r}) but the GPUDataset already does (normalize="
                    f"{ds.normalize!r}): leave Normalize out of the transform, or create the GPUDataset "
                    f"without normalize= (dtype=torch.uint8 runs the whole pipeline per batch)")
            if converts and not converted:
                out.append((ds.conversion, False))
                converted = True
            out.append((op, accepts_generator(op)))
            as_given = True
    if converts and not converted:
        out.append((ds.conversion, False))
    return out


def choose_gather(ds: Resident, steps: Steps, *, fused: bool | None, compile: bool,
                  channels_last: bool) -> tuple[FusedGather | None, str]:
    """(the fused gather, or None; why not, or "") for the loader's ``fused=`` (``loaders/resident.py``)."""
    if fused is None and not (compile and ds.device.type == "cuda"):
        # The eager fused gather (one element-wise index kernel) is slower than the
        # step-by-step path, whose crop copies whole windows; compiled, on CUDA, it
        # matches it (benchmarks/gpu_residency.py; figures in docs/gpu.md).
        return None, "fused=None fuses only with compile=True on CUDA (eager, the unfused path is faster)"
    if fused is False:
        return None, "fused=False"
    built = FusedGather.build(ds, steps, channels_last=channels_last, compile=compile)
    if isinstance(built, str):
        if fused:
            raise ArgumentError(f"fused=True, but this transform cannot run as one gather: {built}; "
                                f"pass fused=None (fuse where it applies) or fused=False")
        return None, built
    return built, ""
