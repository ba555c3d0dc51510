"""Static transform specs: the deterministic ops paid once, at conversion.

A spec is a list of plain dicts, stored in every manifest::

    [{"op": "resize", "size": 256, "interpolation": "bilinear", "antialias": True, "max_size": None},
     {"op": "center_crop", "size": [224, 224]}]

It can be written three ways, all normalised to the same canonical list:

* the CLI string ``"resize=256,center_crop=224"`` (or a JSON list);
* a list of dicts (missing fields get torchvision's defaults);
* torchvision transforms (``v2.Compose([v2.Resize(256), v2.CenterCrop(224)])``,
  v1 transforms too).

``apply_static`` runs the ops with torchvision's own v2 kernels on the PIL image
that ``pil_loader`` returns, then converts to a uint8 CHW array exactly as
``v2.PILToTensor`` does; the stored sample is therefore bit-identical to
``v2.Compose([same ops, v2.PILToTensor()])(pil_loader(path))``.

Random ops are refused: a random op in a static spec would freeze one random
draw into the data for ever, so every epoch would see the same "augmentation".
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from PIL import Image

from .errors import TransformSpecError

StaticSpec = list[dict[str, Any]]

INTERPOLATIONS = ("nearest", "nearest-exact", "bilinear", "bicubic", "box", "hamming", "lanczos")
PADDING_MODES = ("constant", "edge", "reflect", "symmetric")
STATIC_OPS = ("resize", "center_crop", "grayscale", "pad")

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
_TO_TENSOR_NAMES = ("PILToTensor", "ToImage", "ToPureTensor")
_FLOAT_NAMES = ("ToTensor", "ToDtype", "ConvertImageDtype", "Normalize")


def _size_pair(value: Any, op: str) -> list[int]:
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
            canon_size = _size_pair(size, op)[0]
        else:
            canon_size = _size_pair(size, op)
        interpolation = take("interpolation", "bilinear")
        interpolation = getattr(interpolation, "value", interpolation)  # InterpolationMode
        if interpolation not in INTERPOLATIONS:
            raise TransformSpecError(
                f"resize: unknown interpolation {interpolation!r}; valid: {', '.join(INTERPOLATIONS)}"
            )
        antialias = take("antialias", True)
        max_size = take("max_size", None)
        if antialias is None:
            antialias = True  # torchvision v2's default for PIL input
        out = {"op": op, "size": canon_size, "interpolation": interpolation,
               "antialias": bool(antialias), "max_size": None if max_size is None else int(max_size)}
    elif op == "center_crop":
        out = {"op": op, "size": _size_pair(take("size", None), op)}
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


def _from_torchvision(t: Any) -> StaticSpec:
    """Spec of one torchvision transform (v1 or v2), recursing into Compose."""
    name = type(t).__name__
    if name == "Compose":
        return [op for inner in t.transforms for op in _from_torchvision(inner)]
    if name in _TO_TENSOR_NAMES:
        return []
    if name == "Resize":
        return [_canonical_op({"op": "resize", "size": t.size, "interpolation": t.interpolation,
                               "antialias": t.antialias, "max_size": t.max_size})]
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
        f"{name} has no static equivalent; static ops: Resize, CenterCrop, Grayscale, Pad "
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
                "resize=256:bicubic, center_crop=224, grayscale, grayscale=3, pad=4, pad=4:reflect"
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

    Accepts ``None``, a CLI string, a list of dicts, a torchvision transform or
    ``Compose``, or an object with a ``static`` attribute (a hybrid transform).

    Raises:
        TransformSpecError: unknown op, bad field, or a random / float op.
    """
    if spec is None:
        return []
    if hasattr(spec, "static_spec"):
        return parse_static(spec.static_spec)
    if isinstance(spec, str):
        spec = _parse_string(spec)
    if isinstance(spec, (list, tuple)):
        out: StaticSpec = []
        for entry in spec:
            if isinstance(entry, dict):
                out.append(_canonical_op(entry))
            else:
                out.extend(_from_torchvision(entry))
        return out
    return _from_torchvision(spec)


