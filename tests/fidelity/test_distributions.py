"""The batch ops draw their parameters from torchvision's distributions, independently per sample.

Each test draws >= 10,000 parameters at a fixed seed from a dlstore batch op
and, where torchvision has the op, 10,000 from torchvision's own ``make_params``
(torch's global generator, seeded), then tests at significance 0.001 (no scipy):

* discrete parameters (crop offsets, cutout offsets, crop heights/widths):
  chi-square goodness of fit against the uniform law torchvision's ``randint``
  draws from, over exactly torchvision's range, and a chi-square homogeneity
  test against torchvision's own draws; the critical value is the
  Wilson-Hilferty approximation of the chi-square quantile (0-3 % above the
  exact one: slightly conservative);
* continuous-looking ones (resized-crop area fraction, log aspect ratio,
  relative offset): two-sample Kolmogorov-Smirnov, critical value
  1.949 * sqrt((n + m) / (n m)) (conservative for the discrete laws here);
* rates (flip, resized-crop fallback): within 4.5 standard deviations of the
  binomial (two-proportion z for the fallback);
* independence within a batch: |Pearson r| of consecutive samples' parameters
  (and of a sample's top and left) below 4 / sqrt(n).
"""

from __future__ import annotations

import math

import pytest
import torch
from torchvision.transforms import v2

from dlstore.transforms import (
    BatchCutout,
    BatchRandomCrop,
    BatchRandomHorizontalFlip,
    BatchRandomResizedCrop,
)

N = 10_000
Z_999 = 3.0902      # standard normal quantile 0.999
KS_999 = 1.949      # Kolmogorov distribution quantile 0.999


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def chi2_critical(df: int, z: float = Z_999) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (0.999 by default)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_uniform(values: torch.Tensor, low: int, high: int) -> tuple[float, float]:
    """(statistic, critical value) of ``values`` against the uniform law on the integers [low, high]."""
    k = high - low + 1
    assert int(values.min()) >= low and int(values.max()) <= high, "draws outside torchvision's range"
    counts = torch.bincount(values.long() - low, minlength=k).double()
    expected = len(values) / k
    return float(((counts - expected) ** 2 / expected).sum()), chi2_critical(k - 1)


def chi2_same(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value) of the chi-square homogeneity test: do ``a`` and ``b`` (ints)
    come from one law? Categories seen fewer than 5 times in all are pooled."""
    low = int(min(a.min(), b.min()))
    k = int(max(a.max(), b.max())) - low + 1
    ca = torch.bincount(a.long() - low, minlength=k).double()
    cb = torch.bincount(b.long() - low, minlength=k).double()
    small = (ca + cb) < 5
    if small.any():
        ca = torch.cat([ca[~small], ca[small].sum().view(1)])
        cb = torch.cat([cb[~small], cb[small].sum().view(1)])
    total = ca + cb
    keep = total > 0
    ca, cb, total = ca[keep], cb[keep], total[keep]
    ea, eb = total * ca.sum() / total.sum(), total * cb.sum() / total.sum()
    stat = float(((ca - ea) ** 2 / ea).sum() + ((cb - eb) ** 2 / eb).sum())
    return stat, chi2_critical(max(1, len(total) - 1))


def ks_two_sample(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(D statistic, critical value) of the two-sample Kolmogorov-Smirnov test."""
    a, b = a.double().sort().values, b.double().sort().values
    grid = torch.cat([a, b])
    fa = torch.searchsorted(a, grid, right=True).double() / len(a)
    fb = torch.searchsorted(b, grid, right=True).double() / len(b)
    n, m = len(a), len(b)
    return float((fa - fb).abs().max()), KS_999 * math.sqrt((n + m) / (n * m))


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    return float((x * y).sum() / (x.norm() * y.norm()))


