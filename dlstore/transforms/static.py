"""Static transform specs: the deterministic ops paid once, at conversion.

A spec is a list of plain dicts, stored in every manifest::

    [{"op": "resize", "size": 256, "interpolation": "bilinear", "antialias": True, "max_size": None},
     {"op": "center_crop", "size": [224, 224]}]

``resize_max=N`` downscales so the longer side is at most N and never upscales
(FFCV's ``max_resolution``): it keeps large photos from being stored at full
decoded size when the training pipeline starts with a random crop.

It can be written three ways, all normalised to the same canonical list:

* the CLI string ``"resize=256,center_crop=224"`` (or a JSON list);
* a list of dicts (missing fields get torchvision's defaults);
* torchvision transforms (``v2.Compose([v2.Resize(256), v2.CenterCrop(224)])``,
  v1 transforms too).

``apply_static`` runs the ops with torchvision's own v2 kernels on the PIL image
that ``pil_loader`` returns, then converts to a uint8 CHW array exactly as
``v2.PILToTensor`` does; the stored sample is therefore bit-identical to
``v2.Compose([same ops, v2.PILToTensor()])(pil_loader(path))``.
``apply_static_any`` does the same on a uint8 (C, H, W) tensor (array and
tensor sources).

Random ops are refused: a random op in a static spec would freeze one random
draw into the data for ever, so every epoch would see the same "augmentation".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from ..errors import TransformSpecError
from .opening import unwrap

StaticSpec = list[dict[str, Any]]

INTERPOLATIONS = ("nearest", "nearest-exact", "bilinear", "bicubic", "box", "hamming", "lanczos")
PADDING_MODES = ("constant", "edge", "reflect", "symmetric")
STATIC_OPS = ("resize", "resize_max", "center_crop", "grayscale", "pad")

# Ops with no place in a static spec, with the reason shown to the user.
_RANDOM_HINT = (
    "is random: a static spec runs once at conversion, so it would freeze one random draw "
    "into the stored data and every epoch would see the same sample. Pass it as a dynamic "
    "transform at read time instead (open_dataset(path, transform=...))."
)
_FLOAT_HINT = (
    "produces float data: stores hold uint8 (4x smaller than float32). Convert and normalise "
    "at read time, on the device where possible."
)
# Transforms that are identities for our purpose: the store already holds a uint8 CHW tensor.
# MaybePILToTensor: timm's PILToTensor that passes tensors through (create_transform(use_prefetcher=True))
_TO_TENSOR_NAMES = ("PILToTensor", "ToImage", "ToPureTensor", "MaybePILToTensor")
_FLOAT_NAMES = ("ToTensor", "ToDtype", "ConvertImageDtype", "Normalize")


def size_pair(value: Any, op: str) -> list[int]:
    if isinstance(value, bool):
        raise TransformSpecError(f"{op}: size must be an int or [height, width], got {value!r}")
    if isinstance(value, int):
        value = [value, value]
    if not (isinstance(value, (list, tuple)) and len(value) in (1, 2)):
        raise TransformSpecError(f"{op}: size must be an int or [height, width], got {value!r}")
    pair = [int(v) for v in value] * (2 if len(value) == 1 else 1)
    if any(v <= 0 for v in pair):
        raise TransformSpecError(f"{op}: size must be positive, got {value!r}")
    return pair


def _interpolation(value: Any, op: str) -> str:
    value = getattr(value, "value", value)  # InterpolationMode
    if value not in INTERPOLATIONS:
        raise TransformSpecError(f"{op}: unknown interpolation {value!r}; valid: {', '.join(INTERPOLATIONS)}")
    return value


def _canonical_op(entry: Any) -> dict[str, Any]:
    """One op dict with every field present, validated, in JSON-able types."""
    if not isinstance(entry, dict) or "op" not in entry:
        raise TransformSpecError(f"each static op must be a dict with an 'op' key, got {entry!r}")
    op = entry["op"]
    fields = {k: v for k, v in entry.items() if k != "op"}

    def take(name: str, default: Any) -> Any:
        return fields.pop(name, default)

    if op == "resize":
        size = take("size", None)
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            canon_size: int | list[int] = size
        elif isinstance(size, (list, tuple)) and len(size) == 1:
            canon_size = size_pair(size, op)[0]
        else:
            canon_size = size_pair(size, op)
        interpolation = _interpolation(take("interpolation", "bilinear"), op)
        antialias = take("antialias", True)
        max_size = take("max_size", None)
        if antialias is None:
            antialias = True  # torchvision v2's default for PIL input
        out = {"op": op, "size": canon_size, "interpolation": interpolation,
               "antialias": bool(antialias), "max_size": None if max_size is None else int(max_size)}
    elif op == "resize_max":
        size = take("size", None)
        if isinstance(size, (list, tuple)) and len(size) == 1:
            size = size[0]
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise TransformSpecError(f"resize_max: size must be a positive int (the longer side), got {size!r}")
        antialias = take("antialias", True)
        out = {"op": op, "size": size, "interpolation": _interpolation(take("interpolation", "bilinear"), op),
               "antialias": True if antialias is None else bool(antialias)}
    elif op == "center_crop":
        out = {"op": op, "size": size_pair(take("size", None), op)}
    elif op == "grayscale":
        n = int(take("num_output_channels", 1))
        if n not in (1, 3):
            raise TransformSpecError(f"grayscale: num_output_channels must be 1 or 3, got {n}")
        out = {"op": op, "num_output_channels": n}
    elif op == "pad":
        padding = take("padding", None)
        if isinstance(padding, int) and not isinstance(padding, bool):
            padding = [padding] * 4
        elif isinstance(padding, (list, tuple)) and len(padding) == 2:
            padding = [padding[0], padding[1], padding[0], padding[1]]
        if not (isinstance(padding, (list, tuple)) and len(padding) == 4) or any(
            not isinstance(p, int) or p < 0 for p in padding
        ):
            raise TransformSpecError(
                f"pad: padding must be an int, [left/right, top/bottom] or "
                f"[left, top, right, bottom] of non-negative ints, got {padding!r}"
            )
        fill = take("fill", 0)
        if isinstance(fill, (list, tuple)):
            fill = [int(v) for v in fill]
        else:
            fill = int(fill)
        mode = take("padding_mode", "constant")
        if mode not in PADDING_MODES:
            raise TransformSpecError(f"pad: unknown padding_mode {mode!r}; valid: {', '.join(PADDING_MODES)}")
        out = {"op": op, "padding": [int(p) for p in padding], "fill": fill, "padding_mode": mode}
    else:
        raise TransformSpecError(f"unknown static op {op!r}; valid: {', '.join(STATIC_OPS)}")
    if fields:
        raise TransformSpecError(f"{op}: unknown field(s) {sorted(fields)}")
    return out


def from_torchvision(t: Any) -> StaticSpec:
    """Spec of one torchvision transform (v1 or v2), recursing into Compose."""
    name = type(t).__name__
    if name == "Compose":
        return [op for inner in t.transforms for op in from_torchvision(inner)]
    if name in _TO_TENSOR_NAMES:
        return []
    if name == "Resize":
        return [_canonical_op({"op": "resize", "size": t.size, "interpolation": t.interpolation,
                               "antialias": t.antialias, "max_size": t.max_size})]
    if name == "ResizeMax":
        return [_canonical_op({"op": "resize_max", "size": t.size, "interpolation": t.interpolation,
                               "antialias": t.antialias})]
    if name == "CenterCrop":
        return [_canonical_op({"op": "center_crop", "size": list(t.size)})]
    if name == "Grayscale":
        return [_canonical_op({"op": "grayscale", "num_output_channels": t.num_output_channels})]
    if name == "Pad":
        padding = t.padding
        return [_canonical_op({"op": "pad", "padding": padding if isinstance(padding, int) else list(padding),
                               "fill": t.fill, "padding_mode": t.padding_mode})]
    if is_random_transform(t):
        raise TransformSpecError(f"{name} {_RANDOM_HINT}")
    if name in _FLOAT_NAMES:
        raise TransformSpecError(f"{name} {_FLOAT_HINT}")
    raise TransformSpecError(
        f"{name} has no static equivalent; static ops: Resize, ResizeMax, CenterCrop, Grayscale, Pad "
        "(apply other ops at read time)"
    )


def is_random_transform(t: Any) -> bool:
    """True for torchvision transforms that draw random parameters."""
    name = type(t).__name__
    return name.startswith("Random") or name in {
        "ColorJitter", "AutoAugment", "RandAugment", "TrivialAugmentWide", "AugMix",
        "ElasticTransform", "GaussianBlur", "GaussianNoise", "CutMix", "MixUp", "JPEG",
        "ScaleJitter", "FiveCrop", "TenCrop",
    }


def _parse_string(text: str) -> list[dict[str, Any]]:
    """``"resize=256,center_crop=224"`` -> list of op dicts (or a JSON list)."""
    text = text.strip()
    if not text or text.lower() == "none":
        return []
    if text.startswith("["):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TransformSpecError(f"static spec is not valid JSON: {exc}") from exc
        if not isinstance(parsed, list):
            raise TransformSpecError("a JSON static spec must be a list of op dicts")
        return parsed
    ops = []
    for item in text.split(","):
        item = item.strip()
        name, _, value = item.partition("=")
        name = name.strip()
        parts = [p.strip() for p in value.split(":")] if value else []
        try:
            if name == "resize":
                if not parts:
                    raise ValueError
                op: dict[str, Any] = {"op": name, "size": _parse_size(parts[0], single_ok=True)}
                if len(parts) > 1:
                    op["interpolation"] = parts[1]
            elif name == "resize_max":
                op = {"op": name, "size": int(parts[0])}
                if len(parts) > 1:
                    op["interpolation"] = parts[1]
            elif name == "center_crop":
                op = {"op": name, "size": _parse_size(parts[0])}
            elif name == "grayscale":
                op = {"op": name, "num_output_channels": int(parts[0]) if parts else 1}
            elif name == "pad":
                op = {"op": name, "padding": int(parts[0])}
                if len(parts) > 1:
                    op["padding_mode"] = parts[1]
            else:
                raise TransformSpecError(
                    f"unknown static op {name!r} in {text!r}; valid: {', '.join(STATIC_OPS)} "
                    "(example: 'resize=256,center_crop=224')"
                )
        except TransformSpecError:
            raise
        except (ValueError, IndexError) as exc:
            raise TransformSpecError(
                f"cannot parse {item!r} in static spec {text!r}; examples: resize=256, resize=256x320, "
                "resize=256:bicubic, resize_max=512, center_crop=224, grayscale, grayscale=3, pad=4, pad=4:reflect"
            ) from exc
        ops.append(op)
    return ops


def _parse_size(text: str, single_ok: bool = False) -> int | list[int]:
    if "x" in text:
        h, w = text.split("x")
        return [int(h), int(w)]
    return int(text) if single_ok else [int(text), int(text)]


def parse_static(spec: Any) -> StaticSpec:
    """Normalise any accepted form of a static spec to its canonical list of dicts.

    Accepts ``None``, a CLI string, a list of dicts, a torchvision transform or ``Compose``
    (also inside a preset object's ``.transforms``, or torchvision's ``ImageClassification``),
    or an object with a ``static_spec`` attribute (a hybrid transform).

    Raises:
        TransformSpecError: unknown op, bad field, or a random / float op (for a whole
            pipeline, the message says to pass ``split_transforms(pipeline)``, its static part).
    """
    if spec is None:
        return []
    if hasattr(spec, "static_spec"):
        return parse_static(spec.static_spec)
    if isinstance(spec, str):
        spec = _parse_string(spec)
    if isinstance(spec, (list, tuple)) and all(isinstance(entry, dict) for entry in spec):
        return [_canonical_op(entry) for entry in spec]
    ops, _ = unwrap(spec)
    out: StaticSpec = []
    for entry in ops:
        try:
            out.extend(_canonical_op(entry) if isinstance(entry, dict) else from_torchvision(entry))
        except TransformSpecError as exc:
            if len(ops) == 1:
                raise
            raise TransformSpecError(
                f"{exc} To store the static part of a whole pipeline ({describe(out)} here), pass "
                f"static=dlstore.split_transforms(pipeline): its leading deterministic ops run at conversion, "
                f"the rest at read time") from exc
    return out


def output_shape(spec: StaticSpec) -> tuple[int, int, int] | None:
    """(C, H, W) every sample has after ``spec``, or None when it depends on the image."""
    channels, hw = 3, None
    for op in spec:
        if op["op"] == "resize":
            hw = tuple(op["size"]) if isinstance(op["size"], list) else None
        elif op["op"] == "resize_max":
            hw = None  # depends on each image's size
        elif op["op"] == "center_crop":
            hw = tuple(op["size"])
        elif op["op"] == "pad" and hw is not None:
            left, top, right, bottom = op["padding"]
            hw = (hw[0] + top + bottom, hw[1] + left + right)
        elif op["op"] == "grayscale":
            channels = op["num_output_channels"]
    return None if hw is None else (channels, hw[0], hw[1])


def describe(spec: StaticSpec) -> str:
    """Short human form: ``resize=256,center_crop=224x224`` (or ``none``)."""
    parts = []
    for op in spec:
        if op["op"] == "resize":
            size = op["size"]
            text = f"resize={size}" if isinstance(size, int) else f"resize={size[0]}x{size[1]}"
            if op["interpolation"] != "bilinear":
                text += f":{op['interpolation']}"
            parts.append(text)
        elif op["op"] == "resize_max":
            text = f"resize_max={op['size']}"
            if op["interpolation"] != "bilinear":
                text += f":{op['interpolation']}"
            parts.append(text)
        elif op["op"] == "center_crop":
            parts.append(f"center_crop={op['size'][0]}x{op['size'][1]}")
        elif op["op"] == "grayscale":
            parts.append(f"grayscale={op['num_output_channels']}")
        elif op["op"] == "pad":
            parts.append(f"pad={op['padding']}:{op['padding_mode']}")
    return ",".join(parts) or "none"


def apply_static(img: Image.Image, spec: StaticSpec) -> np.ndarray:
    """Run ``spec`` on an RGB PIL image; return a C-contiguous uint8 (C, H, W) array.

    Uses torchvision's v2 kernels on the PIL image, so the result is exactly what
    the equivalent ``v2.Compose([..., v2.PILToTensor()])`` returns.
    """
    return pil_to_chw(_run_ops(img, spec))


def apply_static_any(image: Any, spec: StaticSpec) -> np.ndarray:
    """``spec`` on a PIL image (``apply_static``) or on a uint8 (C, H, W) tensor: uint8 CHW array.

    A tensor goes through the same torchvision v2 kernels, so the result equals
    ``v2.Compose(to_torchvision(spec))(tensor)``.
    """
    if isinstance(image, Image.Image):
        return apply_static(image, spec)
    return np.ascontiguousarray(_run_ops(image, spec).numpy())


def _run_ops(image: Any, spec: StaticSpec) -> Any:
    """The ops of ``spec`` on a PIL image or a (C, H, W) tensor, with torchvision's v2 kernels."""
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as F

    for op in spec:
        kind = op["op"]
        if kind == "resize":
            size = op["size"] if isinstance(op["size"], list) else [op["size"]]
            image = F.resize(image, size, interpolation=InterpolationMode(op["interpolation"]),
                             max_size=op["max_size"], antialias=op["antialias"])
        elif kind == "resize_max":
            image = resize_max(image, op["size"], InterpolationMode(op["interpolation"]), op["antialias"])
        elif kind == "center_crop":
            image = F.center_crop(image, op["size"])
        elif kind == "grayscale":
            image = F.rgb_to_grayscale(image, num_output_channels=op["num_output_channels"])
        elif kind == "pad":
            image = F.pad(image, op["padding"], fill=op["fill"], padding_mode=op["padding_mode"])
    return image