def output_shape(spec: StaticSpec) -> tuple[int, int, int] | None:
    """(C, H, W) every sample has after ``spec``, or None when it depends on the image."""
    channels, hw = 3, None
    for op in spec:
        if op["op"] == "resize":
            hw = tuple(op["size"]) if isinstance(op["size"], list) else None
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
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as F

    for op in spec:
        kind = op["op"]
        if kind == "resize":
            size = op["size"] if isinstance(op["size"], list) else [op["size"]]
            img = F.resize(img, size, interpolation=InterpolationMode(op["interpolation"]),
                           max_size=op["max_size"], antialias=op["antialias"])
        elif kind == "center_crop":
            img = F.center_crop(img, op["size"])
        elif kind == "grayscale":
            img = F.rgb_to_grayscale(img, num_output_channels=op["num_output_channels"])
        elif kind == "pad":
            fill = op["fill"]
            img = F.pad(img, op["padding"], fill=fill, padding_mode=op["padding_mode"])
    return pil_to_chw(img)


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
    """The torchvision v2 transforms equivalent to ``spec`` (without the final PILToTensor)."""
    from torchvision.transforms import v2
    from torchvision.transforms.v2 import InterpolationMode

    out: list[Any] = []
    for op in spec:
        if op["op"] == "resize":
            out.append(v2.Resize(op["size"], interpolation=InterpolationMode(op["interpolation"]),
                                 max_size=op["max_size"], antialias=op["antialias"]))
        elif op["op"] == "center_crop":
            out.append(v2.CenterCrop(op["size"]))
        elif op["op"] == "grayscale":
            out.append(v2.Grayscale(op["num_output_channels"]))
        elif op["op"] == "pad":
            out.append(v2.Pad(op["padding"], fill=op["fill"], padding_mode=op["padding_mode"]))
    return out


def specs_equal(a: Iterable[dict[str, Any]], b: Iterable[dict[str, Any]]) -> bool:
    """Equality of two specs after canonicalisation."""
    return parse_static(list(a)) == parse_static(list(b))


# ---------------------------------------------------------------------------
# Batch transforms: per-sample randomness, whole-batch tensor ops.
#
# Agreed interface (GPUDataset relies on it): ``t(images, generator=None)``
# takes a (B, C, H, W) tensor on any device, draws independent parameters for
# every sample from ``generator`` (a torch.Generator on the same device as
# ``images``; None uses torch's default generator of that device) and returns
# a new tensor; the input is never modified in place. Each random transform
# splits into ``sample`` (draw the parameters, a dict of (B,) tensors) and
# ``apply`` (a pure kernel given the parameters), as torchvision does, so the
# loader can fuse the kernel into the copy that assembles the batch and tests
# can compare it with a per-sample reference.
# ---------------------------------------------------------------------------

BatchParams = dict[str, "torch.Tensor"]


def _check_batch(images: Any, name: str) -> None:
    import torch

    if not isinstance(images, torch.Tensor) or images.ndim != 4:
        got = f"{type(images).__name__} of shape {tuple(images.shape)}" if hasattr(images, "shape") \
            else type(images).__name__
        raise TransformSpecError(f"{name} takes a (B, C, H, W) tensor, got {got}")


def _check_generator(generator: Any, device: Any, name: str) -> None:
    if generator is not None and generator.device.type != device.type:
        raise TransformSpecError(
            f"{name}: the generator is on {generator.device} but the images are on {device}; "
            f"use torch.Generator(device={str(device)!r})")


def _as_padding(padding: Any) -> tuple[int, int, int, int]:
    """torchvision's padding forms -> (left, top, right, bottom)."""
    if padding is None:
        return (0, 0, 0, 0)
    if isinstance(padding, int) and not isinstance(padding, bool):
        values = [padding] * 4
    elif isinstance(padding, (list, tuple)) and len(padding) == 1:
        values = [padding[0]] * 4
    elif isinstance(padding, (list, tuple)) and len(padding) == 2:
        values = [padding[0], padding[1], padding[0], padding[1]]
    elif isinstance(padding, (list, tuple)) and len(padding) == 4:
        values = list(padding)
    else:
        raise TransformSpecError(
            f"padding must be an int, [left/right, top/bottom] or [left, top, right, bottom], got {padding!r}")
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in values):
        raise TransformSpecError(f"padding must hold non-negative ints, got {padding!r}")
    return tuple(values)  # type: ignore[return-value]


def _randint(high: Any, n: int, generator: Any, device: Any) -> "torch.Tensor":
    """n ints, the k-th uniform in [0, high[k]) (``high`` an int or a (n,) tensor >= 1)."""
    import torch

    u = torch.rand(n, generator=generator, device=device, dtype=torch.float64)
    return (u * high).long().clamp_max(torch.as_tensor(high, device=device) - 1)


