"""Batch transforms: per-sample parameters, whole-batch kernels, equal to per-sample references."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from dlstore.errors import TransformSpecError
from dlstore.sources.demo import synthetic_image
from dlstore.transforms import (
    BatchCompose,
    BatchCutout,
    BatchNormalize,
    BatchRandomCrop,
    BatchRandomHorizontalFlip,
    BatchRandomResizedCrop,
)


def _batch(n: int = 16, size: tuple[int, int] = (24, 32)) -> torch.Tensor:
    """uint8 (n, 3, H, W): sample j is synthetic image (j % 3, j), so every sample differs."""
    return torch.stack([torch.from_numpy(synthetic_image(j % 3, j, size)).permute(2, 0, 1) for j in range(n)])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


ALL = [
    BatchRandomCrop(20, padding=4),
    BatchRandomCrop((16, 24), padding=(2, 3), padding_mode="reflect"),
    BatchRandomHorizontalFlip(),
    BatchRandomResizedCrop(12),
    BatchCutout(6),
    BatchNormalize([0.5, 0.4, 0.3], [0.2, 0.25, 0.3]),
    BatchCompose([BatchRandomCrop(24, padding=2), BatchRandomHorizontalFlip(), BatchNormalize(dtype=torch.float16)]),
]


@pytest.mark.parametrize("t", ALL, ids=lambda t: type(t).__name__)
def test_input_untouched_and_seeded_reproducible(t):
    x = _batch()
    before = x.clone()
    a = t(x, _gen(1))
    b = t(x, _gen(1))
    assert torch.equal(x, before), "a batch transform modified its input"
    assert a.shape[0] == x.shape[0] and a.data_ptr() != x.data_ptr()
    assert torch.equal(a, b)


@pytest.mark.parametrize("t", [ALL[0], ALL[2], ALL[3], ALL[4]], ids=lambda t: type(t).__name__)
def test_parameters_independent_per_sample_and_per_seed(t):
    # The same image repeated: any difference between outputs comes from per-sample parameters.
    x = _batch(1).expand(64, -1, -1, -1).contiguous()
    out = t(x, _gen(3))
    distinct = {bytes(o.flatten().numpy()) for o in out}
    assert len(distinct) >= 2 if isinstance(t, BatchRandomHorizontalFlip) else len(distinct) > 10
    assert not torch.equal(out, t(x, _gen(4)))


@pytest.mark.parametrize("padding,mode,fill", [(4, "constant", 0), ((2, 5), "constant", 17), (3, "edge", 0),
                                               ((1, 2, 3, 4), "reflect", 0), (2, "symmetric", 0), (0, "constant", 0)])
def test_random_crop_equals_per_sample_reference(padding, mode, fill):
    x = _batch(12)
    t = BatchRandomCrop((20, 28), padding=padding, fill=fill, padding_mode=mode)
    params = t.sample(x.shape, generator=_gen(0))
    out = t.apply(x, params)
    pad = list(t.padding)
    for j in range(len(x)):
        padded = F.pad(x[j], pad, fill=fill, padding_mode=mode)
        ref = F.crop(padded, int(params["top"][j]), int(params["left"][j]), 20, 28)
        assert torch.equal(out[j], ref), f"sample {j}"
    # offsets cover the whole valid range, not one value
    assert params["top"].max() - params["top"].min() > 0


def test_random_crop_distribution_matches_torchvision_range():
    x = _batch(1).expand(400, -1, -1, -1)
    t = BatchRandomCrop(24, padding=4)
    params = t.sample(x.shape, generator=_gen(0))
    # padded 32x40, crop 24x24: top in [0, 8], left in [0, 16], every value reachable
    assert set(params["top"].tolist()) == set(range(9))
    assert set(params["left"].tolist()) == set(range(17))


def test_flip_equals_per_sample_reference():
    x = _batch(32)
    t = BatchRandomHorizontalFlip(p=0.5)
    params = t.sample(x.shape, generator=_gen(5))
    out = t.apply(x, params)
    assert 0 < int(params["flip"].sum()) < 32
    for j in range(32):
        ref = F.horizontal_flip(x[j]) if params["flip"][j] else x[j]
        assert torch.equal(out[j], ref)
    assert torch.equal(BatchRandomHorizontalFlip(p=1.0)(x), x.flip(-1))
    assert torch.equal(BatchRandomHorizontalFlip(p=0.0)(x), x)


def test_resized_crop_params_valid_and_kernel_matches_torchvision():
    x = _batch(16, size=(48, 64))
    t = BatchRandomResizedCrop(12, scale=(0.3, 1.0), antialias=False)
    params = t.sample(x.shape, generator=_gen(2))
    top, left, h, w = (params[k] for k in ("top", "left", "height", "width"))
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 48).all() and (left + w <= 64).all()
    area = (h * w).double() / (48 * 64)
    assert (area >= 0.29).all() and (area <= 1.01).all()
    ratio = w.double() / h.double()
    assert (ratio > 0.7).all() and (ratio < 1.4).all()
    out = t.apply(x.float(), params)
    for j in range(16):
        # crops are >= 12 px, so bilinear without antialias samples only inside the crop
        ref = F.resized_crop(x[j].float(), int(top[j]), int(left[j]), int(h[j]), int(w[j]), [12, 12],
                             antialias=False)
        torch.testing.assert_close(out[j], ref, atol=1e-3, rtol=1e-4)
    out_u8 = t.apply(x, params)
    assert out_u8.dtype == torch.uint8
    assert (out_u8.float() - out.round()).abs().max() <= 1


@pytest.mark.parametrize("antialias", [True, False])
@pytest.mark.parametrize("size,out", [((96, 96), (16, 16)), ((20, 30), (40, 24)), ((7, 5), (3, 9))])
def test_resized_crop_equals_torchvision(size, out, antialias):
    """CPU: torchvision's kernel per sample, identical; the batched matmul (the CUDA kernel, run here on
    CPU) within float32 rounding for float input and within 1 level of torchvision's uint8 kernel."""
    from dlstore.transforms.functional import resized_crop_matmul

    x = _batch(8, size=size)
    t = BatchRandomResizedCrop(out, scale=(0.2, 1.0), antialias=antialias)
    params = t.sample(x.shape, generator=_gen(9))
    box = [params[k] for k in ("top", "left", "height", "width")]

    def ref(images):
        return torch.stack([F.resized_crop(images[j], *(int(v[j]) for v in box), list(out), antialias=antialias)
                            for j in range(len(images))])

    assert torch.equal(t.apply(x, params), ref(x))
    assert torch.equal(t.apply(x.float(), params), ref(x.float()))
    torch.testing.assert_close(resized_crop_matmul(x.float(), *box, out, antialias=antialias), ref(x.float()),
                               atol=1e-3, rtol=0)
    assert (resized_crop_matmul(x, *box, out, antialias=antialias).int() - ref(x).int()).abs().max() <= 1


