"""Batch transforms: per-sample random parameters, whole-batch tensor kernels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import TransformSpecError
from .boxes import random_resized_boxes
from .cpu_kernels import cutout_samples, flip_samples, numpy_view
from .static import PADDING_MODES, size_pair

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

    if not isinstance(images, torch.Tensor) or images.ndim != 4:
        got = f"{type(images).__name__} of shape {tuple(images.shape)}" if hasattr(images, "shape") \
            else type(images).__name__
        raise TransformSpecError(f"{name} takes a (B, C, H, W) tensor, got {got}")


def _check_generator(generator: Any, device: Any, name: str) -> None:
    if generator is not None and generator.device.type != device.type:
        raise TransformSpecError(
            f"{name}: the generator is on {generator.device} but the images are on {device}; "
            f"use torch.Generator(device={str(device)!r})")


def as_padding(padding: Any) -> tuple[int, int, int, int]:
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


def as_fill(fill: Any, name: str) -> int | float | tuple[float, ...]:
    """A fill value: one number, or one number per channel (a tuple)."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if number(fill):
        return fill
    if isinstance(fill, (list, tuple)) and fill and all(number(v) for v in fill):
        return fill[0] if len(fill) == 1 else tuple(fill)
    raise TransformSpecError(f"{name}: fill must be a number or one number per channel, got {fill!r}")