class BatchTransform:
    """Base of the batch transforms: ``sample`` draws parameters, ``apply`` is the kernel."""

    def sample(self, shape: Sequence[int], *, generator: Any = None, device: Any = "cpu") -> BatchParams:
        """Draw the parameters of every sample of a batch of ``shape`` (B, C, H, W)."""
        return {}

    def apply(self, images: "torch.Tensor", params: BatchParams) -> "torch.Tensor":
        """Run the transform on ``images`` with the given parameters (pure; no randomness)."""
        raise NotImplementedError

    def __call__(self, images: "torch.Tensor", generator: Any = None) -> "torch.Tensor":
        name = type(self).__name__
        _check_batch(images, name)
        _check_generator(generator, images.device, name)
        return self.apply(images, self.sample(images.shape, generator=generator, device=images.device))

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(H, W) of the output for an input of (height, width)."""
        return (height, width)


class BatchRandomCrop(BatchTransform):
    """Random crop of ``size`` after optional padding, an independent offset per sample.

    Equivalent to ``v2.RandomCrop(size, padding, fill=fill, padding_mode=padding_mode)``
    applied to each sample. Runs as one pad plus one gather over the batch.

    Args:
        size: output (height, width), or an int for a square.
        padding: int, [left/right, top/bottom] or [left, top, right, bottom], as torchvision.
        fill: value of the padded pixels with ``padding_mode="constant"``.
        padding_mode: "constant", "edge", "reflect" or "symmetric".
    """

    def __init__(self, size: int | Sequence[int], padding: Any = 0, *, fill: int | float = 0,
                 padding_mode: str = "constant"):
        self.size = tuple(_size_pair(list(size) if isinstance(size, tuple) else size, "BatchRandomCrop"))
        self.padding = _as_padding(padding)
        if padding_mode not in PADDING_MODES:
            raise TransformSpecError(
                f"BatchRandomCrop: unknown padding_mode {padding_mode!r}; valid: {', '.join(PADDING_MODES)}")
        if not isinstance(fill, (int, float)) or isinstance(fill, bool):
            raise TransformSpecError(f"BatchRandomCrop: fill must be one number, got {fill!r}")
        self.fill = fill
        self.padding_mode = padding_mode

    def sample(self, shape: Sequence[int], *, generator: Any = None, device: Any = "cpu") -> BatchParams:
        b, _, h, w = shape
        left, top, right, bottom = self.padding
        ph, pw = h + top + bottom, w + left + right
        th, tw = self.size
        if th > ph or tw > pw:
            raise TransformSpecError(
                f"BatchRandomCrop: crop {th}x{tw} is larger than the padded image {ph}x{pw} "
                f"(image {h}x{w}, padding {list(self.padding)})")
        return {"top": _randint(ph - th + 1, b, generator, device),
                "left": _randint(pw - tw + 1, b, generator, device)}

    def apply(self, images: "torch.Tensor", params: BatchParams) -> "torch.Tensor":
        import torch
        from torchvision.transforms.v2 import functional as F

        if any(self.padding):
            images = F.pad(images, list(self.padding), fill=self.fill, padding_mode=self.padding_mode)
        images = images.contiguous()
        b, c, ph, pw = images.shape
        th, tw = self.size
        # A strided view of every crop window, (B, Y, X, C, th, tw); indexing its first three
        # dims copies one window per sample, whole (C, th, tw) blocks at a time.
        sb, sc, sh, sw = images.stride()
        shape, strides = (b, ph - th + 1, pw - tw + 1, c, th, tw), (sb, sh, sw, sc, sh, sw)
        top, left = params["top"], params["left"]
        if images.device.type == "cpu" and images.dtype != torch.bfloat16 and not images.requires_grad:
            # numpy's fancy indexing copies the blocks ~5x faster than torch's on CPU (measured)
            a = images.numpy()
            windows = np.lib.stride_tricks.as_strided(
                a, shape=shape, strides=[s * a.itemsize for s in strides], writeable=False)
            return torch.from_numpy(windows[np.arange(b), top.cpu().numpy(), left.cpu().numpy()])
        windows = images.as_strided(shape, strides)
        device = images.device
        return windows[torch.arange(b, device=device), top.to(device), left.to(device)]

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        return self.size  # type: ignore[return-value]

    def __repr__(self) -> str:
        return (f"BatchRandomCrop(size={list(self.size)}, padding={list(self.padding)}, fill={self.fill}, "
                f"padding_mode={self.padding_mode!r})")


class BatchRandomHorizontalFlip(BatchTransform):
    """Flip each sample left-right with probability ``p``, independently.

    Equivalent to ``v2.RandomHorizontalFlip(p)`` per sample; one ``where`` over the batch.
    """

    def __init__(self, p: float = 0.5):
        if not 0.0 <= float(p) <= 1.0:
            raise TransformSpecError(f"BatchRandomHorizontalFlip: p must lie in [0, 1], got {p!r}")
        self.p = float(p)

    def sample(self, shape: Sequence[int], *, generator: Any = None, device: Any = "cpu") -> BatchParams:
        import torch

        return {"flip": torch.rand(shape[0], generator=generator, device=device) < self.p}

    def apply(self, images: "torch.Tensor", params: BatchParams) -> "torch.Tensor":
        import torch

        flip = params["flip"].to(images.device)
        return torch.where(flip[:, None, None, None], images.flip(-1), images)

    def __repr__(self) -> str:
        return f"BatchRandomHorizontalFlip(p={self.p})"


class BatchRandomResizedCrop(BatchTransform):
    """Random crop of random area and aspect ratio, resized to a fixed ``size``, per sample.

    Parameters are drawn as ``v2.RandomResizedCrop.get_params`` draws them (10
    tries, then a centre crop), for every sample at once. The resize of every
    crop runs as one ``torchvision.ops.roi_align`` call over the batch: bilinear
    sampling; with ``antialias`` each output pixel averages ceil(crop/size)^2
    bilinear samples of its cell (a box prefilter, close to torchvision's
    antialiased resize), without it one sample per pixel, which equals
    ``F.resized_crop(..., antialias=False)`` wherever the crop is at least as
    large as the output. uint8 input gives rounded uint8 output.

    Args:
        size: output (height, width), or an int for a square.
        scale: range of the crop's area as a fraction of the image.
        ratio: range of the crop's aspect ratio (width / height).
        antialias: average over each output cell when shrinking.
    """

    def __init__(self, size: int | Sequence[int], scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3), *, antialias: bool = True):
        self.size = tuple(_size_pair(list(size) if isinstance(size, tuple) else size, "BatchRandomResizedCrop"))
        if len(scale) != 2 or len(ratio) != 2 or scale[0] > scale[1] or ratio[0] > ratio[1] \
                or scale[0] <= 0 or ratio[0] <= 0:
            raise TransformSpecError(
                f"BatchRandomResizedCrop: scale and ratio must be increasing positive (min, max) pairs, "
                f"got scale={scale!r}, ratio={ratio!r}")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.antialias = bool(antialias)

    def sample(self, shape: Sequence[int], *, generator: Any = None, device: Any = "cpu") -> BatchParams:
        import math

        import torch

        b, _, height, width = shape
        area = height * width
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        top = torch.zeros(b, dtype=torch.long, device=device)
        left = torch.zeros_like(top)
        ch = torch.zeros_like(top)
        cw = torch.zeros_like(top)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        for _ in range(10):
            u = torch.rand(4, b, generator=generator, device=device, dtype=torch.float64)
            target = area * (self.scale[0] + u[0] * (self.scale[1] - self.scale[0]))
            aspect = torch.exp(log_ratio[0] + u[1] * (log_ratio[1] - log_ratio[0]))
            w = torch.round(torch.sqrt(target * aspect)).long()
            h = torch.round(torch.sqrt(target / aspect)).long()
            ok = (w > 0) & (w <= width) & (h > 0) & (h <= height) & ~done
            i = (u[2] * (height - h + 1).clamp_min(1)).long()
            j = (u[3] * (width - w + 1).clamp_min(1)).long()
            top = torch.where(ok, i, top)
            left = torch.where(ok, j, left)
            ch = torch.where(ok, h, ch)
            cw = torch.where(ok, w, cw)
            done |= ok
        # Fallback for samples with no valid try: torchvision's centre crop.
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            fw, fh = width, int(round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            fw, fh = int(round(height * self.ratio[1])), height
        else:
            fw, fh = width, height
        top = torch.where(done, top, torch.full_like(top, (height - fh) // 2))
        left = torch.where(done, left, torch.full_like(left, (width - fw) // 2))
        ch = torch.where(done, ch, torch.full_like(ch, fh))
        cw = torch.where(done, cw, torch.full_like(cw, fw))
        return {"top": top, "left": left, "height": ch, "width": cw}

    def apply(self, images: "torch.Tensor", params: BatchParams) -> "torch.Tensor":
        import torch
        from torchvision.ops import roi_align

        device = images.device
        b = images.shape[0]
        top = params["top"].to(device=device, dtype=torch.float32)
        left = params["left"].to(device=device, dtype=torch.float32)
        boxes = torch.stack([torch.arange(b, device=device, dtype=torch.float32), left, top,
                             left + params["width"].to(device), top + params["height"].to(device)], dim=1)
        x = images if images.dtype == torch.float32 else images.to(torch.float32)
        out = roi_align(x, boxes, self.size, spatial_scale=1.0,
                        sampling_ratio=-1 if self.antialias else 1, aligned=True)
        if images.dtype == torch.uint8:
            return out.round_().clamp_(0, 255).to(torch.uint8)
        return out.to(images.dtype)

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        return self.size  # type: ignore[return-value]

    def __repr__(self) -> str:
        return (f"BatchRandomResizedCrop(size={list(self.size)}, scale={self.scale}, "
                f"ratio=({self.ratio[0]:.4g}, {self.ratio[1]:.4g}), antialias={self.antialias})")


class BatchCutout(BatchTransform):
    """Fill one ``size`` x ``size`` square per sample, placed uniformly inside the image.

    The square lies wholly inside the image (as airbench's cutout); one
    ``masked_fill`` over the batch.
    """

    def __init__(self, size: int, *, fill: int | float = 0):
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise TransformSpecError(f"BatchCutout: size must be a positive int, got {size!r}")
        self.size = size
        self.fill = fill

    def sample(self, shape: Sequence[int], *, generator: Any = None, device: Any = "cpu") -> BatchParams:
        b, _, h, w = shape
        if self.size > min(h, w):
            raise TransformSpecError(f"BatchCutout: square {self.size} is larger than the image {h}x{w}")
        return {"top": _randint(h - self.size + 1, b, generator, device),
                "left": _randint(w - self.size + 1, b, generator, device)}

    def apply(self, images: "torch.Tensor", params: BatchParams) -> "torch.Tensor":
        import torch

        device = images.device
        h, w = images.shape[-2:]
        dy = torch.arange(h, device=device)[None, :] - params["top"].to(device)[:, None]    # (B, H)
        dx = torch.arange(w, device=device)[None, :] - params["left"].to(device)[:, None]   # (B, W)
        mask = ((dy >= 0) & (dy < self.size))[:, None, :, None] & ((dx >= 0) & (dx < self.size))[:, None, None, :]
        return images.masked_fill(mask, self.fill)

    def __repr__(self) -> str:
        return f"BatchCutout(size={self.size}, fill={self.fill})"


class BatchNormalize(BatchTransform):
    """Convert to float and optionally normalise: ``v2.ToDtype(dtype, scale=True)`` + ``v2.Normalize``.

    Meant for the end of the pipeline, on the device: a float32 batch is 4x the
    bytes of uint8. The arithmetic runs in float32 (also for a float16 output,
    which is then exactly the rounded float32 result).

    Args:
        mean: per-channel means (of the scaled values), or None for no normalisation.
        std: per-channel standard deviations; required with ``mean``.
        dtype: output dtype, a floating type (torch.float32, torch.float16, torch.bfloat16).
        scale: divide integer input by its maximum (255 for uint8), as ``ToDtype(scale=True)``.
    """

    def __init__(self, mean: Sequence[float] | None = None, std: Sequence[float] | None = None, *,
                 dtype: Any = None, scale: bool = True):
        import torch

        dtype = torch.float32 if dtype is None else dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TransformSpecError(f"BatchNormalize: dtype must be a floating torch dtype, got {dtype!r}")
        if (mean is None) != (std is None):
            raise TransformSpecError("BatchNormalize: give both mean and std, or neither")
        if std is not None and any(float(s) == 0 for s in std):
            raise TransformSpecError(f"BatchNormalize: std must not contain 0, got {list(std)}")
        self.mean = None if mean is None else [float(m) for m in mean]
        self.std = None if std is None else [float(s) for s in std]
        self.dtype = dtype
        self.scale = bool(scale)

    def apply(self, images: "torch.Tensor", params: BatchParams) -> "torch.Tensor":
        import torch

        x = images.to(torch.float32)  # always a new tensor unless already float32
        if x is images:
            x = x.clone()
        if self.scale and not images.is_floating_point():
            x.mul_(1.0 / torch.iinfo(images.dtype).max)
        if self.mean is not None:
            mean = torch.as_tensor(self.mean, dtype=torch.float32, device=x.device).view(-1, 1, 1)
            std = torch.as_tensor(self.std, dtype=torch.float32, device=x.device).view(-1, 1, 1)
            if mean.numel() not in (1, x.shape[1]):
                raise TransformSpecError(
                    f"BatchNormalize: {mean.numel()} means for images of {x.shape[1]} channels")
            x.sub_(mean).div_(std)
        return x.to(self.dtype)

    def __repr__(self) -> str:
        return f"BatchNormalize(mean={self.mean}, std={self.std}, dtype={self.dtype}, scale={self.scale})"


class BatchCompose(BatchTransform):
    """Run batch transforms in order, each with the same generator."""

    def __init__(self, transforms: Sequence[Any]):
        self.transforms = list(transforms)

    def __call__(self, images: "torch.Tensor", generator: Any = None) -> "torch.Tensor":
        for t in self.transforms:
            images = t(images, generator)
        return images

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        for t in self.transforms:
            if hasattr(t, "output_size"):
                height, width = t.output_size(height, width)
        return height, width

    def __repr__(self) -> str:
        inner = "".join(f"\n    {t!r}," for t in self.transforms)
        return f"BatchCompose([{inner}\n])"


# ---------------------------------------------------------------------------
# Hybrid transforms: a pipeline split into its static and dynamic parts.
# ---------------------------------------------------------------------------


def _flatten(pipeline: Any) -> list[Any]:
    """The ops of a torchvision pipeline, nested Compose flattened; a list is taken as a Compose."""
    if pipeline is None:
        return []
    if isinstance(pipeline, (list, tuple)):
        return [op for t in pipeline for op in _flatten(t)]
    if type(pipeline).__name__ == "Compose" and hasattr(pipeline, "transforms"):
        return [op for t in pipeline.transforms for op in _flatten(t)]
    return [pipeline]


def _compose(ops: Sequence[Any]) -> Any:
    """A per-sample callable running ``ops`` in order (None when empty)."""
    if not ops:
        return None
    from torchvision.transforms import v2

    return v2.Compose(list(ops))


class HybridTransform:
    """A transform pipeline in two parts: static (run once at conversion) and dynamic (per read).

    ``convert(src, dst, static=hybrid)`` stores the output of the static part;
    ``open_dataset(dst, transform=hybrid)`` checks that the store was made with
    that static part and applies only the dynamic part (per batch where every op
    has a batch equivalent, see ``batch_plan``). Calling the hybrid on a PIL
    image runs both parts: the reference result of the whole pipeline.

    Args:
        static: a static spec in any form ``parse_static`` accepts (string, list
            of dicts, torchvision transforms); deterministic ops only.
        dynamic: the read-time transforms: a torchvision transform or Compose, a
            list of them, or None.

    Attributes:
        dynamic_ops: the dynamic part as a flat list of transforms.
        dynamic: the dynamic part as one per-sample callable (``v2.Compose``), or None.
        notes: how each op of the original pipeline was placed, and why.
    """

    def __init__(self, static: Any = None, dynamic: Any = None, *, notes: Sequence[str] = ()):
        self._static = parse_static(static)
        self.dynamic_ops = _flatten(dynamic)
        self.dynamic = _compose(self.dynamic_ops)
        self.notes = list(notes)

    @property
    def static_spec(self) -> StaticSpec:
        """The canonical static spec (a copy): what ``convert`` records in the manifest."""
        return [dict(op) for op in self._static]

    def __call__(self, img: Image.Image) -> Any:
        """The whole pipeline on one RGB PIL image: static part, then dynamic part."""
        import torch

        out: Any = torch.from_numpy(apply_static(img, self._static))
        return self.dynamic(out) if self.dynamic is not None else out

    def __repr__(self) -> str:
        dyn = "".join(f"\n    {op!r}," for op in self.dynamic_ops)
        lines = [
            "HybridTransform(",
            f"  static (once, at conversion): {describe(self._static)}",
            f"  dynamic (every read, on uint8 CHW tensors): [{dyn}\n  ]" if dyn else
            "  dynamic (every read): none",
        ]
        if self.notes:
            lines.append("  split:")
            lines += [f"    - {n}" for n in self.notes]
        return "\n".join(lines) + "\n)"


def split_transforms(pipeline: Any) -> HybridTransform:
    """Split a torchvision pipeline into its longest deterministic prefix and the rest.

    The static part is the leading run of ops with a static equivalent
    (Resize, CenterCrop, Grayscale, Pad); the first random or float-producing
    op, and every op after it, form the dynamic part. PILToTensor / ToImage /
    ToPureTensor are dropped (a store already holds uint8 CHW tensors); a v1
    ``ToTensor`` in the dynamic part becomes ``v2.ToDtype(torch.float32, scale=True)``.

    Args:
        pipeline: ``v2.Compose([...])`` (or v1), a single transform, or a list.

    Returns:
        A HybridTransform whose ``repr`` explains where each op went.
    """
    ops = _flatten(pipeline)
    static: list[Any] = []
    dynamic: list[Any] = []
    notes: list[str] = []
    for t in ops:
        name = type(t).__name__
        if name in _TO_TENSOR_NAMES:
            notes.append(f"{name}: dropped (stores hold uint8 CHW tensors already)")
            continue
        if not dynamic:
            try:
                _from_torchvision(t)
            except TransformSpecError:
                reason = ("random: in the static part it would freeze one draw into the data"
                          if is_random_transform(t) else
                          "float output: the store keeps uint8, 4x smaller" if name in _FLOAT_NAMES else
                          "no static equivalent")
                notes.append(f"{name}: dynamic ({reason}); it and every op after it run at read time")
            else:
                static.append(t)
                notes.append(f"{name}: static (deterministic; runs once at conversion)")
                continue
        if name == "ToTensor":
            import torch
            from torchvision.transforms import v2

            notes.append("ToTensor: replaced by v2.ToDtype(torch.float32, scale=True) (input is a uint8 tensor)")
            t = v2.ToDtype(torch.float32, scale=True)
        dynamic.append(t)
    spec = parse_static(static)
    if output_shape(spec) is None:
        notes.append("the static part fixes no size: the store will be variable-shape, holding every image "
                     "at its decoded size (a size-fixing op such as CenterCrop makes a smaller, faster store)")
    return HybridTransform(spec, dynamic, notes=notes)


def _batch_equivalent(t: Any) -> BatchTransform | None:
    """The batch transform doing what torchvision transform ``t`` does per sample, or None."""
    import torch

    name = type(t).__name__
    if name == "RandomCrop":
        fill = getattr(t, "fill", 0)
        if getattr(t, "pad_if_needed", False) or not isinstance(fill, (int, float)):
            return None
        padding: Any = t.padding if t.padding is not None else 0
        if ".v2." in type(t).__module__ and isinstance(padding, list) and len(padding) == 4:
            # v2 keeps padding parsed as torch.nn.functional.pad's [left, right, top, bottom]
            padding = [padding[0], padding[2], padding[1], padding[3]]
        return BatchRandomCrop(list(t.size), padding=padding, fill=fill, padding_mode=t.padding_mode)
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
    mapped = [_batch_equivalent(t) for t in ops]
    cut = len(ops)
    while cut > 0 and mapped[cut - 1] is not None:
        cut -= 1
    if not fixed_shape:
        sized = [k for k in range(cut, len(ops)) if isinstance(mapped[k], (BatchRandomCrop, BatchRandomResizedCrop))]
        if sized:
            cut = sized[0] + 1
    head, tail = list(ops[:cut]), [m for m in mapped[cut:] if m is not None]
    merged: list[BatchTransform] = []
    for m in tail:
        prev = merged[-1] if merged else None
        if isinstance(m, BatchNormalize) and isinstance(prev, BatchNormalize) and prev.mean is None \
                and m.mean is not None and not m.scale:
            merged[-1] = BatchNormalize(m.mean, m.std, dtype=prev.dtype, scale=prev.scale)
        else:
            merged.append(m)
    return head, merged
