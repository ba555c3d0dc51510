"""The fidelity harness: torchvision is the reference for every read path.

A read path draws its random parameters inside dlstore, from generators seeded
in a way the documented contract does not pin down sample by sample (batch k of
a pass draws from a generator seeded from (``generator``, epoch, k); a batch op
draws for the whole batch at once, not in torchvision's per-sample order). So the
reference never asks dlstore which parameters it drew. Two ways instead:

* ``tv_draw``: torchvision's own parameter draws (``v2.RandomCrop.make_params``,
  ``v2.RandomResizedCrop.make_params``, ``RandomHorizontalFlip``'s ``torch.rand(1) < p``),
  per sample, from torch's generator seeded with ``seed``; a test hands them to a
  batch op's ``apply`` (its kernel, which takes the parameters) and compares with
  ``reference``.
* ``recover``: for a path that draws its own parameters, the parameters are found
  from its output: every parameter torchvision can draw for the op (every crop
  window of the padded image, flip or not as p allows, every crop box of a resized
  crop, every cutout or erasing square) is run through torchvision's kernels on the
  stored uint8 sample, and one must give the path's pixels (exactly; within
  ``bound`` where one is stated). Then ``reference`` with those parameters is
  compared again, sample by sample. That the draws follow torchvision's laws is
  tests/fidelity/test_distributions.py's part.

The ops are torchvision v2 transforms (``RandomCrop``, ``RandomHorizontalFlip``,
``RandomResizedCrop``, ``RandomErasing``, ``ToImage``, ``ToDtype``, ``Normalize``:
the pipeline a user wrote), torchvision v1 transforms (the same, and ``ConvertImageDtype``,
each read with v1's own kernels: ``torchvision.transforms.functional``), timm's
``RandomResizedCropAndInterpolation`` (bilinear: v1's kernel, which it calls), or dlstore's
batch ops, read as the torchvision transform each documents itself equal to:

    BatchRandomCrop            F.pad(fill, padding_mode) + F.crop
    BatchRandomHorizontalFlip  F.horizontal_flip
    BatchRandomResizedCrop     F.resized_crop (kernel="v1": v1's resized_crop)
    BatchCutout                F.erase
    BatchNormalize             F.to_dtype(scale) + F.normalize   (float32; divide=True: v1's
                               convert_image_dtype + normalize)
    _PerSample(op)             op itself (a torchvision transform)

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
import torchvision.transforms as v1
import torchvision.transforms.functional as F1
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

import dlstore
from dlstore.sources.demo import make_image_folder
from dlstore.transforms import (
    BatchCompose,
    BatchCutout,
    BatchNormalize,
    BatchRandomCrop,
    BatchRandomHorizontalFlip,
    BatchRandomResizedCrop,
)
from dlstore.transforms.planner import PerSample as _PerSample

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


def _fill(fill: Any) -> Any:
    return list(fill) if isinstance(fill, tuple) else fill


DETERMINISTIC = (v2.ToImage, v2.ToPureTensor, v2.ToDtype, v2.Normalize, v1.ConvertImageDtype, v1.Normalize)


def _is_v1(op: Any) -> bool:
    return type(op).__module__.startswith("torchvision.transforms.") and ".v2" not in type(op).__module__


def _rrc_kernel(op: Any) -> str:
    if isinstance(op, BatchRandomResizedCrop):
        return op.kernel
    return "v1" if _is_v1(op) or type(op).__module__.startswith("timm.") else "v2"


def v1_padded(op: Any, x: torch.Tensor) -> torch.Tensor:
    """What torchvision v1's ``RandomCrop.forward`` pads ``x`` to before it draws the window: its
    ``padding``, then ``pad_if_needed``'s width and height pads, one after the other (v1's kernels)."""
    if op.padding is not None:
        x = F1.pad(x, op.padding, op.fill, op.padding_mode)
    h, w = x.shape[-2:]
    if op.pad_if_needed and w < op.size[1]:
        x = F1.pad(x, [op.size[1] - w, 0], op.fill, op.padding_mode)
    if op.pad_if_needed and h < op.size[0]:
        x = F1.pad(x, [0, op.size[0] - h], op.fill, op.padding_mode)
    return x


def _spec(op: Any, c: int, h: int, w: int) -> dict[str, Any]:
    """What ``op`` does to a (c, h, w) sample, in torchvision's terms (its kernel and arguments)."""
    if isinstance(op, _PerSample):
        op = op.op
    if isinstance(op, v1.RandomCrop):
        return {"kind": "crop", "v1": op, "size": tuple(op.size)}
    if isinstance(op, (BatchRandomCrop, v2.RandomCrop)):
        # the padding torchvision's RandomCrop applies (padding, then pad_if_needed): its own make_params
        tv = as_torchvision(op) if isinstance(op, BatchRandomCrop) else op
        with torch.random.fork_rng(devices=[]):
            padding = tv.make_params([torch.empty((c, h, w), dtype=torch.uint8)])["padding"]
        return {"kind": "crop", "padding": list(padding), "fill": _fill(tv.fill), "mode": tv.padding_mode,
                "size": tuple(tv.size)}
    if isinstance(op, (BatchRandomHorizontalFlip, v2.RandomHorizontalFlip, v1.RandomHorizontalFlip)):
        return {"kind": "flip", "p": float(op.p), "v1": _is_v1(op)}
    if isinstance(op, (BatchRandomResizedCrop, v2.RandomResizedCrop, v1.RandomResizedCrop)) \
            or type(op).__name__ == "RandomResizedCropAndInterpolation":
        if not isinstance(op, BatchRandomResizedCrop):
            assert getattr(op.interpolation, "value", op.interpolation) in ("bilinear", 2), op
        antialias = True if getattr(op, "antialias", None) is None else bool(op.antialias)
        return {"kind": "rrc", "size": list(op.size), "antialias": antialias, "kernel": _rrc_kernel(op)}
    if isinstance(op, BatchCutout):
        return {"kind": "erase", "size": op.size, "p": 1.0,
                "v": torch.tensor(op.fill, dtype=torch.float32).reshape(-1, 1, 1)}
    if isinstance(op, (v2.RandomErasing, v1.RandomErasing)):
        assert op.value is not None and op.value != "random", "random-valued erasing has no pixels to recover"
        value = op.value if isinstance(op.value, (list, tuple)) else [op.value]
        return {"kind": "erase", "size": None, "p": float(op.p), "v": torch.tensor(value)[:, None, None]}
    if isinstance(op, BatchNormalize):
        def normalise(x: torch.Tensor) -> torch.Tensor:
            if op.divide:      # torchvision v1's ConvertImageDtype / ToTensor: x.to(float) / 255
                x = F1.convert_image_dtype(x, torch.float32)
            else:
                x = F.to_dtype(x, torch.float32, scale=op.scale)
            return F.normalize(x, op.mean, op.std) if op.mean is not None else x
        return {"kind": "det", "fn": normalise}
    if isinstance(op, DETERMINISTIC):
        return {"kind": "det", "fn": lambda x: op(x).as_subclass(torch.Tensor)}
    raise TypeError(f"no reference for {op!r}")


