"""Pure kernels shared by the read paths: the fused random-crop + horizontal-flip gather.

A batch of fixed-shape uint8 (C, H, W) samples is assembled in one copy from
a store's per-sample views, each sample cropped at its drawn window of the
(virtually) padded image and flipped if drawn so, without materialising the
padded or flipped images. The parameters are drawn elsewhere (``batch.py``,
exactly as ``BatchCompose([BatchRandomCrop, BatchRandomHorizontalFlip])``
draws them); these functions only move bytes, so they can be checked against
torchvision's ``F.pad`` / ``F.crop`` / ``F.horizontal_flip`` for the same
parameters.

Two kernels for the same result, chosen by output size:

* ``crop_flip_loop``: per sample, one slice copy (large images: the copy dominates);
* ``crop_flip_windows``: vectorised, no per-sample Python (small images).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

# Below this many pixels per sample numpy's strided copy flips faster than a torch flip
# (per-call overhead dominates); above it torch's vectorised flip wins (measured, 2-core CPU).
TORCH_FLIP_MIN_PIXELS = 4096
# Up to this many output pixels per sample the fused crop/flip runs vectorised (three passes,
# no per-sample Python); above it a per-sample loop of single slice copies is faster.
VECTORISED_MAX_PIXELS = 64 * 64

Padding = tuple[int, int, int, int]   # (left, top, right, bottom), as BatchRandomCrop.padding
# The padded buffer of crop_flip_windows and what it was made for: ((C, pH, pW, fill), buffer).
Scratch = tuple[tuple[int, int, int, int], np.ndarray]


def crop_flip_loop(views: Iterable[np.ndarray], out: np.ndarray, tops: np.ndarray, lefts: np.ndarray,
                   flips: np.ndarray, padding: Padding, fill: int) -> np.ndarray:
    """Crop + flip sample by sample into ``out`` (B, C, th, tw).

    Args:
        views: the B samples, uint8 (C, H, W) arrays of one shape.
        out: the (B, C, th, tw) uint8 output, filled in place and returned.
        tops, lefts: (B,) window offsets in the padded image.
        flips: (B,) bools, flip after cropping.
        padding: (left, top, right, bottom) constant padding around each image.
        fill: the padding value.
    """
    th, tw = out.shape[2:]
    views = iter(views)
    first = next(views, None)
    if first is None:
        return out
    h, w = first.shape[1:]
    torch_flip = th * tw >= TORCH_FLIP_MIN_PIXELS
    # Window of every sample in image coordinates, its part inside the image (s*) and where
    # that part lands in the output (d*), computed for the whole batch at once.
    y = tops.astype(np.int64) - padding[1]
    x = lefts.astype(np.int64) - padding[0]
    sy0, sy1 = np.maximum(y, 0), np.minimum(y + th, h)
    sx0, sx1 = np.maximum(x, 0), np.minimum(x + tw, w)
    dy0, dy1, dx0, dx1 = sy0 - y, sy1 - y, sx0 - x, sx1 - x
    # a flipped sample is read from its flipped image, where the window is mirrored
    fsx0, fsx1 = np.where(flips, w - sx1, sx0), np.where(flips, w - sx0, sx1)
    fdx0, fdx1 = np.where(flips, tw - dx1, dx0), np.where(flips, tw - dx0, dx1)
    empty = (sy1 <= sy0) | (sx1 <= sx0)                          # window wholly in the padding
    rows = zip(sy0.tolist(), sy1.tolist(), fsx0.tolist(), fsx1.tolist(), dy0.tolist(), dy1.tolist(),
               fdx0.tolist(), fdx1.tolist(), flips.tolist(), empty.tolist())

    def all_views() -> Iterable[np.ndarray]:
        yield first
        yield from views

    for j, (view, r) in enumerate(zip(all_views(), rows)):
        a0, a1, b0, b1, e0, e1, f0, f1, flipped, nothing = r
        oj = out[j]
        if nothing:
            oj[...] = fill
            continue
        # padding: fill only the strips the image does not cover
        if e0:
            oj[:, :e0] = fill
        if e1 < th:
            oj[:, e1:] = fill
        if f0:
            oj[:, e0:e1, :f0] = fill
        if f1 < tw:
            oj[:, e0:e1, f1:] = fill
        view = np.asarray(view)   # a plain ndarray: slicing a np.memmap runs Python code
        if flipped:
            # torch flips a whole contiguous sample ~2x faster than a strided window (measured)
            if torch_flip and view.flags.writeable and view.flags.c_contiguous:
                view = torch.from_numpy(view).flip(-1).numpy()
            else:
                view = view[..., ::-1]
        oj[:, e0:e1, f0:f1] = view[:, a0:a1, b0:b1]
    return out


def crop_flip_windows(read: Callable[[np.ndarray], np.ndarray], idx: np.ndarray, shape: tuple[int, int, int],
                      size: tuple[int, int], tops: np.ndarray, lefts: np.ndarray, flips: np.ndarray,
                      padding: Padding, fill: int, scratch: Scratch | None = None
                      ) -> tuple[torch.Tensor, Scratch]:
    """Vectorised crop + flip: no per-sample Python.

    The samples are gathered into a padded scratch buffer, flipped ones flipped
    on the way; then one fancy index over a strided view of every crop window
    copies each sample's window into the batch.

    Args:
        read: ``read(indices)`` returns those samples as one (k, C, H, W) uint8 array.
        idx: (B,) sample indices.
        shape: (C, H, W) of every sample.
        size: (th, tw) of the output.
        tops, lefts, flips, padding, fill: as in ``crop_flip_loop``.
        scratch: a buffer returned by an earlier call, reused when it fits.

    Returns:
        (the (B, C, th, tw) batch, the scratch buffer to pass next time).
    """
    b = len(idx)
    c, h, w = shape
    th, tw = size
    left, top, right, bottom = padding
    ph, pw = h + top + bottom, w + left + right
    key = (c, ph, pw, fill)
    if scratch is None or scratch[0] != key or len(scratch[1]) < b:
        scratch = (key, np.full((b, c, ph, pw), fill, dtype=np.uint8))   # the border stays `fill`
    buf = scratch[1]
    # flipped samples go to the end of the buffer; pos[j] is where sample j went
    order = np.argsort(flips, kind="stable")
    n_plain = b - int(flips.sum())
    pos = np.empty(b, dtype=np.int64)
    pos[order] = np.arange(b)
    # torch's copy_ into the strided interior is ~2x numpy's for short rows (measured)
    interior = torch.from_numpy(buf)[:, :, top:top + h, left:left + w]
    if n_plain:
        interior[:n_plain].copy_(torch.from_numpy(read(idx[order[:n_plain]])))
    if n_plain < b:
        interior[n_plain:b].copy_(torch.from_numpy(read(idx[order[n_plain:]])).flip(-1))
    # a flipped sample's window, read from its flipped image, starts at pw - tw - left
    x = np.where(flips, pw - tw - lefts, lefts)
    sb, sc, sh, sw = buf.strides
    windows = np.lib.stride_tricks.as_strided(
        buf, shape=(len(buf), ph - th + 1, pw - tw + 1, c, th, tw), strides=(sb, sh, sw, sc, sh, sw),
        writeable=False)
    return torch.from_numpy(windows[pos, tops, x]), scratch
