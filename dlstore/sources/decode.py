"""Decoding one source file the way torchvision's ``pil_loader`` does, with guards
(decompression bombs, 16-bit images, truncated files)."""

from __future__ import annotations

import os
import warnings

import numpy as np
from PIL import Image, ImageOps

from ..errors import DecodeError

DEFAULT_MAX_PIXELS = Image.MAX_IMAGE_PIXELS  # PIL's decompression-bomb guard (~89.5 Mpx)
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


def pil_loader(
    path: str | os.PathLike,
    *,
    exif_transpose: bool = False,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
) -> Image.Image:
    """Open an image as torchvision's ``pil_loader`` does: ``Image.open(f).convert("RGB")``.

    Args:
        path: the image file.
        exif_transpose: rotate/flip by the EXIF orientation tag first. Off by
            default, because torchvision does not, and a store must hold the pixels
            the user's torchvision pipeline sees.
        max_pixels: refuse images with more pixels (decompression-bomb guard; the
            size is read from the header, before decoding). None: no limit.

    One deliberate difference: a 16-bit grayscale image (PNG mode ``I;16``)
    is scaled to 8 bits (``v >> 8``) before ``convert("RGB")``. PIL's own
    conversion clips every value above 255, so torchvision turns such an image
    almost white.

    Raises:
        DecodeError: naming the file, if it cannot be opened, is too large, or
            cannot be decoded in full.
    """
    try:
        with open(path, "rb") as f:
            with warnings.catch_warnings():
                # dlstore applies its own limit below; PIL's warning would only repeat it.
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                img = _open_unguarded(f) if max_pixels is None or max_pixels > 2 * DEFAULT_MAX_PIXELS \
                    else Image.open(f)
            width, height = img.size
            if max_pixels is not None and width * height > max_pixels:
                raise DecodeError(str(path), f"image is {width}x{height} = {width * height:,} pixels, over the "
                                             f"limit of {max_pixels:,} (decompression-bomb guard); raise it "
                                             "with --max-pixels if the image is genuine")
            if exif_transpose:
                img = ImageOps.exif_transpose(img)
            if img.mode in _SIXTEEN_BIT_MODES:
                img = _sixteen_to_eight(img)
            return img.convert("RGB")
    except DecodeError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        # PIL reports truncated/corrupt data as OSError or SyntaxError, bad modes as ValueError.
        reason = str(exc) or type(exc).__name__
        raise DecodeError(str(path), f"cannot decode image ({type(exc).__name__}: {reason})") from exc


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