def as_torchvision(op: Any) -> Any:
    """The torchvision transform a dlstore batch op documents itself equal to, per sample."""
    if isinstance(op, BatchRandomCrop):
        return v2.RandomCrop(op.size, padding=list(op.padding), pad_if_needed=op.pad_if_needed,
                             fill=_fill(op.fill), padding_mode=op.padding_mode)
    if isinstance(op, BatchRandomHorizontalFlip):
        return v2.RandomHorizontalFlip(op.p)
    if isinstance(op, BatchRandomResizedCrop):
        return v2.RandomResizedCrop(op.size, scale=op.scale, ratio=op.ratio, antialias=op.antialias)
    if isinstance(op, BatchCutout):   # no torchvision transform: a square placed uniformly, RandomCrop's law
        return v2.RandomCrop(op.size)
    raise TypeError(f"no torchvision counterpart for {op!r}")


def tv_draw(ops: Sequence[Any], shape: Sequence[int], seed: int) -> list[dict[str, torch.Tensor]]:
    """The parameters torchvision's own transforms draw for each sample of a batch of ``shape``,
    from torch's default generator seeded with ``seed`` (restored after), as batch ops' ``apply``
    takes them. ``ops``: dlstore batch ops (read through ``as_torchvision``)."""
    b, c, h, w = shape
    params = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for op in ops:
            if isinstance(op, BatchNormalize):
                params.append({})
            elif isinstance(op, BatchRandomHorizontalFlip):   # _RandomApplyTransform: applied iff rand(1) < p
                params.append({"flip": torch.tensor([bool(torch.rand(1) < op.p) for _ in range(b)])})
            else:
                tv = as_torchvision(op)
                draws = [tv.make_params([torch.empty((c, h, w), dtype=torch.uint8)]) for _ in range(b)]
                keys = ("top", "left", "height", "width") if isinstance(op, BatchRandomResizedCrop) else ("top", "left")
                params.append({k: torch.tensor([int(d[k]) for d in draws]) for k in keys})
            b, c, h, w = out_shape(op, (b, c, h, w))
    return params


