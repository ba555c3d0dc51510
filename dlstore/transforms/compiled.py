"""The fused crop + flip as one compiled, GIL-free pass (numba: the ``fast`` extra).

``crop_flip_loop`` (pure numpy) makes two or three numpy calls a sample and each
releases and retakes the GIL, so a second loader thread hardly gains (the threads hand
the GIL back and forth), and a flipped row goes through numpy's cast loop. This kernel
does a whole batch in one call with the GIL released, each sample in one pass: row by
row for a flipped sample (the padding as two vector stores, the image part copied in
reversed 32-byte vectors, inline: ``_numba_kernel.flip_row``); one memcpy per channel,
padding filled over it, for an unflipped full-width one (docs/reading.md has the rates
of both kernels).

The pixels are the pure kernel's (tests check both against torchvision's
``pad``/``crop``/``horizontal_flip``). numba is imported on first use, and the
kernel compiled then (about a second; less from numba's disk cache in later processes); without numba
or with ``DLSTORE_COMPILED=0`` in the environment ``available()`` is False and
the readers take the pure path.

The samples reach the kernel as addresses: every view must be a C-contiguous
uint8 (C, H, W) array, checked here, and the caller keeps the views alive for
the call (``views`` is a list it holds).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

Padding = tuple[int, int, int, int]   # (left, top, right, bottom)

_lock = threading.Lock()
_kernel: Any = None          # the compiled function, once built
_failed: str | None = None   # why numba cannot be used, once known


def available() -> bool:
    """True when the compiled kernel can run: numba imports and ``DLSTORE_COMPILED`` is not ``0``."""
    if os.environ.get("DLSTORE_COMPILED", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return _build() is not None


def built() -> bool:
    """True once the kernel is built in this process and not switched off: what code that must
    not pay for importing numba and building the kernel (a plain copy) checks, not ``available()``."""
    return _kernel is not None and available()


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    if os.environ.get("DLSTORE_COMPILED", "1").strip().lower() in ("0", "false", "no", "off"):
        return "DLSTORE_COMPILED=0 in the environment"
    _build()
    return _failed


def _build() -> Any:
    """The numba kernel, defined (lazily compiled by numba) on the first call; None without numba."""
    global _kernel, _failed
    if _kernel is not None or _failed is not None:
        return _kernel
    with _lock:
        if _kernel is None and _failed is None:
            try:
                kernel = _define()
            except ImportError as e:    # numba absent, or its llvmlite/numpy refused
                _failed = f"numba is not importable ({e}); pip install 'dlstore[fast]'"
                return None
            except Exception as e:  # noqa: BLE001 - numba imports but cannot define the kernel here
                _failed = f"numba could not define the kernel ({type(e).__name__}: {e})"
                warnings.warn(f"dlstore: {_failed}; using the pure crop+flip", RuntimeWarning, stacklevel=3)
                return None
            try:    # compile now (or load numba's disk cache) on a tiny batch, so that
                # a numba that imports but cannot compile here means the pure path, not an error
                src = np.arange(12, dtype=np.uint8).reshape(1, 3, 2, 2)
                out = np.empty((1, 12), np.uint8)
                one = np.zeros(1, np.int64)
                kernel(np.array([src.__array_interface__["data"][0]], np.uintp), out, one, one,
                       np.zeros(1, np.bool_), np.uint8(0), 3, 2, 2, 2, 2)
                if not np.array_equal(out.reshape(src.shape), src):
                    raise RuntimeError("the compiled kernel returned wrong pixels on a 2x2 test")
            except Exception as e:  # noqa: BLE001 - any failure to build means the pure path
                _failed = f"numba could not compile the kernel ({type(e).__name__}: {e})"
                warnings.warn(f"dlstore: {_failed}; using the pure crop+flip", RuntimeWarning, stacklevel=3)
                return None
            _kernel = kernel
    return _kernel


def _define() -> Any:
    from . import _numba_kernel

    return _numba_kernel.kernel


def crop_flip(views: Sequence[np.ndarray], out: np.ndarray, tops: np.ndarray, lefts: np.ndarray,
              flips: np.ndarray, padding: Padding, fill: int) -> np.ndarray:
    """``crop_flip_loop`` in one compiled call: the same arguments, the same pixels.

    Args:
        views: the B samples, C-contiguous uint8 (C, H, W) arrays of one shape, kept
            alive by the caller until this returns.
        out: the C-contiguous (B, C, th, tw) uint8 output, filled in place and returned.
        tops, lefts: (B,) window offsets in the padded image.
        flips: (B,) bools, flip after cropping.
        padding: (left, top, right, bottom) constant padding around each image.
        fill: the padding value, 0-255.

    Raises:
        RuntimeError: numba is not available (check :func:`available` first).
        ValueError: a view or ``out`` is not what the kernel reads and writes.
    """
    kernel = _build()
    if kernel is None:
        raise RuntimeError(f"the compiled crop+flip kernel is unavailable: {_failed}")
    b = len(views)
    if b == 0:
        return crop_flip_at(np.empty(0, np.uintp), (0, 0, 0), out, tops, lefts, flips, padding, fill)
    shape = views[0].shape
    addresses = np.empty(b, dtype=np.uintp)
    for k, v in enumerate(views):
        if v.dtype != np.uint8 or v.shape != shape or not v.flags.c_contiguous:
            raise ValueError(f"sample {k}: the compiled kernel reads C-contiguous uint8 {shape} "
                             f"samples, got {v.dtype} {v.shape}")
        addresses[k] = v.__array_interface__["data"][0]
    return crop_flip_at(addresses, shape, out, tops, lefts, flips, padding, fill)


def crop_flip_at(addresses: np.ndarray, shape: tuple[int, int, int], out: np.ndarray, tops: np.ndarray,
                 lefts: np.ndarray, flips: np.ndarray, padding: Padding, fill: int) -> np.ndarray:
    """:func:`crop_flip` of samples given by address (a reader's ``sample_addresses``).

    ``addresses[k]`` is where a C-contiguous uint8 sample of ``shape`` (C, H, W) starts;
    the caller keeps that memory mapped until this returns.
    """
    kernel = _build()
    if kernel is None:
        raise RuntimeError(f"the compiled crop+flip kernel is unavailable: {_failed}")
    b = len(addresses)
    if out.dtype != np.uint8 or out.ndim != 4 or not out.flags.c_contiguous or len(out) != b:
        raise ValueError(f"out must be a C-contiguous uint8 (B={b}, C, th, tw) array, "
                         f"got {out.dtype} {out.shape}")
    if b == 0 or out.size == 0:
        return out
    c, h, w = shape
    if out.shape[1] != c:
        raise ValueError(f"out has {out.shape[1]} channels, the samples {c}")
    if not 0 <= fill <= 255:
        raise ValueError(f"fill must be 0-255 for uint8 samples, got {fill}")
    if len(tops) != b or len(lefts) != b or len(flips) != b:
        raise ValueError(f"{b} samples but {len(tops)} tops, {len(lefts)} lefts, {len(flips)} flips")
    ys = np.asarray(tops, dtype=np.int64) - padding[1]
    xs = np.asarray(lefts, dtype=np.int64) - padding[0]
    kernel(np.ascontiguousarray(addresses, dtype=np.uintp), out.reshape(b, -1), ys, xs,
           np.ascontiguousarray(flips, dtype=np.bool_), np.uint8(fill), c, h, w, out.shape[2], out.shape[3])
    return out
