"""torchvision v1 ops, timm's ops and the planner's per-sample steps on the batch paths, held to their
own library's kernels (the harness reads a v1 op with ``torchvision.transforms.functional``).

Rows of docs/fidelity.md's matrix: v1 RandomCrop / RandomHorizontalFlip / RandomResizedCrop /
ConvertImageDtype + Normalize on their batch equivalents (``get_batch`` on every format, the loader
in process, in threads, in forked workers, the GPU loader), timm's bilinear
RandomResizedCropAndInterpolation and MaybeToTensor, and per-sample ops run inside the batch
(RandomErasing after Normalize).
"""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms as v1
from fidelity_harness import check_path, gen, make_store
from torchvision.transforms import v2

import dlstore
from dlstore.transforms import BatchNormalize, BatchRandomCrop, BatchRandomResizedCrop
from dlstore.transforms.planner import PerSample, plan

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
H, W = 13, 11
FORMATS = ["shards", "lmdb", "hdf5"]

CASES = {
    "v1-crop-int-padding": [v1.RandomCrop(10, padding=2)],
    "v1-crop-2-padding-reflect": [v1.RandomCrop(12, padding=(1, 3), padding_mode="reflect")],
    "v1-crop-4-padding-edge": [v1.RandomCrop((12, 10), padding=[1, 2, 3, 0], padding_mode="edge")],
    "v1-crop-pad-if-needed": [v1.RandomCrop((15, 13), pad_if_needed=True, fill=7)],
    "v1-crop-padding+pad-if-needed-symmetric": [v1.RandomCrop((17, 16), padding=1, pad_if_needed=True,
                                                              padding_mode="symmetric")],
    "v1-flip": [v1.RandomHorizontalFlip()],
    "v1-resized-crop": [v1.RandomResizedCrop(8, scale=(0.3, 1.0))],
    "v1-resized-crop-up": [v1.RandomResizedCrop((15, 17))],
    "v1-convert+normalize": [v1.ConvertImageDtype(torch.float32), v1.Normalize(MEAN, STD)],
    "v1-pipeline": [v1.RandomCrop(10, padding=2), v1.RandomHorizontalFlip(), v1.ConvertImageDtype(torch.float32),
                    v1.Normalize(MEAN, STD)],
    "v1-erasing-after-normalize": [v1.RandomHorizontalFlip(), v1.ConvertImageDtype(torch.float32),
                                   v1.Normalize(MEAN, STD), v1.RandomErasing(p=0.7, value=0)],
    "v2-erasing-after-normalize": [v2.RandomCrop(10, padding=1), v2.ToDtype(torch.float32, scale=True),
                                   v2.Normalize(MEAN, STD), v2.RandomErasing(p=0.7, value=0)],
}
# What each case runs per batch on a fixed-shape store (none of them needs a per-sample head)
STEPS = {
    "v1-crop-padding+pad-if-needed-symmetric": ["PerSample"],   # v1 pads twice, reflecting its own padding
    "v1-resized-crop": ["BatchRandomResizedCrop"],
    "v1-convert+normalize": ["BatchNormalize"],
    "v1-erasing-after-normalize": ["BatchRandomHorizontalFlip", "BatchNormalize", "PerSample"],
    "v2-erasing-after-normalize": ["BatchRandomCrop", "BatchNormalize", "PerSample"],
}


SLOW = ("v1-resized-crop-up",)   # every box of an upscaled crop: ~15 s of candidates


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("planned")
    return {fmt: make_store(root, fmt, (H, W)) for fmt in FORMATS}


def _open(path, case: str):
    return dlstore.open_dataset(path, transform=v1.Compose(CASES[case]) if case.startswith("v1")
                                else v2.Compose(CASES[case]))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_get_batch_equals_the_ops_own_kernels(stores, case, fmt):
    ds = _open(stores[fmt], case)
    assert ds.per_sample_ops == []
    if case in STEPS:
        assert [type(b).__name__ for b in ds.batch_ops] == STEPS[case]
    idx = [5, 0, 11, 7, 7, 2, 9]
    raw, _ = ds.read_batch(idx)
    for seed in (0, 1):
        got, _ = ds.get_batch(idx, generator=gen(seed))
        again, _ = ds.get_batch(idx, generator=gen(seed))
        check_path(CASES[case], raw, got, what=f"{case} {fmt} seed {seed}")
        assert torch.equal(got, again)    # every draw from the generator, per-sample steps too


@pytest.mark.parametrize("case", ["v1-pipeline", "v1-resized-crop", "v1-erasing-after-normalize"])
@pytest.mark.parametrize("backend", ["threads", "forked workers", "in process"])
def test_loaders_equal_the_ops_own_kernels(stores, case, backend):
    ds = _open(stores["lmdb"], case)
    options = {"threads": {"backend": "threads", "num_threads": 2},
               "forked workers": {"num_workers": 2, "multiprocessing_context": "fork"},
               "in process": {"backend": "dataloader"}}[backend]
    raw, labels = ds.read_batch(range(len(ds)))
    batches = list(dlstore.loader(ds, 5, generator=gen(3), **options))
    start = 0
    for x, y in batches:
        check_path(CASES[case], raw[start:start + len(x)], x, what=f"{case} {backend} batch at {start}")
        assert torch.equal(y, labels[start:start + len(x)])
        start += len(x)
    assert start == len(ds)
    # the batches do not depend on the back-end nor on how many threads or workers build them
    one = list(dlstore.loader(ds, 5, generator=gen(3), backend="threads", num_threads=1))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(batches, one))


