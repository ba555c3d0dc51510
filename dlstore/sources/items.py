"""What an in-memory source yields, made uniform: an image and an int label.

An image is kept as the source gives it, so the static ops see what the user's
torchvision pipeline would see:

* a PIL image stays a PIL image (modes ``L`` and ``RGB`` as they are; any other
  mode is converted to RGB, as ``pil_loader`` does for files);
* a uint8 ndarray or tensor becomes a uint8 (C, H, W) tensor, as ``v2.ToImage``
  makes it: ndarrays are read as (H, W, C) or (H, W), tensors as (C, H, W) or (H, W);
  when the other layout is the only one with 1 or 3 channels, that one.

Labels: an int (Python, numpy or a 0-d tensor); ``None`` means unlabelled (-1). Or a
target vector: a list, tuple, 1-D ndarray or tensor of K numbers, made an int64 array
(ints, bools) or a float32 array (floats) by ``to_target``.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
from PIL import Image

from ..errors import DecodeError

_CHANNELS = (1, 3)


def to_image(obj: Any, where: str) -> Any:
    """A PIL image (L or RGB) or a uint8 (C, H, W) tensor; DecodeError naming ``where`` otherwise."""
    if isinstance(obj, Image.Image):
        return obj if obj.mode in ("L", "RGB") else obj.convert("RGB")
    import torch

    if isinstance(obj, np.ndarray):
        tensor, channels_last = torch.from_numpy(np.ascontiguousarray(obj)), True
    elif isinstance(obj, torch.Tensor):
        tensor, channels_last = obj.detach().cpu(), False
    else:
        raise DecodeError(where, f"yields a {type(obj).__name__}, expected a PIL image or a uint8 "
                                 "ndarray/tensor (create the dataset without a transform= that changes that)")
    if tensor.dtype != torch.uint8:
        raise DecodeError(where, f"yields a {str(tensor.dtype).removeprefix('torch.')} image, expected uint8 (create the dataset without "
                                 "transform=ToTensor()/Normalize: dlstore stores uint8 and applies the static ops)")
    if tensor.ndim == 2:
        return tensor.unsqueeze(0).contiguous()
    if tensor.ndim != 3:
        raise DecodeError(where, f"yields an image of shape {tuple(tensor.shape)}, expected (H, W), (H, W, C) "
                                 "or (C, H, W)")
    first, last = tensor.shape[0] in _CHANNELS, tensor.shape[-1] in _CHANNELS
    if (channels_last and last) or (not channels_last and not first and last):
        return tensor.permute(2, 0, 1).contiguous()
    if first:
        return tensor.contiguous()
    raise DecodeError(where, f"yields an image of shape {tuple(tensor.shape)}: no axis of 1 or 3 channels")


def to_label(obj: Any, where: str) -> int:
    """An int label (-1 for None); DecodeError naming ``where`` for anything else."""
    if obj is None:
        return -1
    if getattr(obj, "ndim", None) == 0 and hasattr(obj, "item"):
        obj = obj.item()
    if isinstance(obj, numbers.Integral) and not isinstance(obj, bool):
        return int(obj)
    raise DecodeError(where, f"yields the target {obj!r} ({type(obj).__name__}), expected an int class index "
                             "(or None: unlabelled)")


def target_dtype(dtype: Any) -> np.dtype | None:
    """The stored dtype for values of ``dtype`` (int64 for ints and bools, float32 for floats), or None."""
    kind = np.dtype(dtype).kind
    return np.dtype(np.int64) if kind in "biu" else np.dtype(np.float32) if kind == "f" else None


def to_target(obj: Any, where: str) -> int | np.ndarray:
    """An int label (see ``to_label``) or a 1-D int64/float32 target vector; DecodeError otherwise."""
    if isinstance(obj, (list, tuple)) or getattr(obj, "ndim", 0) == 1:
        return target_vector(obj, where)
    return to_label(obj, where)


def target_vector(obj: Any, where: str) -> np.ndarray:
    """``obj`` (a sequence, 1-D ndarray or tensor of numbers) as an int64 or float32 (K,) array."""
    if hasattr(obj, "detach"):   # a tensor
        obj = obj.detach().cpu().numpy()
    try:
        values = np.asarray(obj)
    except (ValueError, TypeError) as exc:   # ragged nested lists
        raise DecodeError(where, f"yields the target {obj!r}, not a vector of numbers ({exc})") from None
    dtype = target_dtype(values.dtype) if values.dtype != object else None
    if dtype is None or values.ndim != 1 or values.size == 0:
        raise DecodeError(where, f"yields the target {obj!r} ({values.dtype} {values.shape}), expected an int "
                                 "class index or a non-empty vector of numbers (ints: int64, floats: float32)")
    return np.ascontiguousarray(values, dtype=dtype)
