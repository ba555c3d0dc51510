"""What the planner knows of an op: conversions, static equivalents, whether it is proven to
take a tensor, and what it does to a sample's size.

Ops are read by their class's name only where the class comes from a library the planner
knows (torchvision, timm, dlstore): another library's ``Resize`` is an opaque callable.

The tensor-safe rule (docs/fidelity.md): an op that the user's pipeline gave a PIL image runs
on the store's uint8 tensor only when it is a random torchvision transform (v1 or v2: both are
documented to take (C, H, W) tensors) without a PIL-only argument, a dlstore op, or timm's
``RandomResizedCropAndInterpolation`` with one interpolation torchvision's tensor kernels have
(it calls torchvision's v1 functional kernels, which take tensors). Every other op there
(timm's auto-augmentations, ``Lambda``, any callable dlstore cannot see into, and the
deterministic ops that ImageFolder ran on PIL) gets a PIL image made from the sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import TransformSpecError
from .opening import is_torchvision, library, name_of, short_repr, unwrap, version
from .static import StaticSpec, from_torchvision

__all__ = ["combined_size_rule", "conversion", "float_replacement", "is_float_op", "is_torchvision", "library",
           "mutates_input", "name_of", "needs_pil", "scaling_replacement", "short_repr", "size_rule", "static_of",
           "tensor_safe", "unwrap", "version"]

# Conversions that turn a PIL image into the uint8 (C, H, W) tensor a store already holds:
# no-ops on a stored sample (ToNumpy gives the same as an array; timm's fast_collate takes both).
UINT8_CONVERSIONS = ("PILToTensor", "ToImage", "ToPureTensor", "MaybePILToTensor", "ToNumpy")
# Conversions to float in [0, 1] that divide by 255 (v1 ToTensor, v2's deprecated ToTensor, timm's
# MaybeToTensor): on a uint8 tensor, torchvision v1's ConvertImageDtype(float32) gives their bits.
SCALING_CONVERSIONS = ("ToTensor", "MaybeToTensor")
# Interpolations torchvision's tensor kernels lack (v1 also refuses lanczos on tensors).
PIL_ONLY_INTERPOLATIONS = {"v1": ("box", "hamming", "lanczos"), "v2": ("box", "hamming")}
# Random torchvision ops whose output size depends only on the input size (never on a draw):
# run per sample inside a batch, they keep the batch stackable.
_SHAPED_RANDOM = {
    "ColorJitter", "RandomGrayscale", "GaussianBlur", "GaussianNoise", "RandomErasing", "RandomInvert",
    "RandomPosterize", "RandomSolarize", "RandomAdjustSharpness", "RandomAutocontrast", "RandomEqualize",
    "RandomPhotometricDistort", "RandomChannelPermutation", "RandAugment", "AutoAugment",
    "TrivialAugmentWide", "AugMix", "RandomHorizontalFlip", "RandomVerticalFlip", "RandomAffine",
    "RandomPerspective", "ElasticTransform", "JPEG",
}
# timm's PIL augmentations that keep the image size (rotate, shear and translate keep the canvas).
_TIMM_SHAPED = {"RandAugment", "AutoAugment", "AugMixAugment", "AugmentOp"}
_FIXED = {"RandomCrop", "RandomResizedCrop", "CenterCrop", "RandomResizedCropAndInterpolation"}


# --- what each op is ------------------------------------------------------------------------

def conversion(t: Any) -> str:
    """What a conversion op does: ``"uint8"`` (PIL -> the uint8 tensor a store holds), ``"scale"``
    (PIL -> float / 255), ``"float"`` (timm's ToTensor: PIL -> float, unscaled), ``"pil"``
    (-> PIL image), or "" for any other op."""
    import torchvision.transforms as v1

    name = name_of(t)
    if name in UINT8_CONVERSIONS:
        return "uint8"
    if name == "ToTensor" and library(t) == "timm":
        return "float"
    if name in SCALING_CONVERSIONS or isinstance(t, v1.ToTensor):   # a subclass: PIL -> float as ToTensor
        return "scale"
    if name == "ToPILImage":
        return "pil"
    return ""


def scaling_replacement() -> Any:
    """What a dividing ToTensor does to a uint8 tensor, bit for bit: v1 ``ConvertImageDtype`` to the
    default float type (both compute ``x.to(float) / 255``; v2's ToDtype multiplies by 1/255 instead,
    one ulp away on 378 of 768 channel values)."""
    import torch
    import torchvision.transforms as v1

    return v1.ConvertImageDtype(torch.get_default_dtype())


def float_replacement(t: Any) -> Any:
    """timm's ``ToTensor(dtype)`` (``pil_to_tensor(img).to(dtype)``) on a uint8 tensor."""
    from torchvision.transforms import v2

    return v2.ToDtype(t.dtype, scale=False)


def static_of(t: Any) -> StaticSpec | None:
    """The static spec of a deterministic op with a static equivalent (torchvision's Resize,
    CenterCrop, Grayscale, Pad; dlstore's ResizeMax), else None."""
    if not (is_torchvision(t) or name_of(t) == "ResizeMax") or name_of(t) == "Compose":
        return None
    try:
        return from_torchvision(t)
    except TransformSpecError:
        return None


def _interpolations(t: Any) -> list[str]:
    value = getattr(t, "interpolation", None)
    values = value if isinstance(value, (list, tuple)) else [value]
    return [str(getattr(v, "value", v)) for v in values if v is not None]


def pil_only_argument(t: Any) -> str:
    """The PIL-only argument of a torchvision op ("interpolation=lanczos"), or ""."""
    bad = [m for m in _interpolations(t) if m in PIL_ONLY_INTERPOLATIONS.get(version(t), ())]
    return f"interpolation={bad[0]}" if bad else ""


def tensor_safe(t: Any) -> bool:
    """Whether ``t`` runs on the store's uint8 tensor although the pipeline gave it a PIL image
    (the rule in the module doc). Static ops are not: ImageFolder ran them on PIL, and so does
    the planner (a resize on a tensor is up to 1-3 levels off PIL's)."""
    import torch

    lib, name = library(t), name_of(t)
    if lib == "dlstore":     # its ops and the planner's wrappers take the uint8 tensor
        return True
    if lib == "timm":   # its crop on a tensor is torchvision's; 'random' and other modes stay on PIL
        return name == "RandomResizedCropAndInterpolation" and _interpolations(t) == ["bilinear"]
    if lib != "torchvision" or conversion(t) or name in ("Lambda", "LinearTransformation", "Compose"):
        return False
    if static_of(t) is not None or pil_only_argument(t):
        return False
    inner = getattr(t, "transforms", None)        # RandomApply / RandomChoice / RandomOrder
    if isinstance(inner, (list, tuple, torch.nn.ModuleList)):
        return all(tensor_safe(op) for op in inner)
    return True


def on_tensor(t: Any) -> Any:
    """What runs on the store's uint8 tensor for a tensor-safe op the pipeline gave a PIL image.

    The op itself, except torchvision's v1 ``RandomResizedCrop``: v2's with the same parameters
    (the same draws). Given PIL, the op resampled with PIL's antialiased filter; v2's uint8 kernel is
    closer to that than v1's float tensor kernel, and faster (docs/fidelity.md measures both). timm's
    crop keeps its own op: it draws from Python's ``random``, v2's from torch's generator."""
    if name_of(t) != "RandomResizedCrop" or library(t) != "torchvision" or version(t) == "v2":
        return t
    from torchvision.transforms import v2

    return v2.RandomResizedCrop(list(t.size), scale=tuple(t.scale), ratio=tuple(t.ratio),
                                interpolation=t.interpolation, antialias=t.antialias)


def needs_pil(t: Any) -> bool:
    """Whether ``t`` is known to need a PIL image: timm's auto-augmentations (PIL's ImageOps and
    enhancers) and its crop with a mode kept on PIL, a torchvision op given a PIL-only argument."""
    lib, name = library(t), name_of(t)
    if lib == "timm":
        return type(t).__module__.startswith("timm.data.auto_augment") or name == "RandomResizedCropAndInterpolation" \
            and not tensor_safe(t)
    return lib == "torchvision" and bool(pil_only_argument(t))


def mutates_input(t: Any) -> bool:
    """timm's RandomErasing writes into the tensor it is given."""
    return library(t) == "timm" and name_of(t) == "RandomErasing"


def size_rule(t: Any) -> str | None:
    """What ``t`` does to a sample's (H, W): ``"fixed"`` (one output size for every input),
    ``"shaped"`` (a function of the input size alone, never of a draw), or None (unknown, or drawn)."""
    lib, name = library(t), name_of(t)
    if lib == "dlstore":
        rule = getattr(t, "size_rule", None)
        if callable(rule):
            return rule()
        if name == "BatchCompose":
            return combined_size_rule(t.transforms)
        return "fixed" if name in ("BatchRandomCrop", "BatchRandomResizedCrop") else "shaped"
    if lib == "timm":
        if name == "RandomResizedCropAndInterpolation":
            return "fixed"
        return "shaped" if name in _TIMM_SHAPED or name == "RandomErasing" or conversion(t) else None
    if lib != "torchvision":
        return None
    if name in _FIXED or name == "Resize" and isinstance(t.size, (list, tuple)) and len(t.size) == 2:
        return "fixed"
    if name == "RandomRotation":
        return None if getattr(t, "expand", False) else "shaped"
    if name in _SHAPED_RANDOM or static_of(t) is not None or conversion(t) in ("uint8", "scale", "float"):
        return "shaped"
    if name in ("ToDtype", "ConvertImageDtype", "Normalize"):
        return "shaped"
    return None


def combined_size_rule(ops: Sequence[Any]) -> str | None:
    """``size_rule`` of ops run in order."""
    result = "shaped"
    for op in ops:
        rule = size_rule(op)
        if rule is None:
            return None
        if rule == "fixed":
            result = "fixed"
    return result


def is_float_op(t: Any) -> bool:
    """Whether ``t`` starts the float tail of a pipeline: a float ``ToDtype`` / ``ConvertImageDtype``,
    a scaling ``ToTensor`` or a ``Normalize`` (which only takes float input)."""
    name = name_of(t)
    if name == "Normalize" or conversion(t) in ("scale", "float"):
        return True
    if name in ("ToDtype", "ConvertImageDtype"):
        dtype = getattr(t, "dtype", None)
        return getattr(dtype, "is_floating_point", False) is True
    return False