def _apply(spec: dict[str, Any], p: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    """torchvision's kernel of ``spec`` on ``x`` (a sample, or a stack of candidates) with parameters ``p``."""
    kind = spec["kind"]
    if kind == "crop" and "v1" in spec:
        return F1.crop(v1_padded(spec["v1"], x), int(p["top"]), int(p["left"]), *spec["size"])
    if kind == "crop":
        if any(spec["padding"]):
            x = F.pad(x, spec["padding"], fill=spec["fill"], padding_mode=spec["mode"])
        return F.crop(x, int(p["top"]), int(p["left"]), *spec["size"])
    if kind == "flip":
        return (F1.hflip(x) if spec["v1"] else F.horizontal_flip(x)) if bool(p["flip"]) else x
    if kind == "rrc":
        box = [int(p[k]) for k in ("top", "left", "height", "width")]
        resized_crop = F1.resized_crop if spec["kernel"] == "v1" else F.resized_crop
        return resized_crop(x, *box, spec["size"], antialias=spec["antialias"])
    if kind == "erase":
        if not bool(p.get("erased", True)):
            return x
        side = spec["size"]
        return F.erase(x, int(p["top"]), int(p["left"]), int(p.get("height", side)), int(p.get("width", side)),
                       spec["v"])
    return spec["fn"](x)


def reference(ops: Sequence[Any], params: Sequence[dict[str, torch.Tensor]], raw: torch.Tensor) -> torch.Tensor:
    """torchvision per sample on the stored uint8 ``raw`` (B, C, H, W) with the parameters ``params``
    (one dict of per-sample tensors per op), on the CPU."""
    samples = list(raw.cpu())
    for op, p in zip(ops, params):
        p = {k: v.cpu() for k, v in p.items()}
        if isinstance(op, _PerSample) and "seed" in p:
            # the op itself (torchvision), with torch's generators seeded as the loader seeds them
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(p["seed"]))
                samples = [op.op(x) for x in samples]
            continue
        samples = [_apply(_spec(op, *x.shape), {k: v[j] for k, v in p.items()}, x) for j, x in enumerate(samples)]
    return torch.stack(samples)


def _boxes(h: int, w: int, strict: bool = False):
    """Every (height, width) box inside an h x w image (strictly smaller: RandomErasing's)."""
    for bh in range(1, h if strict else h + 1):
        for bw in range(1, w if strict else w + 1):
            yield bh, bw


def _expand(spec: dict[str, Any], cands: torch.Tensor, plist: list[tuple]) -> tuple[torch.Tensor, list[tuple]]:
    """Every output torchvision's ``spec`` can give from each candidate, with its parameters."""
    kind = spec["kind"]
    h, w = cands.shape[-2:]
    outs: list[torch.Tensor] = []
    made: list[tuple] = []

    def add(out: torch.Tensor, p: dict[str, Any]) -> None:
        outs.append(out)
        made.extend(pp + (p,) for pp in plist)

    if kind == "crop":
        padded = v1_padded(spec["v1"], cands) if "v1" in spec else \
            F.pad(cands, spec["padding"], fill=spec["fill"], padding_mode=spec["mode"]) \
            if any(spec["padding"]) else cands
        th, tw = spec["size"]
        for top in range(padded.shape[-2] - th + 1):
            for left in range(padded.shape[-1] - tw + 1):
                add(padded[..., top:top + th, left:left + tw], {"top": top, "left": left})
    elif kind == "flip":
        for flip in ([False] if spec["p"] == 0 else [True] if spec["p"] == 1 else [False, True]):
            flipped = F1.hflip(cands) if spec["v1"] else F.horizontal_flip(cands)
            add(flipped if flip else cands, {"flip": flip})
    elif kind == "rrc":
        for bh, bw in _boxes(h, w):
            at = [(t, l) for t in range(h - bh + 1) for l in range(w - bw + 1)]
            windows = torch.cat([cands[..., t:t + bh, l:l + bw] for t, l in at])
            resize = F1.resize if spec["kernel"] == "v1" else F.resize
            resized = resize(windows, spec["size"], antialias=spec["antialias"])
            for k, (t, l) in enumerate(at):
                add(resized[k * len(cands):(k + 1) * len(cands)], {"top": t, "left": l, "height": bh, "width": bw})
    elif kind == "erase":
        if spec["p"] < 1 or spec["size"] is None:   # not erased: p, or RandomErasing's fallback
            add(cands, {"top": 0, "left": 0, "height": 0, "width": 0, "erased": False})
        sides = [(spec["size"], spec["size"])] if spec["size"] is not None else _boxes(h, w, strict=True)
        for bh, bw in sides:
            for t in range(h - bh + 1):
                for l in range(w - bw + 1):
                    add(F.erase(cands, t, l, bh, bw, spec["v"]),
                        {"top": t, "left": l, "height": bh, "width": bw, "erased": True})
    else:
        add(spec["fn"](cands), {})
    return torch.cat(outs), made


