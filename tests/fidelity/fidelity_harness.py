"""The fidelity harness: torchvision's per-sample kernels are the reference for every read path.

Every dlstore path draws its random parameters through the ``sample`` method of
its batch transforms (``dlstore.transforms.batch``; the GPU loader's per-sample
wrapper has one too). The reference draws them again, from the same generator
state, with the same ops (``draw``), then runs torchvision's functional kernels
on each stored uint8 sample with those parameters (``reference``):

    BatchRandomCrop            F.pad(fill, padding_mode) + F.crop
    BatchRandomHorizontalFlip  F.horizontal_flip
    BatchRandomResizedCrop     F.resized_crop
    BatchCutout                F.erase
    BatchNormalize             F.to_dtype(scale) + F.normalize   (float32)
    _PerSample(op)             op itself, torch's generators seeded as the loader seeds them

then the GPU dataset's conversion where the path has one (``convert``), and
compares (``assert_same``): uint8 exactly; float against the float32 reference
within the bounds below.

Bounds (d = |path - reference|, on the output scale):

* ``FP16_REL``, ``FP16_ABS``: a float16 output is the float32 reference rounded
  once (round to nearest): d <= 2**-11 * |ref| in fp16's normal range and
  d <= 2**-25 below it (half an ulp). The harness also checks it is exactly
  ``ref.to(float16)`` where dlstore does the same float32 arithmetic as
  torchvision (ToDtype: ``to(float32).mul_(1/255)``; Normalize: ``sub``, ``div``).
* ``rrc_bound``: BatchRandomResizedCrop on already converted (fp16, normalised)
  data resamples the converted values rather than the uint8 pixels:
  d <= 1.05/(255 * min(std)) + 2**-10 * max|ref| + 1e-5. torchvision's uint8
  kernel is within 1 level of the exact resampling (it rounds between its two
  passes and at the end) plus the error of its fixed-point weights (< 0.05
  level); bilinear weights are >= 0 and sum to 1, so the fp16 inputs (each
  within half an ulp) and the fp16 output add at most 2**-10 * max|ref|.
  Measured: 0.0179 against a bound of 0.0205 (ImageNet mean/std, 20 seeds).
* bfloat16 (the device path's ``dtype=torch.bfloat16``): the float32 reference rounded once,
  d <= 2**-8 * |ref| (half an ulp of an 8-bit significand), and exactly ``ref.to(bfloat16)``.
* ``CUDA_RRC_LEVELS``: on CUDA the batched resampling rounds from float32 as
  torchvision does on CUDA; torchvision's CPU uint8 kernel may differ by 1 level.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torchvision.transforms.v2 import functional as F

import dlstore
from dlstore.data.gpu.loader import _PerSample
from dlstore.sources.demo import make_image_folder
from dlstore.transforms import (
    BatchCompose,
    BatchCutout,
    BatchNormalize,
    BatchRandomCrop,
    BatchRandomHorizontalFlip,
    BatchRandomResizedCrop,
)

FP16_REL = 2.0 ** -11
FP16_ABS = 2.0 ** -25
CUDA_RRC_LEVELS = 1
SUFFIXES = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}


def gen(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def make_store(root: Path, fmt: str, size: tuple[int, int], *, classes: int = 3, per_class: int = 4) -> Path:
    """A fixed-shape store of ``fmt`` holding ``classes * per_class`` distinct synthetic samples of ``size`` (H, W)."""
    h, w = size
    folder = root / f"images-{h}x{w}"
    if not folder.exists():
        make_image_folder(folder, classes=classes, per_class=per_class, size=(h + 2, w + 2), ext=".png")
    dst = root / f"{h}x{w}{SUFFIXES[fmt]}"
    if not dst.exists():
        dlstore.convert(folder, dst, static=f"center_crop={h}x{w}", workers=0, progress=False)
    return dst


def ops_of(t: Any) -> list[Any]:
    """The batch ops of a BatchCompose (or a single op, or a list)."""
    if isinstance(t, BatchCompose):
        return [o for x in t.transforms for o in ops_of(x)]
    if isinstance(t, (list, tuple)):
        return [o for x in t for o in ops_of(x)]
    return [t]


def out_shape(op: Any, shape: Sequence[int]) -> tuple[int, ...]:
    b, c, h, w = shape
    if hasattr(op, "output_size"):
        h, w = op.output_size(h, w)
    return (b, c, h, w)


def draw(ops: Sequence[Any], shape: Sequence[int], generator: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """The parameters ``ops`` draw, in order, for a batch of ``shape`` from ``generator`` (advanced)."""
    params = []
    for op in ops:
        params.append(op.sample(tuple(shape), generator=generator, device=generator.device))
        shape = out_shape(op, shape)
    return params


def _fill(fill: Any) -> Any:
    return list(fill) if isinstance(fill, tuple) else fill


def _reference_op(op: Any, p: dict[str, torch.Tensor], j: int, x: torch.Tensor) -> torch.Tensor:
    """torchvision's kernel for ``op`` on sample ``x`` (C, H, W) with sample ``j``'s parameters."""
    if isinstance(op, BatchRandomCrop):
        padding = op.padding_for(*x.shape[-2:])
        if any(padding):
            x = F.pad(x, list(padding), fill=_fill(op.fill), padding_mode=op.padding_mode)
        return F.crop(x, int(p["top"][j]), int(p["left"][j]), *op.size)
    if isinstance(op, BatchRandomHorizontalFlip):
        return F.horizontal_flip(x) if bool(p["flip"][j]) else x
    if isinstance(op, BatchRandomResizedCrop):
        box = [int(p[k][j]) for k in ("top", "left", "height", "width")]
        return F.resized_crop(x, *box, list(op.size), antialias=op.antialias)
    if isinstance(op, BatchCutout):
        v = torch.tensor(op.fill, dtype=torch.float32).reshape(-1, 1, 1)
        return F.erase(x, int(p["top"][j]), int(p["left"][j]), op.size, op.size, v)
    if isinstance(op, BatchNormalize):
        x = F.to_dtype(x, torch.float32, scale=op.scale)
        return F.normalize(x, op.mean, op.std) if op.mean is not None else x
    raise TypeError(f"no reference for {op!r}")


def reference(ops: Sequence[Any], params: Sequence[dict[str, torch.Tensor]], raw: torch.Tensor) -> torch.Tensor:
    """torchvision per sample on the stored uint8 ``raw`` (B, C, H, W) with the drawn ``params``, on the CPU."""
    samples = list(raw.cpu())
    for op, p in zip(ops, params):
        p = {k: v.cpu() for k, v in p.items()}
        if isinstance(op, _PerSample):
            # the op itself (torchvision), with torch's generators seeded as the loader seeds them
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(p["seed"]))
                samples = [op.op(x) for x in samples]
            continue
        samples = [_reference_op(op, p, j, x) for j, x in enumerate(samples)]
    return torch.stack(samples)


def convert(ref: torch.Tensor, dtype: torch.dtype, normalize: Any = None) -> torch.Tensor:
    """A GPUDataset's conversion of a uint8 reference: ToDtype(float32, scale=True) + Normalize, in float32."""
    if dtype == torch.uint8 or ref.is_floating_point():
        return ref
    x = F.to_dtype(ref, torch.float32, scale=True)
    return F.normalize(x, list(normalize[0]), list(normalize[1])) if normalize is not None else x


