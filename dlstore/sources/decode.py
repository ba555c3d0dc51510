"""Decoding one source file the way torchvision's ``pil_loader`` does, with guards
(decompression bombs, 16-bit images, truncated files); the colour modes a store holds.

A store holds one (``L``) or three (``RGB``) uint8 channels. Every PIL mode maps to
one of them: the modes PIL derives from grayscale (``1``, ``L``, ``LA``, ``I``,
``F``, ``I;16``...) to ``L``, every other (``RGB``, ``RGBA``, ``P``, ``CMYK``,
``YCbCr``...) to ``RGB`` (``storable_mode``); ``as_mode`` converts with
``img.convert(mode)``, as torchvision's loader does for RGB.

A segmentation mask is decoded apart (``load_mask``): its values are class indices,
never converted to a colour mode (see ``mask_from_pil``)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import TypeVar

import numpy as np
from PIL import Image, ImageMode, ImageOps

from ..errors import ArgumentError, DecodeError

_T = TypeVar("_T")

DEFAULT_MAX_PIXELS = Image.MAX_IMAGE_PIXELS  # PIL's decompression-bomb guard (~89.5 Mpx)
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
MODES = ("L", "RGB")  # what a store holds: one or three uint8 channels
# PIL modes whose values are class indices as they stand (a palette's indices, gray levels, 16/32-bit ints)
MASK_MODES = ("1", "L", "P", "I", *_SIXTEEN_BIT_MODES)
MASK_MAX = 65535   # the largest class index a mask holds (uint16)


def check_mode(mode: str | None) -> str | None:
    """``mode`` if a store can hold it (None: chosen from the source); ArgumentError otherwise."""
    if mode is None or mode in MODES:
        return mode
    try:
        bands = f"{len(ImageMode.getmode(mode).bands)} channel(s)"
    except (KeyError, TypeError):
        bands = "not a PIL mode"
    raise ArgumentError(f"mode={mode!r} ({bands}): a store holds one or three uint8 channels, give mode "
                        "\"L\" (grayscale) or \"RGB\"; images of other modes are converted to it")


def storable_mode(pil_mode: str) -> str:
    """``"L"`` for the modes PIL derives from grayscale (``1``, ``LA``, ``I;16``...), else ``"RGB"``."""
    return "L" if ImageMode.getmode(pil_mode).basemode == "L" else "RGB"


def channels_of(mode: str) -> int:
    return 1 if mode == "L" else 3


def as_mode(img: Image.Image, mode: str | None = None) -> Image.Image:
    """``img.convert(mode)`` (default: its ``storable_mode``); 16-bit grayscale is scaled (``v >> 8``) first."""
    if img.mode in _SIXTEEN_BIT_MODES:
        img = _sixteen_to_eight(img)
    mode = mode or storable_mode(img.mode)
    return img if img.mode == mode else img.convert(mode)


def mode_fingerprint(mode: str) -> dict[str, str]:
    """The mode's part of a source's resume fingerprint. RGB, what a folder always is, adds nothing,
    so checkpoints without the key still match; an L conversion never resumes an RGB one."""
    return {} if mode == "RGB" else {"source_mode": mode}


def mode_conflict(where: str, what: str, channels: int, mode: str) -> str:
    """The message for an item (``what``: "a PIL RGBA image"; ``channels`` as stored) whose channels
    disagree with a source ``mode`` chosen from its first images."""
    return (f"{where}: is {what} ({channels} channel(s) once stored), but the source's mode was chosen as {mode} "
            f"({channels_of(mode)} channel(s)) from its first images; pass mode=\"RGB\" (--mode RGB) to store "
            "every image as RGB, or mode=\"L\" (--mode L) to store every image as grayscale")


def pil_loader(
    path: str | os.PathLike,
    *,
    exif_transpose: bool = False,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    mode: str | None = "RGB",
) -> Image.Image:
    """Open an image as torchvision's ``pil_loader`` does: ``Image.open(f).convert("RGB")``.

    Args:
        path: the image file.
        exif_transpose: rotate/flip by the EXIF orientation tag first. Off by
            default, because torchvision does not, and a store must hold the pixels
            the user's torchvision pipeline sees.
        max_pixels: refuse images with more pixels (decompression-bomb guard; the
            size is read from the header, before decoding). None: no limit.
        mode: ``"RGB"`` or ``"L"``: ``convert(mode)``; None: the image's ``storable_mode``.

    One deliberate difference: a 16-bit grayscale image (PNG mode ``I;16``)
    is scaled to 8 bits (``v >> 8``) before ``convert(mode)``. PIL's own
    conversion clips every value above 255, so torchvision turns such an image
    almost white.

    Raises:
        DecodeError: naming the file, if it cannot be opened, is too large, or
            cannot be decoded in full.
    """
    return _decode(path, exif_transpose, max_pixels, "image", lambda img: as_mode(img, mode))


def _decode(path: str | os.PathLike, exif_transpose: bool, max_pixels: int | None, what: str,
            finish: Callable[[Image.Image], _T]) -> _T:
    """Open ``path`` with the guards of ``pil_loader``, then ``finish(img)`` while the file is open."""
    try:
        with open(path, "rb") as f:
            with warnings.catch_warnings():
                # dlstore applies its own limit below; PIL's warning would only repeat it.
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                img = _open_unguarded(f) if max_pixels is None or max_pixels > 2 * DEFAULT_MAX_PIXELS \
                    else Image.open(f)
            width, height = img.size
            if max_pixels is not None and width * height > max_pixels:
                raise DecodeError(str(path), f"{what} is {width}x{height} = {width * height:,} pixels, over the "
                                             f"limit of {max_pixels:,} (decompression-bomb guard); raise it "
                                             "with --max-pixels if the image is genuine")
            if exif_transpose:
                img = ImageOps.exif_transpose(img)
            out = finish(img)
            if isinstance(out, Image.Image):
                out.load()  # (a no-op after a conversion) the file closes below
            return out
    except DecodeError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        # PIL reports truncated/corrupt data as OSError or SyntaxError, bad modes as ValueError.
        reason = str(exc) or type(exc).__name__
        raise DecodeError(str(path), f"cannot decode {what} ({type(exc).__name__}: {reason})") from exc


def load_mask(
    path: str | os.PathLike,
    *,
    exif_transpose: bool = False,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
) -> np.ndarray:
    """Decode a segmentation mask file into its class indices: a (H, W) uint8 array, uint16 when a
    value exceeds 255 (see ``mask_from_pil`` for the modes).

    Opened with the same guards as ``pil_loader`` (``max_pixels``, ``exif_transpose``: give both
    files of a pair the same options, so the mask turns with its image).

    Raises:
        DecodeError: naming the file, if it cannot be decoded, is too large, or is not a mask
            (a colour image, values outside 0..65535).
    """
    return _decode(path, exif_transpose, max_pixels, "mask", lambda img: mask_from_pil(img, str(path)))


def mask_from_pil(img: Image.Image, where: str) -> np.ndarray:
    """The class indices of a PIL mask, as ``v2.PILToTensor`` reads them, never colour-converted.

    A palette (``P``) image keeps its indices (its palette only colours them for display),
    ``L`` and 16-bit (``I;16``) images their values, a bilevel (``1``) image becomes 0/1, a 32-bit
    ``I`` image its values when they lie in 0..65535. Result: (H, W) uint8, or uint16 when a value
    exceeds 255.

    Raises:
        DecodeError: naming ``where``, for a colour mode (RGB, RGBA, LA ...: colour-coded masks must be
            mapped to indices first) or values outside 0..65535.
    """
    if img.mode not in MASK_MODES:
        raise DecodeError(where, f"a {img.mode} image is not a mask of class indices (expected a palette P, L, "
                                 "or 16-bit PNG); map colour-coded classes to indices first (the palette's "
                                 "colours stay in the file, its indices are the classes)")
    try:
        values = np.asarray(img)
    except (OSError, SyntaxError) as exc:   # a lazily opened file that cannot be decoded
        raise DecodeError(where, f"cannot decode mask ({type(exc).__name__}: {exc})") from exc
    if values.dtype == np.bool_:
        return values.astype(np.uint8)
    low, high = (int(values.min()), int(values.max())) if values.size else (0, 0)
    if low < 0 or high > MASK_MAX:
        raise DecodeError(where, f"mask values {low}..{high}: a mask holds class indices 0..{MASK_MAX}")
    dtype = np.uint8 if high <= 255 else np.uint16
    return np.ascontiguousarray(values, dtype=dtype)


def _open_unguarded(f) -> Image.Image:
    """``Image.open`` without PIL's hard 2x-limit error (the caller checks the size itself)."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        return Image.open(f)
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def _sixteen_to_eight(img: Image.Image) -> Image.Image:

    values = np.asarray(img).astype(np.uint16)
    return Image.fromarray((values >> 8).astype(np.uint8), mode="L")
