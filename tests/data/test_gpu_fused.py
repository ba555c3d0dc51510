"""The resident back-end's fused gather and resident padding, on device="cpu" (the CUDA code path).

Differential: the fused path (asserted fused) against the unfused one (itself held to
torchvision per sample by tests/fidelity), bit for bit, and a padded resident copy against
padding per batch; plus torchvision per sample directly, through tests/fidelity's harness
(parameters recovered from the output among those torchvision can draw).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

import dlstore
from dlstore import GPUDataset
from dlstore.sources.demo import make_image_folder
from dlstore.transforms import (
    BatchCompose,
    BatchCutout,
    BatchRandomCrop,
    BatchRandomHorizontalFlip,
    BatchRandomResizedCrop,
)

CPU = "cpu"
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
N = 21
H, W = 12, 10


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    src = make_image_folder(root / "images", classes=3, per_class=7, size=(H + 2, W + 2), ext=".png")
    dst = root / "s.shards"
    dlstore.convert(src, dst, static=f"center_crop={H}x{W}", workers=0, progress=False)
    return dst


@pytest.fixture(scope="module")
def raw(store):
    ds = dlstore.open_dataset(store)
    return torch.stack([ds.read(i) for i in range(len(ds))])


# name -> GPUDataset options: what is held, what is served
RESIDENCIES = {
    "uint8": {"dtype": torch.uint8},                                               # uint8 / uint8
    "fp16": {"dtype": torch.float16, "normalize": (MEAN, STD)},                    # fp16 / fp16
    "held-uint8-fp16": {"dtype": torch.float16, "normalize": (MEAN, STD), "hold": "uint8"},
    "held-uint8-bf16": {"dtype": torch.bfloat16, "hold": "uint8"},
    "fp32": {"dtype": torch.float32, "normalize": (MEAN, STD)},
}


@pytest.fixture(scope="module")
def sets(store):
    made: dict = {}

    def get(name: str, device: str = CPU, **extra):
        key = (name, device, repr(sorted(extra.items())))
        if key not in made:
            made[key] = GPUDataset(store, device, chunk_size=4, **RESIDENCIES[name], **extra)
        return made[key]

    return get


def _loader(ds, batch_size, transform=None, **options):
    """``dlstore.loader(ds, ...)`` running ``transform``: the datasets of ``sets`` are shared, so each
    loader sets the pipeline it runs (planned on assignment; a loader keeps the steps it was made with)."""
    ds.transform = transform
    return dlstore.loader(ds, batch_size, **options)


def _epoch(loader):
    images, labels = zip(*loader)
    return torch.cat(images), torch.cat(labels)


def _same(a, b):
    """Bit-identical batches, same memory format."""
    assert len(a) == len(b)
    for (x, lx), (y, ly) in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
        assert torch.equal(x, y) and torch.equal(lx, ly)


def _refused_alike_when_fused(ds, batch_size, kw, exc):
    """What the unfused path refuses (``exc``), the fused gather refuses too, with the same error
    class; the loader must really be fused (``fused=None`` would take the unfused path again)."""
    with pytest.raises(type(exc)):
        fused = _loader(ds, batch_size, fused=True, **kw)
        assert fused.strategy.fused, fused.strategy.fused_reason   # an AssertionError is not type(exc): it escapes
        list(fused)


crops = st.builds(
    lambda size, padding, mode, fill: BatchRandomCrop(
        size, padding=padding, padding_mode=mode, fill=fill if mode == "constant" else 0),
    size=st.tuples(st.integers(4, H), st.integers(4, W)),
    padding=st.one_of(st.integers(0, 4), st.lists(st.integers(0, 4), min_size=4, max_size=4)),
    mode=st.sampled_from(["constant", "edge", "reflect", "symmetric"]),
    fill=st.one_of(st.integers(0, 255), st.tuples(*[st.integers(0, 255)] * 3), st.floats(0, 255)))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(residency=st.sampled_from(list(RESIDENCIES)), crop=crops, p=st.sampled_from([0.0, 0.5, 1.0]),
       flip_first=st.booleans(), batch_size=st.integers(1, 9), seed=st.integers(0, 2**40),
       channels_last=st.booleans(), shuffle=st.booleans())
def test_fused_equals_unfused_bit_for_bit(sets, residency, crop, p, flip_first, batch_size, seed,
                                          channels_last, shuffle):
    ds = sets(residency)
    ops = [BatchRandomHorizontalFlip(p), crop] if flip_first else [crop, BatchRandomHorizontalFlip(p)]
    kw = {"transform": BatchCompose(ops), "seed": seed, "channels_last": channels_last, "shuffle": shuffle}
    try:
        want = list(_loader(ds, batch_size, fused=False, **kw))
    except (RuntimeError, ValueError) as exc:   # reflect padding wider than the image: refused alike
        _refused_alike_when_fused(ds, batch_size, kw, exc)
        return
    fused = _loader(ds, batch_size, fused=True, **kw)
    assert fused.strategy.fused, fused.strategy.fused_reason
    _same(list(fused), want)


@pytest.mark.parametrize("residency", ["uint8", "held-uint8-fp16"])
@pytest.mark.parametrize("mode, padding", [("reflect", 12), ("symmetric", 12), ("reflect", [0, 0, 10, 0])])
def test_padding_wider_than_the_image_is_refused_fused_as_unfused(sets, residency, mode, padding):
    """torchvision's F.pad refuses reflect/symmetric padding as wide as the image; so do both paths
    (the sweep above never draws such padding on its 12x10 samples)."""
    ds = sets(residency)
    kw = {"transform": BatchCompose([BatchRandomCrop(8, padding=padding, padding_mode=mode),
                                     BatchRandomHorizontalFlip()]), "seed": 1}
    with pytest.raises((RuntimeError, ValueError, IndexError)) as info:
        list(_loader(ds, 4, fused=False, **kw))
    _refused_alike_when_fused(ds, 4, kw, info.value)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(out=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]), normalize=st.booleans(),
       size=st.integers(5, 10), padding=st.integers(0, 3), batch_size=st.integers(1, 8),
       seed=st.integers(0, 2**31), channels_last=st.booleans())
def test_torchvision_pipelines_on_uint8_data_fuse_the_conversion(sets, raw, out, normalize, size, padding,
                                                                batch_size, seed, channels_last):
    """v2.RandomCrop + v2.RandomHorizontalFlip + v2.ToDtype (+ Normalize) on uint8 data: one gather."""
    ds = sets("uint8")
    ops = [v2.RandomCrop(size, padding=padding), v2.RandomHorizontalFlip(), v2.ToDtype(out, scale=True)]
    if normalize:
        ops.append(v2.Normalize(MEAN, STD))
    kw = {"transform": v2.Compose(ops), "seed": seed, "channels_last": channels_last, "shuffle": True}
    fused = _loader(ds, batch_size, fused=True, **kw)
    assert fused.strategy.fused, fused.strategy.fused_reason
    got = list(fused)
    _same(got, list(_loader(ds, batch_size, fused=False, **kw)))
    assert got[0][0].dtype == out
    assert got[0][0].is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def test_fused_is_torchvision_per_sample(sets, raw):
    """Directly against torchvision: every sample is F.pad + F.crop (+ F.horizontal_flip) of its stored
    sample for some window torchvision's RandomCrop can draw, then ToDtype + Normalize rounded once."""
    ds = sets("held-uint8-fp16")
    loader = _loader(ds, N, transform=BatchCompose([BatchRandomCrop((9, 8), padding=[1, 2, 3, 4], fill=(10, 200, 77)),
                                                  BatchRandomHorizontalFlip()]),
                       seed=5, channels_last=True, fused=True)
    assert loader.strategy.fused
    (got, labels), = list(loader)
    pipeline = [v2.RandomCrop((9, 8), padding=[1, 2, 3, 4], fill=[10, 200, 77]), v2.RandomHorizontalFlip(),
                v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
    _harness().check_path(pipeline, raw, got, what="fused, channels_last")
    assert torch.equal(labels, torch.arange(N) // 7)        # 3 classes of 7, in store order


def _harness():
    """tests/fidelity's harness (the torchvision reference every read path is held to)."""
    import sys
    from pathlib import Path
    folder = str(Path(__file__).resolve().parents[1] / "fidelity")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import fidelity_harness
    return fidelity_harness


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(residency=st.sampled_from(list(RESIDENCIES)), crop=crops, p=st.sampled_from([0.0, 0.5, 1.0]),
       flip_first=st.booleans(), batch_size=st.integers(1, 9), seed=st.integers(0, 2**40),
       channels_last=st.booleans(), padded=st.booleans())
def test_fused_equals_torchvision_through_the_fidelity_harness(sets, raw, residency, crop, p, flip_first, batch_size,
                                                               seed, channels_last, padded):
    """The fused path against tests/fidelity's reference: the same draws, torchvision's kernels per
    sample on the stored uint8, then the dataset's conversion; exact (fp16: the float32 reference
    rounded once). ``padded``: the dataset holds the crop's padding (when the crop is first)."""
    h = _harness()
    extra = {}
    if padded and not flip_first and any(crop.padding):
        fill = crop.fill if crop.padding_mode == "constant" else 0
        extra = {"padding": list(crop.padding), "padding_mode": crop.padding_mode, "padding_fill": fill}
    if not h.hw_ok(crop, H, W):
        return
    try:
        ds = sets(residency, **extra)
    except (RuntimeError, ValueError):   # reflect padding wider than the image: refused at preload too
        return
    ops = [BatchRandomHorizontalFlip(p), crop] if flip_first else [crop, BatchRandomHorizontalFlip(p)]
    order = torch.randperm(N, generator=torch.Generator().manual_seed(seed)).tolist()   # the sampler's order
    loader = _loader(ds, batch_size, transform=BatchCompose(ops), seed=seed, channels_last=channels_last,
                     sampler=order, fused=True)
    assert loader.strategy.fused and loader.strategy.gather.resident == bool(extra)
    got = torch.cat([x for x, _ in loader])
    h.check_path(ops, raw[order], got, finish=lambda x: h.convert(x, ds.dtype, ds.normalize), what=f"{residency} {crop!r}")


@pytest.mark.parametrize("transform, reason", [
    (BatchRandomResizedCrop(8), "not a crop, a flip"),
    (BatchCompose([BatchRandomCrop(8), BatchCutout(2)]), "not a crop, a flip"),
    (BatchCompose([BatchRandomCrop(8), BatchRandomCrop(6)]), "more than one crop"),
    (lambda x: x, "not a crop, a flip"),
])
def test_what_does_not_fuse_keeps_the_unfused_path_and_says_why(sets, transform, reason):
    ds = sets("uint8")
    assert not _loader(ds, 4, transform=transform, seed=0, fused=False).strategy.fused
    with pytest.raises(ValueError, match=f"fused=True.*{reason}"):
        _loader(ds, 4, transform=transform, fused=True)


def test_default_fuses_only_compiled_on_cuda(sets):
    """fused=None: eager, the unfused path (measured faster); compile=True on CPU does not fuse either."""
    ds = sets("held-uint8-fp16")
    for kw in ({}, {"compile": True}):
        loader = _loader(ds, 4, transform=BatchRandomCrop(8, padding=1), **kw)
        assert not loader.strategy.fused and "compile=True on CUDA" in loader.strategy.fused_reason
    assert _loader(ds, 4, transform=BatchRandomCrop(8, padding=1), fused=True).strategy.fused


def test_stream_mode_does_not_fuse(store):
    ds = GPUDataset(store, CPU, torch.uint8, max_memory=1000, on_overflow="stream")
    with pytest.raises(ValueError, match="stream"):
        _loader(ds, 4, transform=BatchRandomCrop(8), fused=True)


def test_no_transform_fuses_conversion_and_channels_last(sets):
    ds = sets("held-uint8-fp16")
    a = _loader(ds, 5, shuffle=True, seed=1, channels_last=True, fused=True)
    assert a.strategy.fused
    _same(list(a), list(_loader(ds, 5, shuffle=True, seed=1, channels_last=True, fused=False)))


def test_hold_uint8_serves_what_the_fp16_dataset_serves(sets):
    held = sets("held-uint8-fp16")
    ref = sets("fp16")
    assert held.mode == "uint8" and held.data.dtype == torch.uint8 and held.nbytes < ref.nbytes
    assert held.needed_bytes == N * 3 * H * W + 8 * N
    t = BatchCompose([BatchRandomCrop((H, W), padding=2), BatchRandomHorizontalFlip()])
    _same(list(_loader(held, 4, transform=t, seed=3)), list(_loader(ref, 4, transform=t, seed=3)))
    with pytest.raises(ValueError, match="hold"):
        GPUDataset(held.source, CPU, hold="int8")


# --- padding held on the device ------------------------------------------------------------

@pytest.mark.parametrize("residency", ["uint8", "fp16", "held-uint8-fp16"])
@pytest.mark.parametrize("padding, mode, fill", [(4, "constant", 0), ([1, 2, 3, 0], "constant", (9, 99, 199)),
                                                 (2, "edge", 0), ([3, 1], "reflect", 0), (4, "symmetric", 0)])
def test_padded_copy_is_torchvision_pad(sets, raw, residency, padding, mode, fill):
    ds = sets(residency, padding=padding, padding_mode=mode, padding_fill=fill)
    plain = sets(residency)
    want = F.pad(raw, padding if isinstance(padding, list) else [padding], fill=list(fill) if
                 isinstance(fill, tuple) else fill, padding_mode=mode)
    if ds.data.is_floating_point():   # held converted: the conversion of the padded pixels
        want = ds.conversion(want)
    assert torch.equal(ds.data, want)
    assert ds.needed_bytes == want.numel() * want.element_size() + 8 * N
    assert torch.equal(ds[3][0], plain[3][0]) and ds[3][1] == plain[3][1]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(residency=st.sampled_from(["uint8", "fp16", "held-uint8-fp16"]), pad=st.integers(1, 4),
       mode=st.sampled_from(["constant", "edge", "reflect"]), fill=st.integers(0, 255),
       batch_size=st.integers(1, 9), seed=st.integers(0, 2**31), channels_last=st.booleans(),
       fused=st.booleans(), flip=st.booleans())
def test_padded_copy_gives_the_pixels_of_padding_per_batch(sets, residency, pad, mode, fill, batch_size, seed,
                                                           channels_last, fused, flip):
    fill = fill if mode == "constant" else 0
    padded = sets(residency, padding=pad, padding_mode=mode, padding_fill=fill)
    plain = sets(residency)
    ops = [BatchRandomCrop((H, W), padding=pad, padding_mode=mode, fill=fill)]
    ops += [BatchRandomHorizontalFlip()] if flip else []
    kw = {"transform": BatchCompose(ops), "seed": seed, "channels_last": channels_last, "shuffle": True}
    loader = _loader(padded, batch_size, fused=fused, **kw)
    assert loader.strategy.fused == fused
    assert loader.strategy.held is padded.data    # the crop reads the padded copy
    if fused:
        assert loader.strategy.gather.resident
    _same(list(loader), list(_loader(plain, batch_size, fused=False, **kw)))


def test_padded_copy_with_another_crop_or_no_crop_serves_the_samples(sets):
    padded = sets("uint8", padding=4, padding_mode="constant", padding_fill=0)
    plain = sets("uint8")
    for transform in (None, BatchRandomCrop(8, padding=2), BatchRandomCrop(8, padding=4, fill=1),
                      BatchCompose([BatchRandomHorizontalFlip(), BatchRandomCrop(8, padding=4)])):
        for fused in (False, True):
            kw = {"transform": transform, "seed": 2, "shuffle": True}
            _same(list(_loader(padded, 6, fused=fused, **kw)), list(_loader(plain, 6, fused=False, **kw)))


def test_padding_options_are_checked(store):
    with pytest.raises(ValueError, match="padding_mode"):
        GPUDataset(store, CPU, padding=2, padding_mode="wrap")
    with pytest.raises(ValueError, match="padding"):
        GPUDataset(store, CPU, padding=-1)
    with pytest.raises(ValueError, match="fill"):
        GPUDataset(store, CPU, padding=1, padding_fill="black")


def test_padded_preload_counts_its_buffers(store):
    need = GPUDataset(store, CPU, torch.uint8, padding=2, padding_mode="edge", chunk_size=3)
    exact = need.needed_bytes
    from dlstore import DeviceMemoryError
    with pytest.raises(DeviceMemoryError):
        GPUDataset(store, CPU, torch.uint8, padding=2, padding_mode="edge", chunk_size=3, max_memory=exact)
    GPUDataset(store, CPU, torch.uint8, padding=2, padding_mode="edge", chunk_size=3,
               max_memory=exact + 2 * 3 * 3 * (H + 4) * (W + 4))


# --- torch.compile -------------------------------------------------------------------------

def _compiles() -> str | None:
    try:
        torch.compile(lambda x: x + 1)(torch.zeros(2))
    except Exception as exc:  # noqa: BLE001  (any failure means: no working compiler here)
        return f"torch.compile does not work here: {type(exc).__name__}: {exc}"
    return None


@pytest.mark.slow
def test_compiled_gather_equals_eager(sets):
    reason = _compiles()
    if reason:
        pytest.skip(reason)
    cases = [("held-uint8-fp16", BatchCompose([BatchRandomCrop((H, W), padding=4, fill=(1, 2, 3)),
                                               BatchRandomHorizontalFlip()]), True),
             ("fp16", BatchCompose([BatchRandomCrop((8, 8), padding=2, padding_mode="reflect"),
                                    BatchRandomHorizontalFlip()]), False)]
    for residency, transform, channels_last in cases:
        ds = sets(residency)
        kw = {"transform": transform, "seed": 7, "channels_last": channels_last, "shuffle": True}
        compiled = _loader(ds, 5, compile=True, fused=True, **kw)
        got = [list(compiled) for _ in range(2)]   # two epochs: a full group and the last, smaller one
        assert compiled.strategy.gather.compiled, "the compiled kernel fell back to eager"
        eager = _loader(ds, 5, fused=True, **kw)
        assert eager.strategy.fused and not eager.strategy.gather.compiled
        for epoch in got:
            _same(epoch, list(eager))


# --- CUDA (skipped without a GPU): the same properties where the default fuses ---------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@needs_cuda
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(residency=st.sampled_from(list(RESIDENCIES)), crop=crops, p=st.sampled_from([0.0, 0.5, 1.0]),
       flip_first=st.booleans(), batch_size=st.integers(1, 9), seed=st.integers(0, 2**40),
       channels_last=st.booleans())
def test_cuda_fused_equals_unfused(sets, residency, crop, p, flip_first, batch_size, seed, channels_last):
    ds = sets(residency, "cuda")
    ops = [BatchRandomHorizontalFlip(p), crop] if flip_first else [crop, BatchRandomHorizontalFlip(p)]
    kw = {"transform": BatchCompose(ops), "seed": seed, "channels_last": channels_last, "shuffle": True}
    try:
        want = list(_loader(ds, batch_size, fused=False, **kw))
    except (RuntimeError, ValueError) as exc:
        _refused_alike_when_fused(ds, batch_size, kw, exc)
        return
    fused = _loader(ds, batch_size, fused=True, **kw)
    assert fused.strategy.fused, fused.strategy.fused_reason
    got = list(fused)
    assert got[0][0].is_cuda
    _same(got, want)


@pytest.mark.cuda
@needs_cuda
def test_cuda_padded_copy_equals_padding_per_batch(sets):
    padded = sets("held-uint8-fp16", "cuda", padding=4, padding_mode="constant", padding_fill=0)
    plain = sets("held-uint8-fp16", "cuda")
    cpu = sets("held-uint8-fp16", CPU, padding=4, padding_mode="constant", padding_fill=0)
    assert torch.equal(padded.data.cpu(), cpu.data)
    t = BatchCompose([BatchRandomCrop((H, W), padding=4), BatchRandomHorizontalFlip()])
    loader = _loader(padded, 5, transform=t, seed=1, channels_last=True, fused=True)
    assert loader.strategy.fused and loader.strategy.gather.resident
    _same(list(loader), list(_loader(plain, 5, transform=t, seed=1, channels_last=True, fused=False)))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.slow
def test_cuda_compiled_gather_equals_eager(sets):
    reason = _compiles()
    if reason:
        pytest.skip(reason)
    for residency, transform in (("held-uint8-fp16", BatchCompose([BatchRandomCrop((H, W), padding=4, fill=(1, 2, 3)),
                                                                   BatchRandomHorizontalFlip()])),
                                 ("fp16", BatchCompose([BatchRandomCrop((8, 8), padding=2, padding_mode="reflect"),
                                                        BatchRandomHorizontalFlip()]))):
        ds = sets(residency, "cuda")
        kw = {"transform": transform, "seed": 7, "channels_last": True, "shuffle": True}
        compiled = _loader(ds, 5, compile=True, **kw)      # fused=None with compile=True on CUDA: fused
        got = [list(compiled) for _ in range(2)]
        assert compiled.strategy.fused and compiled.strategy.gather.compiled, "the compiled kernel fell back to eager"
        eager = _loader(ds, 5, fused=True, **kw)
        for epoch in got:
            _same(epoch, list(eager))