def rrc_bound(std: Sequence[float] | None, ref: torch.Tensor) -> float:
    """Bound of BatchRandomResizedCrop run on converted data (see the module docstring)."""
    levels = 1.05 / (255 * min(std)) if std is not None else 1.05 / 255
    return levels + 2.0 ** -10 * float(ref.abs().max()) + 1e-5


def assert_same(got: torch.Tensor, ref: torch.Tensor, *, bound: float | None = None, what: str = "") -> None:
    """uint8: identical. Float: within ``bound`` if given, else within fp16 rounding of the float32
    reference, and exactly that reference cast to ``got.dtype``."""
    got = got.cpu()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if got.dtype == torch.uint8:
        assert ref.dtype == torch.uint8, f"{what}: uint8 output, {ref.dtype} reference"
        differ = [j for j in range(len(got)) if not torch.equal(got[j], ref[j])]
        assert not differ, (f"{what}: {len(differ)}/{len(got)} samples differ from torchvision "
                            f"(first: {differ[:5]}; max |d| {int((got.int() - ref.int()).abs().max())})")
        return
    d = (got.double() - ref.double()).abs()
    if bound is not None:
        assert float(d.max()) <= bound, f"{what}: max |d| {float(d.max()):.3g} > bound {bound:.3g}"
        return
    limit = FP16_REL * ref.double().abs() + FP16_ABS if got.dtype == torch.float16 else \
        torch.zeros_like(d) if got.dtype == torch.float32 else 2.0 ** -8 * ref.double().abs() + 1e-30
    assert bool((d <= limit).all()), f"{what}: max |d| {float(d.max()):.3g} beyond {got.dtype} rounding"
    assert torch.equal(got, ref.to(got.dtype)), f"{what}: not the float32 reference rounded once to {got.dtype}"


def hw_ok(op: Any, h: int, w: int) -> bool:
    """Whether ``op`` accepts an (h, w) image (a crop no larger than the padded image, a square inside)."""
    if isinstance(op, BatchRandomCrop):
        left, top, right, bottom = op.padding_for(h, w)
        if op.size[0] > h + top + bottom or op.size[1] > w + left + right:
            return False
        try:   # reflect / symmetric padding wider than the image: torchvision refuses it too
            F.pad(torch.zeros((1, h, w), dtype=torch.uint8), [left, top, right, bottom], padding_mode=op.padding_mode)
        except (RuntimeError, ValueError, IndexError):
            return False
    if isinstance(op, BatchCutout):
        return op.size <= min(h, w)
    return True


def loader_params(ops: Sequence[Any], batch_shapes: Sequence[Sequence[int]], seed: int, *,
                  workers: int = 0, threads: int = 0, ring: bool = False) -> list[list[dict[str, torch.Tensor]]]:
    """The parameters ``dlstore.loader(..., generator=gen(seed))`` draws for each batch (first epoch).

    Every way it builds batches starts a pass by drawing a base seed (one int64)
    from its generator, as torch's DataLoader does. Then: in the DataLoader's main
    process (``workers=0``) the batches draw from that same generator, in order;
    DataLoader worker ``w`` seeds torch's default generator with ``base + w`` and
    gets batches ``w, w + W, ...`` (round robin); with ``threads`` batch ``k``
    draws from a generator seeded with ``threads.batch_seed(base, epoch, k)``, and so do the
    workers of the shared-memory ring (``ring=True``).
    """
    g = gen(seed)
    base = int(torch.empty((), dtype=torch.int64).random_(generator=g))
    if threads or ring:
        from dlstore.data.loaders.threads import batch_seed

        return [draw(ops, shape, gen(batch_seed(base, 0, k))) for k, shape in enumerate(batch_shapes)]
    if workers == 0:
        return [draw(ops, shape, g) for shape in batch_shapes]
    gens = [gen(base + w) for w in range(workers)]
    return [draw(ops, shape, gens[k % workers]) for k, shape in enumerate(batch_shapes)]
