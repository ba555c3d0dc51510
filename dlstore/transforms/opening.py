"""Opening up what was given as a transform: the flat list of ops inside a Compose, a preset
object holding its pipeline in ``.transforms``, or torchvision's ``ImageClassification``; and
the names of the libraries whose ops the planner reads by name (torchvision, timm, dlstore)."""

from __future__ import annotations

from typing import Any


def library(t: Any) -> str:
    """``"torchvision"``, ``"timm"``, ``"dlstore"`` or ``""``: where ``t``'s class comes from."""
    root = type(t).__module__.partition(".")[0]
    return root if root in ("torchvision", "timm", "dlstore") else ""


def is_torchvision(t: Any) -> bool:
    """Whether ``t`` is a torchvision transform (or Compose): the ops the planner reads by name."""
    return library(t) == "torchvision"


def name_of(t: Any) -> str:
    """The class name of a known library's op; "" for any other callable (never read by name)."""
    return type(t).__name__ if library(t) else ""


def version(t: Any) -> str:
    """``"v2"`` for torchvision.transforms.v2, ``"v1"`` for the rest of torchvision, else ""."""
    module = type(t).__module__
    return "v2" if module.startswith("torchvision.transforms.v2") else "v1" if is_torchvision(t) else ""


def short_repr(t: Any, limit: int = 100) -> str:
    """``repr(t)`` on one line, cut to ``limit`` characters (timm's RandAugment lists every op)."""
    text = " ".join(repr(t).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


# --- the pipeline inside what was given -----------------------------------------------------

def unwrap(transform: Any) -> tuple[list[Any], list[str]]:
    """``transform`` as a flat list of ops, and notes on what was opened up.

    Compose (v1, v2), ``nn.Sequential`` and lists are flattened; a preset object holding its
    pipeline in ``.transforms`` (torchvision's reference ``ClassificationPresetTrain/Eval``)
    is planned as that pipeline; torchvision's ``ImageClassification`` (``weights.transforms()``)
    as its resize, center crop, conversion and normalisation.
    """
    import torch

    if transform is None:
        return [], []
    if isinstance(transform, (list, tuple)):
        ops, notes = [], []
        for t in transform:
            more, why = unwrap(t)
            ops += more
            notes += why
        return ops, notes
    name = name_of(transform)
    if name == "Compose" and library(transform) == "torchvision" or name == "BatchCompose":
        return unwrap(list(transform.transforms))
    if name == "Pipeline" and library(transform) == "dlstore":     # a plan's ops, planned again
        return unwrap(list(transform.ops))
    if isinstance(transform, torch.nn.Sequential):
        return unwrap(list(transform))
    if name == "ImageClassification":
        return _image_classification(transform), [
            f"{type(transform).__name__} (weights.transforms()): planned as its Resize, CenterCrop, "
            f"PILToTensor, ConvertImageDtype and Normalize"]
    inner = _held_pipeline(transform)
    if inner is not None:
        ops, notes = unwrap(inner)
        return ops, [f"{type(transform).__name__}: planned as the pipeline it holds in .transforms"] + notes
    return [transform], []


def _held_pipeline(t: Any) -> Any:
    """The pipeline a preset-like object holds in ``.transforms`` (a torchvision Compose, an
    ``nn.Sequential`` or a list of callables), or None. Known libraries' own ops are not presets."""
    import torch

    if library(t) or not callable(t):
        return None
    inner = getattr(t, "transforms", None)
    if (name_of(inner) == "Compose" or isinstance(inner, torch.nn.Sequential)) and callable(inner):
        return inner
    if isinstance(inner, (list, tuple)) and inner and all(callable(op) for op in inner):
        return list(inner)
    return None


def _image_classification(t: Any) -> list[Any]:
    """torchvision's ``ImageClassification`` preset as the v1 ops its ``forward`` runs (on PIL input:
    F.resize, F.center_crop, F.pil_to_tensor, F.convert_image_dtype(float), F.normalize)."""
    import torch
    import torchvision.transforms as v1

    return [v1.Resize(list(t.resize_size), interpolation=t.interpolation, antialias=t.antialias),
            v1.CenterCrop(list(t.crop_size)), v1.PILToTensor(), v1.ConvertImageDtype(torch.float),
            v1.Normalize(list(t.mean), list(t.std))]