_CANDIDATES: dict[tuple, tuple[torch.Tensor, list[tuple]]] = {}


def _key(op: Any) -> tuple:
    inner = op.op if isinstance(op, _PerSample) else op
    return type(op).__name__, repr(inner), tuple(sorted((k, repr(v)) for k, v in vars(inner).items()))


def _candidates(ops: Sequence[Any], x: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
    """Every output torchvision's ``ops`` can give on sample ``x``, and the parameters of each (cached:
    the tests use a few stored samples over and over)."""
    key = (tuple(_key(op) for op in ops), tuple(x.shape), x.numpy().tobytes())
    if key not in _CANDIDATES:
        cands, plist = x[None], [()]
        for op in ops:
            cands, plist = _expand(_spec(op, *cands.shape[1:]), cands, plist)
        _CANDIDATES[key] = (cands, plist)
    return _CANDIDATES[key]


def _match(out: torch.Tensor, target: torch.Tensor, bound: float | None) -> int | None:
    if out.shape[1:] != target.shape:
        return None
    if bound is not None:
        d = (out.double() - target.double()).abs().flatten(1).amax(1)
        k = int(d.argmin())
        return k if float(d[k]) <= bound else None
    same = out == target if out.dtype == target.dtype else out.to(target.dtype) == target
    hits = same.flatten(1).all(1).nonzero()
    return int(hits[0]) if len(hits) else None


def recover(ops: Sequence[Any], raw: torch.Tensor, got: torch.Tensor, *, finish: Any = None,
            bound: float | None = None, what: str = "") -> list[dict[str, torch.Tensor]]:
    """The parameters, per sample, for which torchvision's ``ops`` on ``raw[j]`` (then ``finish``, the
    dataset's conversion) give ``got[j]``: exactly (float: the float32 reference cast to got's dtype),
    or within ``bound``. Fails naming the first sample no parameter torchvision can draw explains.
    Returns them as ``reference`` takes them."""
    got = got.cpu()
    assert len(got) == len(raw), f"{what}: {len(got)} samples for {len(raw)}"
    found = []
    for j in range(len(raw)):
        cands, plist = _candidates(ops, raw[j].cpu())
        out = finish(cands) if finish is not None else cands
        k = _match(out, got[j], bound)
        assert k is not None, (f"{what}: sample {j}: none of the {len(plist)} outputs torchvision's {list(ops)!r} "
                               f"can give is the path's")
        found.append(plist[k])
    return [{key: torch.tensor([f[i][key] for f in found]) for key in found[0][i]} for i in range(len(ops))]


def check_path(ops: Sequence[Any], raw: torch.Tensor, got: torch.Tensor, *, finish: Any = None,
               bound: float | None = None, what: str = "") -> None:
    """``got`` is torchvision's ``ops`` (then ``finish``) on ``raw`` for parameters torchvision can draw:
    recovered, then the per-sample reference with them compared by ``assert_same``."""
    params = recover(ops, raw, got, finish=finish, bound=bound, what=what)
    ref = reference(ops, params, raw)
    assert_same(got, finish(ref) if finish is not None else ref, bound=bound, what=what)


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