def _randints(highs: Sequence[Any], n: int, generator: Any, device: Any) -> list["torch.Tensor"]:
    """Per high (an int or a (n,) tensor >= 1), n ints uniform in [0, high[k]) from one float64 draw each."""
    # On the CPU one torch call for all (it fills serially: rand(2n) is rand(n), rand(n); a test
    # holds torch to it), the arithmetic in numpy: each torch call lets go of the GIL and waits to
    # take it back, 0.1-0.2 ms a batch in a loader thread beside another.
    u = torch.rand(len(highs) * n, generator=generator, device=device, dtype=torch.float64).numpy() \
        if device is not None and torch.device(device).type == "cpu" else None
    out = []
    for k, high in enumerate(highs):
        if u is not None:
            top = high.numpy() if isinstance(high, torch.Tensor) else int(high)
            v = (u[k * n:(k + 1) * n] * top).astype(np.int64)
            out.append(torch.from_numpy(np.minimum(v, np.asarray(top) - 1, out=v)))
        else:   # a Python int: no host-to-device copy (and on CUDA no sync) per draw; the same values
            top = high if isinstance(high, torch.Tensor) else int(high)
            out.append((torch.rand(n, generator=generator, device=device, dtype=torch.float64) * top)
                       .long().clamp_max(top - 1))
    return out


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

    Equivalent to ``v2.RandomCrop(size, padding, pad_if_needed, fill, padding_mode)``
    applied to each sample: the same padding, the same offsets for the same
    draws (uniform over every valid window, as torchvision's ``randint``). Runs
    as one pad plus one gather over the batch.

    Args:
        size: output (height, width), or an int for a square.
        padding: int, [left/right, top/bottom] or [left, top, right, bottom], as torchvision.
        pad_if_needed: pad an image smaller than ``size`` (after ``padding``) on both
            sides by the difference, as torchvision does.
        fill: value of the padded pixels with ``padding_mode="constant"``: a number,
            or one number per channel.
        padding_mode: "constant", "edge", "reflect" or "symmetric".
    """

    def __init__(self, size: int | Sequence[int], padding: Any = 0, *, pad_if_needed: bool = False,
                 fill: int | float | Sequence[float] = 0, padding_mode: str = "constant"):
        self.size = tuple(size_pair(list(size) if isinstance(size, tuple) else size, "BatchRandomCrop"))
        self.padding = as_padding(padding)
        if padding_mode not in PADDING_MODES:
            raise TransformSpecError(
                f"BatchRandomCrop: unknown padding_mode {padding_mode!r}; valid: {', '.join(PADDING_MODES)}")
        self.fill = as_fill(fill, "BatchRandomCrop")
        if isinstance(self.fill, tuple) and padding_mode != "constant":
            raise TransformSpecError(f"BatchRandomCrop: a per-channel fill needs padding_mode='constant', "
                                     f"got {padding_mode!r}")
        self.pad_if_needed = bool(pad_if_needed)
        self.padding_mode = padding_mode

    def padding_for(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(left, top, right, bottom) padding of an image of (height, width), ``pad_if_needed`` included."""
        left, top, right, bottom = self.padding
        th, tw = self.size
        if self.pad_if_needed:
            dy = th - (height + top + bottom)
            dx = tw - (width + left + right)
            if dy > 0:
                top, bottom = top + dy, bottom + dy
            if dx > 0:
                left, right = left + dx, right + dx
        return left, top, right, bottom

    def sample(self, shape: Sequence[int], *, generator: Any = None, device: Any = "cpu") -> BatchParams:
        b, _, h, w = shape
        left, top, right, bottom = self.padding_for(h, w)
        ph, pw = h + top + bottom, w + left + right
        th, tw = self.size
        if th > ph or tw > pw:
            raise TransformSpecError(
                f"BatchRandomCrop: crop {th}x{tw} is larger than the padded image {ph}x{pw} "
                f"(image {h}x{w}, padding {list(self.padding)}); pass pad_if_needed=True to pad it")
        tops, lefts = _randints((ph - th + 1, pw - tw + 1), b, generator, device)
        return {"top": tops, "left": lefts}

    def apply(self, images: "torch.Tensor", params: BatchParams) -> "torch.Tensor":
        from torchvision.transforms.v2 import functional as F

        padding = self.padding_for(*images.shape[-2:])
        if any(padding):
            fill = list(self.fill) if isinstance(self.fill, tuple) else self.fill
            images = F.pad(images, list(padding), fill=fill, padding_mode=self.padding_mode)
        images = images.contiguous()
        b, c, ph, pw = images.shape
        th, tw = self.size
        # A strided view of every crop window, (B, Y, X, C, th, tw); indexing its first three
        # dims copies one window per sample, whole (C, th, tw) blocks at a time.
        sb, sc, sh, sw = images.stride()
        shape, strides = (b, ph - th + 1, pw - tw + 1, c, th, tw), (sb, sh, sw, sc, sh, sw)
        top, left = params["top"], params["left"]
        if images.device.type == "cpu" and images.dtype != torch.bfloat16 and not images.requires_grad:
            # numpy's fancy indexing copies the blocks faster than torch's indexing on the CPU
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
        extra = ", pad_if_needed=True" if self.pad_if_needed else ""
        return (f"BatchRandomCrop(size={list(self.size)}, padding={list(self.padding)}{extra}, fill={self.fill}, "
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
        u = torch.rand(shape[0], generator=generator, device=device)
        # on the CPU compared in numpy (see _randints), in float32 as torch compares it
        return {"flip": torch.from_numpy(u.numpy() < np.float32(self.p)) if u.device.type == "cpu" else u < self.p}

    def apply(self, images: "torch.Tensor", params: BatchParams) -> "torch.Tensor":
        array = numpy_view(images)
        if array is not None:       # one thread, off torch's intra-op pool (cpu_kernels)
            return flip_samples(array, params["flip"].cpu().numpy())
        flip = params["flip"].to(images.device)
        return torch.where(flip[:, None, None, None], images.flip(-1), images)

    def __repr__(self) -> str:
        return f"BatchRandomHorizontalFlip(p={self.p})"


class BatchRandomResizedCrop(BatchTransform):
    """Random crop of random area and aspect ratio, resized to a fixed ``size``, per sample.

    Parameters are drawn as ``v2.RandomResizedCrop`` draws them (up to 10 tries of
    a uniform area fraction in ``scale`` and a log-uniform aspect ratio in
    ``ratio``, then torchvision's centre-crop fallback), for every sample at once.
    The resize is bilinear with torchvision's weights (``functional.resized_crop``):

    * on the CPU, torchvision's own kernel per sample: identical to
      ``F.resized_crop(x, top, left, height, width, size, antialias=antialias)``;
    * on CUDA, one batched matmul with the same weights: float output equal to
      torchvision's up to float32 rounding (|d| <= 1e-3 on the 0-255 scale);
      uint8 output rounded from float32 as torchvision rounds on CUDA, at most
      1 level (|d| <= 1) from torchvision's CPU uint8 kernel (which uses
      fixed-point weights and rounds between its two passes).

    Args:
        size: output (height, width), or an int for a square.
        scale: range of the crop's area as a fraction of the image.
        ratio: range of the crop's aspect ratio (width / height).
        antialias: as torchvision's ``antialias`` (a triangle filter widened when shrinking).
        kernel: whose CPU kernel resamples: ``"v2"`` (``v2.functional.resized_crop``: uint8 resampled
            with fixed-point weights) or ``"v1"`` (``torchvision.transforms.functional.resized_crop``:
            in float32, rounded), each bit for bit; up to 1 level apart on uint8.
    """

    def __init__(self, size: int | Sequence[int], scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3), *, antialias: bool = True, kernel: str = "v2"):
        self.size = tuple(size_pair(list(size) if isinstance(size, tuple) else size, "BatchRandomResizedCrop"))
        if len(scale) != 2 or len(ratio) != 2 or scale[0] > scale[1] or ratio[0] > ratio[1] \
                or scale[0] <= 0 or ratio[0] <= 0:
            raise TransformSpecError(
                f"BatchRandomResizedCrop: scale and ratio must be increasing positive (min, max) pairs, "
                f"got scale={scale!r}, ratio={ratio!r}")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.antialias = bool(antialias)
        if kernel not in ("v1", "v2"):
            raise TransformSpecError(f"BatchRandomResizedCrop: kernel must be 'v1' or 'v2', got {kernel!r}")
        self.kernel = kernel

    def sample(self, shape: Sequence[int], *, generator: Any = None, device: Any = "cpu") -> BatchParams:
        b, _, height, width = shape
        return self.sample_sizes(torch.full((b,), height, dtype=torch.long, device=device),
                                 torch.full((b,), width, dtype=torch.long, device=device), generator=generator)

    def sample_sizes(self, heights: "torch.Tensor", widths: "torch.Tensor", *, generator: Any = None) -> BatchParams:
        """The boxes of samples of their own sizes, ``heights`` x ``widths`` ((B,) int tensors), drawn as
        ``sample`` draws them: what ``v2.RandomResizedCrop.get_params`` draws on each image."""
        return random_resized_boxes(heights, widths, self.scale, self.ratio, generator=generator)

    def apply(self, images: "torch.Tensor", params: BatchParams) -> "torch.Tensor":
        from .functional import resized_crop

        return resized_crop(images, params["top"], params["left"], params["height"], params["width"],
                            self.size, antialias=self.antialias, kernel=self.kernel)  # type: ignore[arg-type]

    def resize_one(self, image: "torch.Tensor", top: int, left: int, height: int, width: int) -> "torch.Tensor":
        """One (C, H, W) image's box resized to ``size`` by this op's kernel (as ``apply`` on the CPU)."""
        from .functional import resized_crop_one

        return resized_crop_one(image, top, left, height, width, self.size, antialias=self.antialias,
                                kernel=self.kernel)

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        return self.size  # type: ignore[return-value]

    def __repr__(self) -> str:
        kernel = ", kernel='v1'" if self.kernel == "v1" else ""
        return (f"BatchRandomResizedCrop(size={list(self.size)}, scale={self.scale}, "
                f"ratio=({self.ratio[0]:.4g}, {self.ratio[1]:.4g}), antialias={self.antialias}{kernel})")


class BatchCutout(BatchTransform):
    """Fill one ``size`` x ``size`` square per sample, placed uniformly inside the image.

    The square lies wholly inside the image (as airbench's cutout); per sample it
    equals ``F.erase(x, top, left, size, size, v=fill)``. One ``where`` over the batch.

    Args:
        size: side of the square.
        fill: a number, or one number per channel.
    """

    def __init__(self, size: int, *, fill: int | float | Sequence[float] = 0):
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise TransformSpecError(f"BatchCutout: size must be a positive int, got {size!r}")
        self.size = size
        self.fill = as_fill(fill, "BatchCutout")

    def sample(self, shape: Sequence[int], *, generator: Any = None, device: Any = "cpu") -> BatchParams:
        b, _, h, w = shape
        if self.size > min(h, w):
            raise TransformSpecError(f"BatchCutout: square {self.size} is larger than the image {h}x{w}")
        tops, lefts = _randints((h - self.size + 1, w - self.size + 1), b, generator, device)
        return {"top": tops, "left": lefts}

    def apply(self, images: "torch.Tensor", params: BatchParams) -> "torch.Tensor":
        array = numpy_view(images)
        if array is not None:       # one thread, off torch's intra-op pool (cpu_kernels)
            out = cutout_samples(array, images.dtype, params["top"].cpu().numpy(), params["left"].cpu().numpy(),
                                 self.size, self.fill)
            if out is not None:
                return out
        device = images.device
        h, w = images.shape[-2:]
        dy = torch.arange(h, device=device)[None, :] - params["top"].to(device)[:, None]    # (B, H)
        dx = torch.arange(w, device=device)[None, :] - params["left"].to(device)[:, None]   # (B, W)
        mask = ((dy >= 0) & (dy < self.size))[:, None, :, None] & ((dx >= 0) & (dx < self.size))[:, None, None, :]
        if not isinstance(self.fill, tuple):
            return images.masked_fill(mask, self.fill)
        # as F.erase: the values are cast to the images' dtype
        value = torch.tensor(self.fill, device=device).to(images.dtype).view(1, -1, 1, 1)
        return torch.where(mask, value, images)

    def __repr__(self) -> str:
        return f"BatchCutout(size={self.size}, fill={self.fill})"


class BatchNormalize(BatchTransform):
    """Convert to float and optionally normalise: ``v2.ToDtype(dtype, scale=True)`` + ``v2.Normalize``.

    Meant for the end of the pipeline, on the device: a float32 batch is 4x the
    bytes of uint8. The arithmetic runs in float32 (also for a float16 output,
    which is then exactly the rounded float32 result). With ``divide=True`` integer
    input is divided by its maximum, as torchvision v1's ``ConvertImageDtype`` and
    ``ToTensor`` do (v2's ``ToDtype(scale=True)`` multiplies by the reciprocal: one ulp
    apart on 378 of the 768 values of a uint8 channel).

    Args:
        mean: per-channel means (of the scaled values), or None for no normalisation.
        std: per-channel standard deviations; required with ``mean``.
        dtype: output dtype, a floating type (torch.float32, torch.float16, torch.bfloat16).
        scale: divide integer input by its maximum (255 for uint8), as ``ToDtype(scale=True)``.
        divide: scale by dividing (v1's arithmetic) rather than multiplying by the reciprocal.
    """

    def __init__(self, mean: Sequence[float] | None = None, std: Sequence[float] | None = None, *,
                 dtype: Any = None, scale: bool = True, divide: bool = False):

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
        self.divide = bool(divide)

    def scale_(self, x: "torch.Tensor", images: "torch.Tensor") -> "torch.Tensor":
        """``x`` (``images`` as a new float32 tensor) scaled in place as this op scales integer input."""
        if self.scale and not images.is_floating_point():
            top = torch.iinfo(images.dtype).max
            if self.divide:
                x.div_(float(top))
            else:
                x.mul_(1.0 / top)
        return x

    def apply(self, images: "torch.Tensor", params: BatchParams) -> "torch.Tensor":

        x = images.to(torch.float32)  # always a new tensor unless already float32
        if x is images:
            x = x.clone()
        if self.scale and not images.is_floating_point():
            self.scale_(x, images)
        elif self.mean is not None and not images.is_floating_point():
            # v2.Normalize refuses integer input too: normalising 0..255 with means of 0..1 values is
            # a pipeline that lost its ToDtype(scale=True) (e.g. a ToTensor look-alike that passed
            # the uint8 tensor through), and would train on values up to ~1100 without a word
            raise TransformSpecError(
                f"BatchNormalize(scale=False) got a {images.dtype} batch: Normalize needs float input; put "
                f"v2.ToDtype(torch.float32, scale=True) before Normalize")
        if self.mean is not None:
            mean = torch.as_tensor(self.mean, dtype=torch.float32, device=x.device).view(-1, 1, 1)
            std = torch.as_tensor(self.std, dtype=torch.float32, device=x.device).view(-1, 1, 1)
            if mean.numel() not in (1, x.shape[1]):
                raise TransformSpecError(
                    f"BatchNormalize: {mean.numel()} means for images of {x.shape[1]} channels")
            x.sub_(mean).div_(std)
        return x.to(self.dtype)

    def __repr__(self) -> str:
        divide = ", divide=True" if self.divide else ""
        return f"BatchNormalize(mean={self.mean}, std={self.std}, dtype={self.dtype}, scale={self.scale}{divide})"


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
