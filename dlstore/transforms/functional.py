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

* ``crop_flip_loop``: per sample, the padding strips then one slice copy (large images:
  the copy dominates);
* ``crop_flip_windows``: vectorised, no per-sample Python (small images).

The per-sample loop holds the GIL between its 2-3 numpy calls a sample, so loader threads
barely scale on it; ``compiled.crop_flip`` (numba, the ``fast`` extra) does the batch in one
GIL-free call and is what the readers use where numba imports. These kernels stay the
reference path and the fallback (docs/reading.md, "The pure kernels", has their costs and
the alternatives tried).

And the resampling kernel of ``BatchRandomResizedCrop``: ``resized_crop``
(torchvision's kernel per sample on the CPU, ``resized_crop_matmul`` elsewhere)
with the weights of ``resize_weights``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

# Up to this many output pixels per sample the fused crop/flip runs vectorised (three passes,
# no per-sample Python); above it a per-sample loop of single slice copies is faster.
VECTORISED_MAX_PIXELS = 64 * 64

Padding = tuple[int, int, int, int]   # (left, top, right, bottom), as BatchRandomCrop.padding
# The padded buffer of crop_flip_windows and what it was made for: (key, buffer).
Scratch = tuple[tuple[int, ...], np.ndarray]
# Unsigned words of n bytes: (native, byte-swapped). A row read as byte-swapped words in reverse
# order and stored as native words is the row reversed, in one cast copy per window.
_WORDS = {n: (np.dtype(f"u{n}"), np.dtype(f"u{n}").newbyteorder()) for n in (1, 2, 4, 8)}


def _word_bytes(width: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that fits in ``width`` bytes."""
    return 8 if width >= 8 else 4 if width >= 4 else 2 if width >= 2 else 1


def copy_reversed(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[..., k] = src[..., -1 - k]`` for uint8 arrays of one shape: each row copied reversed.

    numpy copies a negative-stride row byte by byte; read as byte-swapped 8-byte words in
    reverse order it is one cast copy, close to a plain copy's speed. A row whose width is
    not a multiple of the word takes one more word per row, overlapping the rest.
    """
    width = src.shape[-1]
    if width == 0 or dst.size == 0:
        return
    if src.itemsize != 1 or src.strides[-1] != 1 or dst.strides[-1] != 1:   # no word view
        np.copyto(dst, src[..., ::-1])
        return
    n = _word_bytes(width)
    native, swapped = _WORDS[n]
    m = width - width % n
    np.copyto(dst[..., :m].view(native), src[..., width - m:].view(swapped)[..., ::-1])
    if m < width:
        np.copyto(dst[..., width - n:].view(native), src[..., :n].view(swapped))


def crop_flip_loop(views: Iterable[np.ndarray], out: np.ndarray, tops: np.ndarray, lefts: np.ndarray,
                   flips: np.ndarray, padding: Padding, fill: int) -> np.ndarray:
    """Crop + flip sample by sample into ``out`` (B, C, th, tw).

    Per sample, two or three GIL-free numpy calls: a sample that shows any padding is set
    to ``fill`` whole, then its part of the image is copied over it, reversed by
    :func:`copy_reversed` if flipped (a third call where a row is not a whole number of
    8-byte words): a few microseconds of Python a sample, the GIL held.

    Args:
        views: the B samples, uint8 (C, H, W) arrays of one shape.
        out: the (B, C, th, tw) uint8 output, filled in place and returned.
        tops, lefts: (B,) window offsets in the padded image.
        flips: (B,) bools, flip after cropping.
        padding: (left, top, right, bottom) constant padding around each image.
        fill: the padding value.
    """
    th, tw = out.shape[2:]
    views = [np.asarray(v) for v in views]   # plain ndarrays: slicing a np.memmap runs Python code
    if not views:
        return out
    h, w = views[0].shape[1:]
    # Window of every sample in image coordinates, its part inside the image (s*) and where
    # that part lands in the output (d*), computed for the whole batch at once.
    y = tops.astype(np.int64) - padding[1]
    x = lefts.astype(np.int64) - padding[0]
    sy0, sy1 = np.maximum(y, 0), np.minimum(y + th, h)
    sx0, sx1 = np.maximum(x, 0), np.minimum(x + tw, w)
    dy0, dy1, dx0, dx1 = sy0 - y, sy1 - y, sx0 - x, sx1 - x
    # a flipped sample's image part lands mirrored
    fdx0, fdx1 = np.where(flips, tw - dx1, dx0), np.where(flips, tw - dx0, dx1)
    empty = (sy1 <= sy0) | (sx1 <= sx0)                          # window wholly in the padding
    padded = empty | (dy0 > 0) | (dy1 < th) | (dx0 > 0) | (dx1 < tw)
    rows = zip(views, sy0.tolist(), sy1.tolist(), sx0.tolist(), sx1.tolist(), dy0.tolist(), dy1.tolist(),
               fdx0.tolist(), fdx1.tolist(), flips.tolist(), padded.tolist(), empty.tolist())
    for oj, (view, a0, a1, b0, b1, e0, e1, f0, f1, flipped, strips, nothing) in zip(out, rows):
        # The strips: the whole sample set to `fill`, then the pixels copied over it. One
        # contiguous memset leaves the sample in the cache for the copy; filling only the
        # strips, a few bytes in each of hundreds of rows, costs more.
        if strips:
            oj[...] = fill
        if nothing:
            continue
        if flipped:
            copy_reversed(oj[:, e0:e1, f0:f1], view[:, a0:a1, b0:b1])
        else:
            oj[:, e0:e1, f0:f1] = view[:, a0:a1, b0:b1]
    return out


def crop_flip_windows(plain: np.ndarray | None, flipped: np.ndarray | None, shape: tuple[int, int, int],
                      size: tuple[int, int], tops: np.ndarray, lefts: np.ndarray, flips: np.ndarray,
                      padding: Padding, fill: int, scratch: Scratch | None = None
                      ) -> tuple[torch.Tensor, Scratch]:
    """Vectorised crop + flip: no per-sample Python.

    The samples are gathered into a padded scratch buffer, flipped ones flipped
    on the way; then one fancy index over a strided view of every crop window
    copies each sample's window into the batch.

    Args:
        plain: the samples not flipped, in batch order, as one (k, C, H, W) uint8 array (None: none).
        flipped: the samples to flip, likewise (None: none).
        shape: (C, H, W) of every sample.
        size: (th, tw) of the output.
        tops, lefts, flips, padding, fill: as in ``crop_flip_loop``.
        scratch: a buffer returned by an earlier call, reused when it fits.

    Returns:
        (the (B, C, th, tw) batch, the scratch buffer to pass next time).
    """
    b = len(flips)
    c, h, w = shape
    th, tw = size
    left, top, right, bottom = padding
    ph, pw = h + top + bottom, w + left + right
    # The image sits at column `side` of a buffer padded by `side` on both sides: a plain
    # sample's padded image starts `side - left` columns in, a flipped one's (whose left
    # padding is `right`) `side - right` columns in, and both fit whatever the asymmetry.
    side = max(left, right)
    bw = w + 2 * side
    key = (c, h, w, top, bottom, side, fill)
    if scratch is None or scratch[0] != key or len(scratch[1]) < b:
        scratch = (key, np.full((b, c, ph, bw), fill, dtype=np.uint8))   # the border stays `fill`
    buf = scratch[1]
    # flipped samples go to the end of the buffer; pos[j] is where sample j went
    order = np.argsort(flips, kind="stable")
    n_plain = b - int(flips.sum())
    pos = np.empty(b, dtype=np.int64)
    pos[order] = np.arange(b)
    # torch's copy_ into the strided interior is faster than numpy's for short rows
    interior = torch.from_numpy(buf)[:, :, top:top + h, side:side + w]
    if n_plain:
        interior[:n_plain].copy_(torch.from_numpy(plain))
    if n_plain < b:
        interior[n_plain:b].copy_(torch.from_numpy(flipped).flip(-1))
    # flip(crop(pad(x), left=l)) = crop(flip(pad(x)), left=pw - tw - l), and flip(pad(x)) is the
    # flipped image with `right` columns of padding on its left
    x = np.where(flips, pw - tw - lefts + side - right, lefts + side - left)
    sb, sc, sh, sw = buf.strides
    windows = np.lib.stride_tricks.as_strided(
        buf, shape=(len(buf), ph - th + 1, bw - tw + 1, c, th, tw), strides=(sb, sh, sw, sc, sh, sw),
        writeable=False)
    return torch.from_numpy(windows[pos, tops, x]), scratch


def resize_weights(out_size: int, in_size: int, start: torch.Tensor, length: torch.Tensor, *,
                   antialias: bool) -> torch.Tensor:
    """Per-sample bilinear resampling matrices along one axis, as ``torch.nn.functional.interpolate``.

    Row ``i`` of sample ``b`` holds the weights with which output pixel ``i`` mixes
    the input pixels ``start[b] .. start[b] + length[b] - 1`` (the crop; every
    other column is 0) when the crop is resized to ``out_size`` with
    ``mode="bilinear", align_corners=False`` and ``antialias``: without it, two
    taps at ``scale * (i + 0.5) - 0.5`` (clamped at the crop's edges); with it,
    PyTorch's antialiased triangle filter, widened by the scale when shrinking
    and renormalised at the edges (``_compute_weights_aa`` in ATen). Computed in
    float32, as ATen computes them for float images. Dense: B * out_size *
    in_size floats (256 x 224 x 500 x 4 B = 115 MB).

    Args:
        out_size: output pixels along the axis.
        in_size: input pixels along the axis (the whole image).
        start, length: (B,) int tensors, the crop along the axis.
        antialias: as ``interpolate(..., antialias=antialias)``.

    Returns:
        A (B, out_size, in_size) float32 tensor on ``start``'s device.
    """
    device, f32 = start.device, torch.float32
    start = start.to(f32)[:, None, None]
    length = length.to(f32)[:, None, None]
    scale = length / out_size                                                  # (B, 1, 1)
    i = torch.arange(out_size, device=device, dtype=f32)[None, :, None]        # (1, out, 1)
    j = torch.arange(in_size, device=device, dtype=f32)[None, None, :] - start  # (B, 1, in): crop coordinates
    if antialias:
        shrink = scale >= 1.0
        support = torch.where(shrink, scale, torch.ones_like(scale))   # interp_size / 2 = 1, times the scale
        invscale = torch.where(shrink, 1.0 / scale, torch.ones_like(scale))
        center = scale * (i + 0.5)                                         # (B, out, 1)
        lo = torch.clamp_min(torch.trunc(center - support + 0.5), 0)
        hi = torch.minimum(torch.trunc(center + support + 0.5), length)
        # triangle filter, in place on one (B, out, in) buffer
        w = (j - center).add_(0.5).mul_(invscale).abs_().neg_().add_(1.0).clamp_min_(0)
        w.mul_((j >= lo) & (j < hi))
        total = w.sum(-1, keepdim=True)
        return w.div_(torch.where(total == 0, torch.ones_like(total), total))
    src = torch.clamp_min(scale * (i + 0.5) - 0.5, 0)                     # (B, out, 1)
    i0 = torch.trunc(src)
    lam = (src - i0).clamp_(0, 1)
    i1 = i0 + (i0 < length - 1).to(f32)
    return (j == i0).to(f32).mul_(1.0 - lam).add_((j == i1).to(f32).mul_(lam))


def resized_crop(images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, height: torch.Tensor,
                 width: torch.Tensor, size: tuple[int, int], *, antialias: bool, kernel: str = "v2") -> torch.Tensor:
    """Crop every sample at its own box and resize it to ``size``, bilinear, as ``F.resized_crop``.

    On the CPU this runs torchvision's own kernel sample by sample (bit-identical
    by construction: its native uint8 kernel touches only the taps it needs, which a
    dense batched matmul cannot). Elsewhere (CUDA) it runs :func:`resized_crop_matmul`,
    which is what torchvision computes on CUDA up to the order of float32 sums.

    Args:
        images: (B, C, H, W) tensor.
        top, left, height, width: (B,) int tensors, each sample's crop box.
        size: (out_h, out_w).
        antialias: as ``F.resized_crop(..., antialias=antialias)``.
        kernel: ``"v2"`` (torchvision.transforms.v2's kernel) or ``"v1"`` (torchvision.transforms'),
            on the CPU (see ``resized_crop_one``).
    """
    if images.device.type != "cpu":
        return resized_crop_matmul(images, top, left, height, width, size, antialias=antialias)
    boxes = zip(top.tolist(), left.tolist(), height.tolist(), width.tolist())
    out = torch.empty((len(images), images.shape[1], *size), dtype=images.dtype)
    for j, (t, l, h, w) in enumerate(boxes):
        out[j] = resized_crop_one(images[j], t, l, h, w, size, antialias=antialias, kernel=kernel)
    return out


def resized_crop_one(image: torch.Tensor, top: int, left: int, height: int, width: int, size: Sequence[int], *,
                     antialias: bool, kernel: str = "v2") -> torch.Tensor:
    """One (C, H, W) image's box resized to ``size``, bilinear, by torchvision's v2 kernel
    (``F.resized_crop_image``: uint8 resampled with fixed-point weights) or its v1 kernel
    (``torchvision.transforms.functional.resized_crop``: float32, rounded back), bit for bit."""
    if kernel == "v1":
        import torchvision.transforms.functional as F1

        return F1.resized_crop(image, top, left, height, width, list(size), antialias=antialias)
    from torchvision.transforms.v2 import functional as F

    return F.resized_crop_image(image, top, left, height, width, list(size), antialias=antialias)


def resized_crop_matmul(images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, height: torch.Tensor,
                        width: torch.Tensor, size: tuple[int, int], *, antialias: bool) -> torch.Tensor:
    """``resized_crop`` for the whole batch as two batched matmuls with :func:`resize_weights`.

    Float input: equals ``F.resized_crop`` on float input up to float32 rounding
    (the same weights; only the order of the sums differs, a difference tests bound on the
    0-255 scale). uint8 input is resampled in float32 and rounded,
    as torchvision does on CUDA; torchvision's CPU uint8 kernel (fixed-point
    weights, rounding to uint8 between its horizontal and vertical pass) can
    differ from that by 1 (never more).
    """
    h, w = images.shape[-2:]
    device = images.device
    wy = resize_weights(size[0], h, top.to(device), height.to(device), antialias=antialias)
    wx = resize_weights(size[1], w, left.to(device), width.to(device), antialias=antialias)
    x = images if images.dtype == torch.float32 else images.to(torch.float32)
    # horizontal pass first, as torch's separable kernel: (B, C, H, W) @ (B, 1, W, out_w)
    out = torch.matmul(x, wx.transpose(1, 2)[:, None])
    out = torch.matmul(wy[:, None], out)                                       # (B, C, out_h, out_w)
    if images.dtype == torch.uint8:
        return out.round_().clamp_(0, 255).to(torch.uint8)
    return out.to(images.dtype)