def _torchvision_draws(t, shape: tuple[int, int, int], keys: tuple[str, ...], n: int = N, seed: int = 0):
    torch.manual_seed(seed)
    image = torch.zeros(shape, dtype=torch.uint8)
    draws = [t.make_params([image]) for _ in range(n)]
    return {k: torch.tensor([int(d[k]) for d in draws]) for k in keys}


def _assert_below(stat: float, critical: float, what: str) -> None:
    assert stat < critical, f"{what}: statistic {stat:.2f} >= critical value {critical:.2f} (p < 0.001)"


def _assert_independent(values: torch.Tensor, what: str) -> None:
    r = pearson(values[:-1], values[1:])
    assert abs(r) < 4 / math.sqrt(len(values)), f"{what}: consecutive samples correlate (r = {r:.4f})"


# --- crop ------------------------------------------------------------------------------------

CROPS = [  # (image (H, W), torchvision RandomCrop kwargs)
    ((13, 11), {"size": 9, "padding": 3}),
    ((13, 11), {"size": (10, 12), "padding": [1, 4, 6, 0]}),
    ((5, 3), {"size": (8, 9), "pad_if_needed": True}),
    ((32, 32), {"size": 32, "padding": 4}),
]


@pytest.mark.parametrize("image,kwargs", CROPS, ids=lambda v: str(v))
def test_crop_offsets_uniform_over_torchvision_range(image, kwargs):
    from dlstore.transforms.equivalents import batch_equivalent

    tv = v2.RandomCrop(**kwargs)
    ours = batch_equivalent(tv)
    assert isinstance(ours, BatchRandomCrop)
    params = ours.sample((N, 3, *image), generator=_gen(0))
    ref = _torchvision_draws(tv, (3, *image), ("top", "left", "height", "width"))
    for key, size_key in (("top", "height"), ("left", "width")):
        # torchvision's range: randint(0, padded - crop + 1); its max over 10,000 draws is the top of it
        high = int(ref[key].max())
        stat, crit = chi2_uniform(params[key], 0, high)
        _assert_below(stat, crit, f"{key} vs uniform on [0, {high}]")
        stat, crit = chi2_same(params[key], ref[key])
        _assert_below(stat, crit, f"{key} vs torchvision's draws")
        _assert_independent(params[key], key)
    assert abs(pearson(params["top"], params["left"])) < 4 / math.sqrt(N)


# --- flip ------------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.0, 0.3, 0.5, 1.0])
def test_flip_rate_is_p(p):
    flips = BatchRandomHorizontalFlip(p).sample((N, 3, 4, 4), generator=_gen(1))["flip"]
    k = int(flips.sum())
    sd = math.sqrt(N * p * (1 - p))
    assert abs(k - N * p) <= 4.5 * sd, f"{k} flips of {N} at p={p} (expected {N * p:.0f} +- {4.5 * sd:.0f})"
    if 0 < p < 1:
        _assert_independent(flips.long(), "flip")


# --- resized crop ----------------------------------------------------------------------------

RESIZED = [  # (image (H, W), scale, ratio): ordinary, tall with frequent fallback, small
    ((48, 64), (0.08, 1.0), (3 / 4, 4 / 3)),
    ((10, 60), (0.08, 1.0), (3 / 4, 4 / 3)),
    ((7, 5), (0.3, 0.9), (0.5, 2.0)),
]