def test_resized_crop_falls_back_to_centre_crop():
    x = _batch(4, size=(8, 64))       # ratio 8: no crop with ratio in [3/4, 4/3] and area >= 90%
    t = BatchRandomResizedCrop(8, scale=(0.9, 1.0))
    p = t.sample(x.shape, generator=_gen(0))
    assert p["height"].tolist() == [8] * 4 and p["width"].tolist() == [11] * 4
    assert p["left"].tolist() == [(64 - 11) // 2] * 4


def test_random_crop_pad_if_needed_and_per_channel_fill():
    x = _batch(6, size=(5, 7))
    t = BatchRandomCrop((9, 8), padding=[0, 1, 0, 0], pad_if_needed=True, fill=(10, 20, 30))
    assert t.padding_for(5, 7) == (1, 4, 1, 3)     # 6 rows short: 3 more on each side; 1 column: 1 each
    params = t.sample(x.shape, generator=_gen(0))
    out = t.apply(x, params)
    for j in range(6):
        ref = v2.functional.crop(v2.functional.pad(x[j], [1, 4, 1, 3], fill=[10, 20, 30]),
                                 int(params["top"][j]), int(params["left"][j]), 9, 8)
        assert torch.equal(out[j], ref)
    with pytest.raises(TransformSpecError, match="per-channel fill"):
        BatchRandomCrop(4, padding=1, fill=(1, 2, 3), padding_mode="edge")
    with pytest.raises(TransformSpecError, match="fill"):
        BatchRandomCrop(4, fill="black")


def test_cutout_fills_one_square_inside_each_sample():
    x = torch.full((20, 3, 16, 16), 200, dtype=torch.uint8)
    out = BatchCutout(5, fill=0)(x, _gen(0))
    filled = out == 0
    assert (filled.sum(dim=(1, 2, 3)) == 3 * 25).all()
    for j in range(20):
        ys, xs = torch.nonzero(filled[j, 0], as_tuple=True)
        assert int(ys.max() - ys.min()) == 4 and int(xs.max() - xs.min()) == 4
    colour = BatchCutout(16, fill=(1, 2, 3))(x, _gen(0))
    assert colour[:, :, 0, 0].tolist() == [[1, 2, 3]] * 20


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_normalize_matches_torchvision(dtype, atol):
    x = _batch(6)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    out = BatchNormalize(mean, std, dtype=dtype)(x)
    assert out.dtype == dtype
    ref = torch.stack([v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])(s) for s in x])
    torch.testing.assert_close(out.float(), ref, atol=atol * max(1.0, float(ref.abs().max())), rtol=0)
    plain = BatchNormalize(dtype=torch.float32)(x)
    torch.testing.assert_close(plain, torch.stack([v2.ToDtype(torch.float32, scale=True)(s) for s in x]),
                               atol=0, rtol=0)


