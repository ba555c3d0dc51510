"""The static stage on an (image, mask) pair, as torchvision v2 transforms ``(image, tv_tensors.Mask)``.

The image goes through ``apply_static_any`` exactly as a classification sample does (a PIL
image through torchvision's kernels on PIL, a uint8 (C, H, W) tensor through its tensor kernels).
The mask goes through the same ops as v2's transforms run them on a ``tv_tensors.Mask``, which
they dispatch by type::

    op            the mask (v2's Mask kernel)
    resize        nearest neighbour (nearest-exact when the op says so), no antialiasing; the image's size
    resize_max    the same size as the image, nearest neighbour
    center_crop   the same window; padded with 0 where the crop is larger than the mask
    pad           the op's padding, padding_mode and fill (one number: v2 refuses a per-channel fill
                  for a Mask, and so does ``check_mask_spec``)
    grayscale     untouched (v2's colour ops pass a Mask through)

So ``apply_static_pair(image, mask, spec)`` is, bit for bit,
``v2.Compose(to_torchvision(spec))(image, tv_tensors.Mask(mask))``, the image then laid out by
``v2.PILToTensor`` when it is a PIL image. The mask keeps its dtype (uint8, or uint16 for more
than 255 classes): the ops only move values and pad with the fill, so none is changed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ArgumentError, TransformSpecError
from .static import StaticSpec, apply_static_any, parse_static, resize_max

# ops whose v2 transform moves a Mask (the others pass it through untouched)
_MOVES_MASK = ("resize", "resize_max", "center_crop", "pad")
MASK_DTYPES = (np.uint8, np.uint16)


def check_mask_spec(spec: Any) -> StaticSpec:
    """``spec`` (any form ``parse_static`` takes) as its canonical list, refusing what v2 cannot do to a
    Mask: a pad with a per-channel fill.

    Raises:
        TransformSpecError: the spec is invalid, or pads with a per-channel fill.
    """
    spec = parse_static(spec)
    for op in spec:
        if op["op"] == "pad" and isinstance(op["fill"], list):
            raise TransformSpecError(
                f"pad with the per-channel fill {op['fill']}: torchvision v2 pads a Mask with one number only "
                "(\"Non-scalar fill value is not supported\"); give pad one fill (pad=4:0), or pad at read time "
                "with a fill per type (v2.RandomCrop(..., fill={tv_tensors.Image: [...], tv_tensors.Mask: 255}))")
    return spec


def mask_static(mask: Any, spec: Any) -> np.ndarray:
    """The static ops of ``spec`` on a (H, W) uint8 or uint16 ``mask`` (ndarray or tensor), as v2's
    transforms run them on a ``tv_tensors.Mask`` (see the module doc): a C-contiguous (H', W') array
    of the mask's dtype.

    Raises:
        ArgumentError: the mask is not (H, W), or not uint8/uint16.
        TransformSpecError: as ``check_mask_spec``.
    """
    import torch
    from torchvision import tv_tensors
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as F

    spec = check_mask_spec(spec)
    values = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
    if values.ndim != 2 or values.dtype not in MASK_DTYPES:
        raise ArgumentError(f"a mask is (H, W) uint8 or uint16 class indices, got a {values.dtype} array of shape "
                            f"{values.shape} (dlstore.sources.to_mask makes one of a PIL mask, a tv_tensors.Mask "
                            "or an integer array)")
    out = tv_tensors.Mask(torch.from_numpy(np.array(values)))    # a copy: a decoded mask is read-only
    for op in spec:
        kind = op["op"]
        if kind not in _MOVES_MASK:
            continue
        if kind == "resize":
            size = op["size"] if isinstance(op["size"], list) else [op["size"]]
            out = F.resize(out, size, interpolation=InterpolationMode(op["interpolation"]),
                           max_size=op["max_size"], antialias=op["antialias"])
        elif kind == "resize_max":
            out = resize_max(out, op["size"], InterpolationMode(op["interpolation"]), op["antialias"])
        elif kind == "center_crop":
            out = F.center_crop(out, op["size"])
        else:
            out = F.pad(out, op["padding"], fill=op["fill"], padding_mode=op["padding_mode"])
    return np.ascontiguousarray(out.as_subclass(torch.Tensor).numpy())


def apply_static_pair(image: Any, mask: Any, spec: Any) -> tuple[np.ndarray, np.ndarray]:
    """The static stage on an image and its mask: ``(uint8 (C, H, W) image, (H, W) mask)`` arrays.

    Args:
        image: a PIL image (L or RGB, as ``pil_loader`` gives it) or a uint8 (C, H, W) tensor.
        mask: the (H, W) class indices of the image's pixels, a uint8 or uint16 ndarray or tensor.
        spec: the static spec, in any form ``parse_static`` takes.

    Returns:
        The image as ``apply_static_any`` makes it, and the mask as v2 transforms a ``tv_tensors.Mask``
        beside it (see the module doc), of the mask's dtype; both of the same height and width.

    Raises:
        ArgumentError: the mask is not the image's size, not (H, W), or not uint8/uint16.
        TransformSpecError: the spec is invalid, or pads with a per-channel fill.
    """
    spec = check_mask_spec(spec)
    height, width = (image.size[1], image.size[0]) if hasattr(image, "getbands") else tuple(image.shape[-2:])
    if tuple(np.shape(mask)) != (height, width):
        raise ArgumentError(f"the mask is {tuple(np.shape(mask))} (H, W) but its image {height}x{width} (H x W): a "
                            "mask labels its image's pixels one for one")
    return apply_static_any(image, spec), mask_static(mask, spec)