def _fallback(params, image, scale, ratio):
    """Whether each draw is torchvision's centre-crop fallback (no try accepted)."""
    h, w = image
    in_ratio = w / h
    if in_ratio < ratio[0]:
        fw, fh = w, round(w / ratio[0])
    elif in_ratio > ratio[1]:
        fw, fh = round(h * ratio[1]), h
    else:
        fw, fh = w, h
    return (params["height"] == fh) & (params["width"] == fw) & (params["top"] == (h - fh) // 2) \
        & (params["left"] == (w - fw) // 2)


@pytest.mark.parametrize("image,scale,ratio", RESIZED, ids=lambda v: str(v))
def test_resized_crop_parameters_follow_torchvision(image, scale, ratio):
    h, w = image
    ours = BatchRandomResizedCrop(8, scale=scale, ratio=ratio).sample((N, 3, h, w), generator=_gen(2))
    ref = _torchvision_draws(v2.RandomResizedCrop(8, scale=scale, ratio=ratio), (3, h, w),
                             ("top", "left", "height", "width"))
    _assert_resized_like_torchvision(ours, ref, image, scale, ratio)


def test_resized_crop_boxes_of_mixed_sizes_follow_torchvision_per_size():
    """``sample_sizes`` (what the JPEG path draws before it decodes, each record at its own size):
    the sizes interleaved in one batch, each size's boxes drawn as ``get_params`` draws on it."""
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    sizes = torch.tensor([image for image, _, _ in RESIZED])
    which = torch.arange(len(sizes)).repeat(N)          # size 0, 1, 2, 0, 1, 2, ...
    boxes = BatchRandomResizedCrop(8, scale=scale, ratio=ratio).sample_sizes(
        sizes[which, 0], sizes[which, 1], generator=_gen(6))
    for k, (image, _, _) in enumerate(RESIZED):
        ours = {key: value[which == k] for key, value in boxes.items()}
        ref = _torchvision_draws(v2.RandomResizedCrop(8, scale=scale, ratio=ratio), (3, *image),
                                 ("top", "left", "height", "width"), seed=k)
        _assert_resized_like_torchvision(ours, ref, image, scale, ratio)


def _assert_resized_like_torchvision(ours, ref, image, scale, ratio):
    h, w = image
    assert (ours["top"] >= 0).all() and (ours["top"] + ours["height"] <= h).all()
    assert (ours["left"] >= 0).all() and (ours["left"] + ours["width"] <= w).all()

    def derived(p):
        area = (p["height"] * p["width"]).double() / (h * w)
        aspect = torch.log(p["width"].double() / p["height"].double())
        rel_top = p["top"].double() / (h - p["height"] + 1).double()
        rel_left = p["left"].double() / (w - p["width"] + 1).double()
        return {"area": area, "log aspect": aspect, "relative top": rel_top, "relative left": rel_left}

    a, b = derived(ours), derived(ref)
    for key in a:
        stat, crit = ks_two_sample(a[key], b[key])
        _assert_below(stat, crit, f"KS {key}")
    for key in ("height", "width"):
        stat, crit = chi2_same(ours[key], ref[key])
        _assert_below(stat, crit, f"chi-square {key}")
    # fallback (every try rejected -> centre crop): the same rate
    fa, fb = _fallback(ours, image, scale, ratio).double().mean(), _fallback(ref, image, scale, ratio).double().mean()
    pooled = (fa + fb) / 2
    if 0 < pooled < 1:
        z = float((fa - fb) / math.sqrt(pooled * (1 - pooled) * 2 / N))
        assert abs(z) < 4.5, f"fallback rate {float(fa):.4f} vs torchvision {float(fb):.4f} (z = {z:.2f})"
    _assert_independent(a["area"], "area")


def test_resized_crop_fallback_case_is_exercised():
    """The tall case falls back often (so the rate test above means something); the 8x64 case always."""
    ours = BatchRandomResizedCrop(8).sample((N, 3, 10, 60), generator=_gen(3))
    rate = float(_fallback(ours, (10, 60), (0.08, 1.0), (3 / 4, 4 / 3)).double().mean())
    assert 0.05 < rate < 0.5
    always = BatchRandomResizedCrop(8, scale=(0.9, 1.0)).sample((100, 3, 8, 64), generator=_gen(3))
    assert _fallback(always, (8, 64), (0.9, 1.0), (3 / 4, 4 / 3)).all()


# --- cutout ----------------------------------------------------------------------------------

def test_cutout_offsets_uniform_inside_the_image():
    """BatchCutout places its square as torchvision's RandomErasing places its box: randint over every
    position inside the image."""
    params = BatchCutout(5).sample((N, 3, 13, 11), generator=_gen(4))
    for key, high in (("top", 13 - 5), ("left", 11 - 5)):
        stat, crit = chi2_uniform(params[key], 0, high)
        _assert_below(stat, crit, f"cutout {key}")
        _assert_independent(params[key], f"cutout {key}")


# --- the statistics themselves ---------------------------------------------------------------

def test_the_tests_reject_what_they_should():
    """A biased law fails each test (so a pass means something), a fair one passes."""
    g = _gen(5)
    fair = torch.randint(0, 9, (N,), generator=g)
    skewed = torch.where(torch.rand(N, generator=g) < 0.05, torch.zeros(N, dtype=torch.long), fair)
    assert chi2_uniform(fair, 0, 8)[0] < chi2_uniform(fair, 0, 8)[1]
    stat, crit = chi2_uniform(skewed, 0, 8)
    assert stat > crit
    assert chi2_same(skewed, fair)[0] > chi2_same(skewed, fair)[1]
    assert ks_two_sample(fair.double(), fair.double() + 0.5)[0] > ks_two_sample(fair.double(), fair.double())[1]
    assert abs(pearson(fair[:-1], fair[1:])) < 4 / math.sqrt(N)
    # Wilson-Hilferty vs tabulated 0.999 quantiles of chi-square: never below, at most 3.5 % above
    for df, exact in ((1, 10.828), (2, 13.816), (8, 26.124), (16, 39.252), (100, 149.449)):
        assert 0 <= (chi2_critical(df) - exact) / exact < 0.035


# --- joint draws on a segmentation store ------------------------------------------------------

@pytest.mark.slow
def test_joint_crop_and_flip_draws_read_from_a_mask_store_follow_torchvision(tmp_path):
    """The draws of a segmentation store's fused crop + flip, read back from the batches themselves: one
    13x11 sample whose channels 1 and 2 hold x + 1 and y + 1, read 10,000 times; the centre of each
    9x9 crop (always inside the image) gives (top, left), the row around it the flip, and the mask
    at the centre the same place. Offsets uniform over torchvision's range, flips at p, independent."""
    import dlstore
    from torchvision import tv_tensors

    yy, xx = torch.meshgrid(torch.arange(13), torch.arange(11), indexing="ij")
    image = torch.stack([torch.full_like(yy, 7), xx + 1, yy + 1]).to(torch.uint8)
    mask = ((xx + 2 * yy) % 5).to(torch.uint8)
    dlstore.convert([(tv_tensors.Image(image), tv_tensors.Mask(mask))], tmp_path / "one.shards",
                    static="center_crop=13x11", progress=False, workers=0)
    pipeline = v2.Compose([v2.RandomCrop(9, padding=3, fill={tv_tensors.Image: 0, tv_tensors.Mask: 255}),
                           v2.RandomHorizontalFlip()])
    ds = dlstore.open_dataset(tmp_path / "one.shards", transform=pipeline)
    images, masks = ds.get_batch([0] * N, generator=_gen(5))
    x, y = images[:, 1, 4, 4].long() - 1, images[:, 2, 4, 4].long() - 1
    top, left = y - 4 + 3, x - 4 + 3
    flips = images[:, 1, 4, 3] > images[:, 1, 4, 5]
    assert torch.equal(masks[:, 4, 4].long(), (x + 2 * y) % 5)
    for values, high, what in ((top, 13 + 6 - 9, "top"), (left, 11 + 6 - 9, "left")):
        stat, crit = chi2_uniform(values, 0, high)
        _assert_below(stat, crit, f"{what} vs uniform on [0, {high}]")
        _assert_independent(values, what)
    k = int(flips.sum())
    assert abs(k - N / 2) <= 4.5 * math.sqrt(N / 4), f"{k} flips of {N}"
    _assert_independent(flips.long(), "flip")
    assert abs(pearson(top, left)) < 4 / math.sqrt(N) and abs(pearson(top, flips.long())) < 4 / math.sqrt(N)