@pytest.mark.parametrize("case", ["v1-pipeline", "v1-resized-crop", "v1-erasing-after-normalize"])
def test_gpu_loader_equals_the_ops_own_kernels(stores, case):
    gpu = dlstore.GPUDataset(stores["shards"], device="cpu", dtype=torch.uint8, transform=v1.Compose(CASES[case]))
    raw = dlstore.open_dataset(stores["shards"]).read_batch(gpu.store_indices.tolist())[0]
    images, _ = next(iter(dlstore.loader(gpu, 64, seed=0)))
    check_path(CASES[case], raw, images, what=f"{case} GPU loader")


def test_v1_conversions_scale_as_v1_divides():
    """ConvertImageDtype / ToTensor: x.to(float32) / 255; v2's ToDtype multiplies by 1/255 (one ulp away)."""
    from PIL import Image

    values = torch.arange(256, dtype=torch.uint8).view(1, 16, 16).expand(3, 16, 16).contiguous()
    v1_div = v1.ConvertImageDtype(torch.float32)(values)
    assert torch.equal(v1.ToTensor()(Image.fromarray(values.permute(1, 2, 0).numpy())), v1_div)
    mapped = plan(v1.Compose([v1.ConvertImageDtype(torch.float32), v1.Normalize(MEAN, STD)])).split(fixed_shape=True)[1]
    assert [type(m) for m in mapped] == [BatchNormalize] and mapped[0].divide
    assert torch.equal(mapped[0](values[None])[0], v1.Normalize(MEAN, STD)(v1_div))
    to_tensor = plan(v1.Compose([v1.ToTensor(), v1.Normalize(MEAN, STD)]))
    assert torch.equal(to_tensor.sample_transform(values), v1.Normalize(MEAN, STD)(v1_div))
    v2_mul = v2.ToDtype(torch.float32, scale=True)(values)
    assert not torch.equal(v1_div, v2_mul)     # why the two are told apart
    assert not plan([v2.ToDtype(torch.float32, scale=True)]).split(fixed_shape=True)[1][0].divide


def test_v1_ops_map_to_batch_equivalents_with_v1_arithmetic():
    head, tail = plan(v1.Compose([v1.RandomResizedCrop(8), v1.RandomCrop(6, padding=(1, 2)),
                                  v1.RandomHorizontalFlip(0.3)])).split(fixed_shape=True)
    assert head == [] and [type(t) for t in tail][:2] == [BatchRandomResizedCrop, BatchRandomCrop]
    assert tail[0].kernel == "v1" and tail[1].padding == (1, 2, 1, 2) and tail[2].p == 0.3
    assert plan(v2.Compose([v2.RandomResizedCrop(8)])).split(fixed_shape=True)[1][0].kernel == "v2"
    bicubic = plan(v1.Compose([v1.RandomResizedCrop(8, interpolation=v1.InterpolationMode.BICUBIC)]))
    head, tail = bicubic.split(fixed_shape=True)    # no batch equivalent: v1's own op, per sample in the batch
    assert isinstance(tail[0], PerSample) and type(tail[0].op) is v1.RandomResizedCrop


# --- timm ---------------------------------------------------------------------------------------

def _timm_ops():
    timm_transforms = pytest.importorskip("timm.data.transforms", reason="timm is not installed")
    return [timm_transforms.RandomResizedCropAndInterpolation(8, scale=(0.3, 1.0), interpolation="bilinear"),
            v1.RandomHorizontalFlip(), timm_transforms.MaybeToTensor(), v1.Normalize(MEAN, STD)]


@pytest.mark.slow     # every box of timm's crop: ~20 s of candidates
@pytest.mark.parametrize("fmt", FORMATS)
def test_timm_bilinear_crop_and_maybe_to_tensor_on_the_batch_path(stores, fmt):
    ops = _timm_ops()
    ds = dlstore.open_dataset(stores[fmt], transform=v1.Compose(ops))
    assert ds.per_sample_ops == [] and [type(b).__name__ for b in ds.batch_ops] == [
        "BatchRandomResizedCrop", "BatchRandomHorizontalFlip", "BatchNormalize"]
    assert ds.batch_ops[0].kernel == "v1" and ds.batch_ops[2].divide
    reference = [ops[0], ops[1], v1.ConvertImageDtype(torch.float32), ops[3]]   # MaybeToTensor on a PIL image
    raw, _ = ds.read_batch(range(len(ds)))
    for seed in (0, 1):
        got, _ = ds.get_batch(list(range(len(ds))), generator=gen(seed))
        check_path(reference, raw, got, what=f"timm {fmt} seed {seed}")


@pytest.mark.parametrize("tv", [v1, v2], ids=["v1", "v2"])
def test_a_jpeg_stores_decode_time_crop_uses_the_ops_own_kernel(tmp_path, tv):
    """An encoded store crops as each record decodes (``decode_crop``): with v1's kernel for a v1 op."""
    from dlstore.sources.demo import make_image_folder

    src = make_image_folder(tmp_path / "src", classes=2, per_class=2, size=(11, 10), vary_size=True)
    store = dlstore.convert(src, tmp_path / "j.shards", encoding="jpeg", quality=90, workers=0, progress=False).path
    ops = [tv.RandomResizedCrop(6, scale=(0.3, 1.0)), tv.RandomHorizontalFlip()]
    ds = dlstore.open_dataset(store, transform=tv.Compose(ops))
    assert ds.decode_crop is not None and ds.decode_crop.kernel == ("v1" if tv is v1 else "v2")
    for seed in (0, 1):
        got, _ = ds.get_batch(list(range(len(ds))), generator=gen(seed))
        for j in range(len(ds)):     # each record its own size: one sample at a time
            check_path(ops, ds.read(j)[None], got[j:j + 1], what=f"{tv.__name__} sample {j} seed {seed}")
