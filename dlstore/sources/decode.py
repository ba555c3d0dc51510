"""Decoding one source file the way torchvision's ``pil_loader`` does, with guards
(decompression bombs, 16-bit images, truncated files); the colour modes a store holds.

A store holds one (``L``) or three (``RGB``) uint8 channels. Every PIL mode maps to
one of them: the modes PIL derives from grayscale (``1``, ``L``, ``LA``, ``I``,
``F``, ``I;16``...) to ``L``, every other (``RGB``, ``RGBA``, ``P``, ``CMYK``,
``YCbCr``...) to ``RGB`` (``storable_mode``); ``as_mode`` converts with
``img.convert(mode)``, as torchvision's loader does for RGB."""

from __future__ import annotations

import os
import warnings

import numpy as np
from PIL import Image, ImageMode, ImageOps

from ..errors import ArgumentError, DecodeError

DEFAULT_MAX_PIXELS = Image.MAX_IMAGE_PIXELS  # PIL's decompression-bomb guard (~89.5 Mpx)
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
MODES = ("L", "RGB")  # what a store holds: one or three uint8 channels


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
            img = as_mode(img, mode)
            img.load()  # (a no-op after a conversion) the file closes below
            return img
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
