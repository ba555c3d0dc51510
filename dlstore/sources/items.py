"""What an in-memory source yields, made uniform: an image and an int label.

An image is kept as the source gives it, so the static ops see what the user's
torchvision pipeline would see:

* a PIL image stays a PIL image, converted to the source's mode (``L`` or ``RGB``:
  ``img.convert(mode)``, 16-bit grayscale scaled ``v >> 8`` first, as ``pil_loader``
  does for files); without a mode to its ``storable_mode`` (``L`` for the grayscale
  family ``1``/``L``/``LA``/``I;16``..., ``RGB`` for every other);
* a uint8 ndarray or tensor becomes a uint8 (C, H, W) tensor, as ``v2.ToImage``
  makes it: ndarrays are read as (H, W, C) or (H, W), tensors as (C, H, W) or (H, W);
  when the other layout is the only one with 1 or 3 channels, that one. Given a mode
  of other channels, one channel is copied to three (what PIL's ``L`` -> ``RGB`` does)
  and three become PIL's ``convert("L")`` of them.

Labels: an int (Python, numpy or a 0-d tensor); ``None`` means unlabelled (-1). Or a
target vector: a list, tuple, 1-D ndarray or tensor of K numbers, made an int64 array
(ints, bools) or a float32 array (floats) by ``to_target``.

Masks (segmentation sources): ``to_mask`` makes a PIL mask, a ``tv_tensors.Mask``, an integer
tensor or ndarray of (H, W) (or one channel: (1, H, W), (H, W, 1)) the (H, W) uint8 array of its
class indices (uint16 when one exceeds 255); ``check_pair`` refuses a mask of another size than
its image.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
from PIL import Image

from ..errors import DecodeError, SourceError
from .decode import MASK_MAX, as_mode, channels_of, mask_from_pil, mode_conflict

_CHANNELS = (1, 3)


def image_mode(image: Any) -> str:
    """``"L"`` or ``"RGB"``: the mode of what ``to_image`` returned."""
    return image.mode if isinstance(image, Image.Image) else "L" if image.shape[0] == 1 else "RGB"


def source_image(obj: Any, where: str, mode: str | None, given: bool) -> Any:
    """``obj`` as an image of the source's ``mode``: converted to it when the mode was given or is RGB;
    a mode chosen as L (every image seen was grayscale) refuses a colour image (SourceError, not a
    per-item DecodeError: ``on_error="skip"`` must not drop the colour images)."""
    if mode is None or given or mode == "RGB":
        return to_image(obj, where, mode)
    image = to_image(obj, where)
    if image_mode(image) != mode:
        what = f"a PIL {obj.mode} image" if isinstance(obj, Image.Image) else f"a {type(obj).__name__} image"
        raise SourceError(mode_conflict(where, what, channels_of(image_mode(image)), mode))
    return image


def to_image(obj: Any, where: str, mode: str | None = None) -> Any:
    """A PIL image (L or RGB) or a uint8 (C, H, W) tensor, in ``mode`` when given; DecodeError
    naming ``where`` otherwise."""
    if isinstance(obj, Image.Image):
        try:
            return as_mode(obj, mode)
        except (OSError, ValueError) as exc:  # a lazily opened file that cannot be decoded
            raise DecodeError(where, f"cannot decode its image ({type(exc).__name__}: {exc})") from exc
    tensor = _to_tensor(obj, where)
    if mode is None or tensor.shape[0] == channels_of(mode):
        return tensor
    if tensor.shape[0] == 1:
        return tensor.expand(3, -1, -1).contiguous()
    import torch

    gray = Image.fromarray(tensor.permute(1, 2, 0).numpy()).convert("L")
    return torch.from_numpy(np.asarray(gray).copy()).unsqueeze(0)


def _to_tensor(obj: Any, where: str) -> Any:
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


def to_mask(obj: Any, where: str) -> np.ndarray:
    """``obj`` as the (H, W) uint8 (uint16 above 255) array of its class indices; DecodeError naming
    ``where`` otherwise (a float mask, negative values, a stack of instance masks)."""
    if isinstance(obj, Image.Image):
        return mask_from_pil(obj, where)
    if hasattr(obj, "detach"):   # a tensor (tv_tensors.Mask among them)
        obj = obj.detach().cpu().numpy()
    if not isinstance(obj, np.ndarray):
        raise DecodeError(where, f"yields a {type(obj).__name__} mask, expected a PIL image, a tv_tensors.Mask or "
                                 "an integer ndarray/tensor of (H, W)")
    values = obj[0] if obj.ndim == 3 and obj.shape[0] == 1 else obj[..., 0] if obj.ndim == 3 and \
        obj.shape[-1] == 1 else obj
    if values.ndim != 2:
        raise DecodeError(where, f"yields a mask of shape {tuple(obj.shape)}, expected (H, W) class indices (a "
                                 "semantic mask; a stack of instance masks is not one)")
    if values.dtype == np.bool_:
        return values.astype(np.uint8)
    if values.dtype.kind not in "iu":
        raise DecodeError(where, f"yields a {values.dtype} mask, expected integer class indices (create the "
                                 "dataset without a transform= that makes the mask float)")
    low, high = (int(values.min()), int(values.max())) if values.size else (0, 0)
    if low < 0 or high > MASK_MAX:
        raise DecodeError(where, f"yields mask values {low}..{high}; a mask holds class indices 0..{MASK_MAX} "
                                 "(map an ignore value such as -1 to 255 first)")
    return np.ascontiguousarray(values, dtype=np.uint8 if high <= 255 else np.uint16)


def image_size(image: Any) -> tuple[int, int]:
    """(H, W) of a PIL image or a (C, H, W) tensor."""
    if isinstance(image, Image.Image):
        return image.size[1], image.size[0]
    return int(image.shape[-2]), int(image.shape[-1])


def check_pair(image: Any, mask: np.ndarray, image_where: str, mask_where: str | None = None) -> None:
    """DecodeError naming both (``mask_where``: the mask's file, when it has its own) when ``mask`` is not
    the size of ``image``: a mask labels its image's pixels one for one."""
    h, w = image_size(image)
    if tuple(mask.shape) != (h, w):
        mask_name = f"its mask {mask_where}" if mask_where else "its mask"
        raise DecodeError(image_where, f"image is {w}x{h} (width x height) but {mask_name} is "
                                       f"{mask.shape[1]}x{mask.shape[0]}: a mask labels its image's pixels one for "
                                       "one; pair each image with its own mask (or resize the masks with "
                                       "nearest-neighbour first)")