def resize_max(image: Any, size: int, interpolation: Any, antialias: bool) -> Any:
    """Longer side down to ``size``, aspect kept; an image already that small is returned untouched.

    The output size is torchvision's for ``Resize(size=None, max_size=size)`` (shorter side
    truncated), except that the shorter side is at least 1 where torchvision would fail on 0;
    and that resize would also upscale smaller images, hence the check.
    """
    from torchvision.transforms.v2 import functional as F

    height, width = F.get_size(image)
    longer, shorter = max(height, width), min(height, width)
    if longer <= size:
        return image
    new_shorter = max(1, int(size * shorter / longer))
    new_size = [size, new_shorter] if height >= width else [new_shorter, size]
    return F.resize(image, new_size, interpolation=interpolation, antialias=antialias)


class ResizeMax:
    """torchvision-style transform of the ``resize_max`` op (PIL images and tensors).

    ``v2.Resize(size=None, max_size=N)`` would upscale images smaller than N; this does not.
    Several inputs (``(image, tv_tensors.Mask)`` in a v2 ``Compose``): each resized (a Mask nearest), a tuple.
    """

    def __init__(self, size: int, interpolation: Any = "bilinear", antialias: bool = True) -> None:
        from torchvision.transforms.v2 import InterpolationMode

        self.size = size
        self.interpolation = InterpolationMode(getattr(interpolation, "value", interpolation))
        self.antialias = antialias

    def __call__(self, *inputs: Any) -> Any:
        out = tuple(resize_max(x, self.size, self.interpolation, self.antialias) for x in inputs)
        return out[0] if len(out) == 1 else out

    def __repr__(self) -> str:
        return (f"ResizeMax(size={self.size}, interpolation={self.interpolation.value}, "
                f"antialias={self.antialias})")