def test_compose_runs_in_order_with_one_generator():
    x = _batch(8)
    crop, flip = BatchRandomCrop(24, padding=2), BatchRandomHorizontalFlip()
    g = _gen(7)
    p_crop = crop.sample(x.shape, generator=g)
    p_flip = flip.sample((8, 3, 24, 24), generator=g)
    expected = flip.apply(crop.apply(x, p_crop), p_flip)
    assert torch.equal(BatchCompose([crop, flip])(x, _gen(7)), expected)
    assert BatchCompose([crop, BatchRandomResizedCrop(10)]).output_size(24, 32) == (10, 10)


def test_bad_input_and_arguments_raise_clear_errors():
    with pytest.raises(TransformSpecError, match=r"\(B, C, H, W\)"):
        BatchRandomHorizontalFlip()(torch.zeros(3, 8, 8, dtype=torch.uint8))
    with pytest.raises(TransformSpecError, match="larger than the padded image"):
        BatchRandomCrop(40)(_batch(2))
    with pytest.raises(TransformSpecError, match="padding_mode"):
        BatchRandomCrop(8, padding_mode="wrap")
    with pytest.raises(TransformSpecError, match="both mean and std"):
        BatchNormalize(mean=[0.5])
    with pytest.raises(TransformSpecError, match="floating"):
        BatchNormalize(dtype=torch.uint8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_kernels():
    x = _batch(8)
    for t in (BatchRandomCrop(20, padding=4), BatchRandomHorizontalFlip(), BatchCutout(4), BatchNormalize()):
        params = t.sample(x.shape, generator=_gen(0))
        cpu = t.apply(x, params)
        gpu = t.apply(x.cuda(), {k: v.cuda() for k, v in params.items()})
        assert torch.equal(cpu, gpu.cpu())
    out = BatchRandomCrop(20, padding=4)(x.cuda(), torch.Generator(device="cuda").manual_seed(0))
    assert out.device.type == "cuda"


def test_batch_normalize_refuses_integer_input_without_scaling_like_torchvision():
    x = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    with pytest.raises(TypeError):  # torchvision's own refusal, the reference
        v2.Normalize([0.5] * 3, [0.2] * 3)(x)
    with pytest.raises(TransformSpecError, match="ToDtype"):
        BatchNormalize([0.5] * 3, [0.2] * 3, scale=False)(x)
    scaled = BatchNormalize([0.5] * 3, [0.2] * 3)(x)           # with scaling: ToDtype + Normalize
    want = v2.Normalize([0.5] * 3, [0.2] * 3)(v2.ToDtype(torch.float32, scale=True)(x))
    assert torch.equal(scaled, want)


def test_draws_with_device_none_take_torchs_default_device():
    # device=None is torch.rand's own default: the same draws as on the CPU here
    for op in (BatchRandomCrop(4, padding=2), BatchCutout(3)):
        a = op.sample((5, 3, 8, 8), generator=torch.Generator().manual_seed(1), device=None)
        b = op.sample((5, 3, 8, 8), generator=torch.Generator().manual_seed(1), device="cpu")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), p=st.floats(0.0, 1.0), high=st.integers(1, 10_000), n=st.integers(1, 300))
def test_cpu_draws_are_torchs_arithmetic_on_the_same_stream(seed, p, high, n):
    """On the CPU the draws' arithmetic runs in numpy, several draws from one torch call: the
    same values as torch's own ``(u * high).long().clamp_max(high - 1)`` and ``u < p``, one
    ``torch.rand`` a draw on the same stream, for int and per-sample highs and for a p that
    float32 rounds down."""
    from dlstore.transforms.batch import _randints

    ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    highs = torch.randint(1, high + 1, (n,), generator=torch.Generator().manual_seed(seed))
    for tops in ((high,), (highs,), (high, high + 1), (high, highs, high + 1)):
        want = [(u * top).long().clamp_max(top - 1)
                for u, top in ((torch.rand(n, generator=theirs, dtype=torch.float64), top) for top in tops)]
        got = _randints(tops, n, ours, "cpu")
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    for q in (p, min(1.0, float(torch.tensor(p, dtype=torch.float32)) + 1e-12)):
        flips = BatchRandomHorizontalFlip(q).sample((n, 3, 2, 2), generator=ours)["flip"]
        assert flips.dtype == torch.bool and torch.equal(flips, torch.rand(n, generator=theirs) < q)