def pil_to_chw(img: Image.Image) -> np.ndarray:
    """uint8 (C, H, W) array of a PIL image, as ``v2.PILToTensor`` lays it out."""
    arr = np.asarray(img)
    if arr.ndim == 2:
        arr = arr[None, :, :].copy()  # asarray of a PIL image is read-only; own the buffer
    else:
        arr = arr.transpose(2, 0, 1)
    if arr.dtype != np.uint8:
        raise TransformSpecError(f"image mode {img.mode!r} is not 8-bit; expected RGB or L after decoding")
    return np.ascontiguousarray(arr)


def to_torchvision(spec: StaticSpec) -> Sequence[Any]:
    """The torchvision v2 transforms equivalent to ``spec`` (without the final PILToTensor).

    ``resize_max`` maps to ``ResizeMax``: ``v2.Resize(size=None, max_size=N)`` would also upscale.
    """
    from torchvision.transforms import v2
    from torchvision.transforms.v2 import InterpolationMode

    out: list[Any] = []
    for op in spec:
        if op["op"] == "resize":
            out.append(v2.Resize(op["size"], interpolation=InterpolationMode(op["interpolation"]),
                                 max_size=op["max_size"], antialias=op["antialias"]))
        elif op["op"] == "resize_max":
            out.append(ResizeMax(op["size"], interpolation=op["interpolation"], antialias=op["antialias"]))
        elif op["op"] == "center_crop":
            out.append(v2.CenterCrop(op["size"]))
        elif op["op"] == "grayscale":
            out.append(v2.Grayscale(op["num_output_channels"]))
        elif op["op"] == "pad":
            out.append(v2.Pad(op["padding"], fill=op["fill"], padding_mode=op["padding_mode"]))
    return out


