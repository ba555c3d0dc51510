"""Hybrid transforms: splitting torchvision pipelines, the static check, the batch read path."""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms as v1
from torch.utils.data import DataLoader
from torchvision.datasets.folder import pil_loader
from torchvision.transforms import v2

import dlstore
import dlstore.data.batch_path as dataset_module
from dlstore.errors import StaticMismatchError, TransformSpecError
from dlstore.sources import scan
from dlstore.sources.demo import make_image_folder
from dlstore.transforms.planner import PerSample
from dlstore.transforms import (
    BatchCompose,
    BatchNormalize,
    BatchRandomCrop,
    BatchRandomHorizontalFlip,
    BatchRandomResizedCrop,
    HybridTransform,
    parse_static,
    split_transforms,
)

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def imagenet_train() -> v2.Compose:
    return v2.Compose([v2.RandomResizedCrop(224), v2.RandomHorizontalFlip(), v2.ToImage(),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


def imagenet_eval(resize: int = 256, crop: int = 224) -> v2.Compose:
    return v2.Compose([v2.Resize(resize), v2.CenterCrop(crop), v2.PILToTensor(),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


def cifar_train(static: list | None = None) -> v2.Compose:
    return v2.Compose([*(static or []), v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(), v2.ToImage(),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


def _names(ops) -> list[str]:
    return [type(t).__name__ for t in ops]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- splitting -----------------------------------------------------------------------------

def test_split_imagenet_train_is_all_dynamic():
    h = split_transforms(imagenet_train())
    assert h.static_spec == []
    assert _names(h.dynamic_ops) == ["RandomResizedCrop", "RandomHorizontalFlip", "ToDtype", "Normalize"]
    text = repr(h)
    assert "RandomResizedCrop: dynamic (random" in text and "ToImage: dropped" in text
    assert "variable-shape" in text   # nothing fixes the stored size: the user is told


def test_split_imagenet_eval_precomputes_resize_and_crop():
    h = split_transforms(imagenet_eval())
    assert h.static_spec == parse_static("resize=256,center_crop=224")
    assert _names(h.dynamic_ops) == ["ToDtype", "Normalize"]
    assert "static (once, at conversion): resize=256,center_crop=224x224" in repr(h)
    assert "ToDtype: dynamic (float output" in repr(h)


def test_split_cifar_train_and_static_prefix():
    h = split_transforms(cifar_train())
    assert h.static_spec == []
    assert _names(h.dynamic_ops) == ["RandomCrop", "RandomHorizontalFlip", "ToDtype", "Normalize"]
    h2 = split_transforms(cifar_train([v2.Resize(36), v2.CenterCrop(32)]))
    assert h2.static_spec == parse_static("resize=36,center_crop=32")
    assert _names(h2.dynamic_ops) == ["RandomCrop", "RandomHorizontalFlip", "ToDtype", "Normalize"]


def test_deterministic_op_after_a_random_one_stays_dynamic():
    h = split_transforms(v2.Compose([v2.Resize(40), v2.RandomCrop(36), v2.Resize(32), v2.Grayscale()]))
    assert h.static_spec == parse_static("resize=40")
    assert _names(h.dynamic_ops) == ["RandomCrop", "Resize", "Grayscale"]


def test_split_v1_pipeline_replaces_to_tensor():
    h = split_transforms(v1.Compose([v1.Resize(40), v1.CenterCrop(32), v1.RandomHorizontalFlip(), v1.ToTensor(),
                                     v1.Normalize(MEAN, STD)]))
    assert h.static_spec == parse_static("resize=40,center_crop=32")
    assert _names(h.dynamic_ops) == ["RandomHorizontalFlip", "ConvertImageDtype", "Normalize"]
    assert "ToTensor: replaced" in repr(h)
    assert h.dynamic_ops[1].dtype == torch.float32 and type(h.dynamic_ops[1]) is v1.ConvertImageDtype


class _PassThroughToTensor(v1.ToTensor):
    """Like timm's MaybeToTensor: ToTensor for PIL images, a tensor passed through unscaled."""

    def __call__(self, pic):
        return pic if isinstance(pic, torch.Tensor) else super().__call__(pic)


def test_split_maps_to_tensor_subclasses_and_their_result_equals_torchvision(folder):
    # A ToTensor subclass that passes tensors through would hand uint8 0..255 to Normalize.
    pipeline = [v1.CenterCrop(32), _PassThroughToTensor(), v1.Normalize(MEAN, STD)]
    h = split_transforms(pipeline)
    assert _names(h.device_ops) == ["ConvertImageDtype", "Normalize"] and "_PassThroughToTensor: replaced" in repr(h)
    img = pil_loader(next(folder.rglob("*.jpg")))
    want = v1.Compose(pipeline)(img)               # torchvision on the PIL image: ToTensor divides by 255
    assert torch.equal(h(img), want)


def test_split_has_three_stages_host_uint8_device_float():
    h = split_transforms(cifar_train([v2.Resize(36), v2.CenterCrop(32)]))
    assert _names(h.host_ops) == ["RandomCrop", "RandomHorizontalFlip"]
    assert _names(h.device_ops) == ["ToDtype", "Normalize"]
    assert h.dynamic_ops == h.host_ops + h.device_ops            # backwards compatible: the whole read part
    text = repr(h)
    assert text.index("static (once") < text.index("host (every read") < text.index("device (every read")
    assert "ToDtype: device stage from here on" in text
    # every op after the first float op is float data: it stays on the device stage
    h2 = split_transforms(v2.Compose([v2.RandomCrop(8), v2.ToDtype(torch.float32, scale=True),
                                      v2.RandomHorizontalFlip(), v2.Normalize(MEAN, STD)]))
    assert _names(h2.host_ops) == ["RandomCrop"]
    assert _names(h2.device_ops) == ["ToDtype", "RandomHorizontalFlip", "Normalize"]
    # a uint8 ToDtype is no float op; without a float op there is no device stage
    h3 = split_transforms(v2.Compose([v2.RandomCrop(8), v2.ToDtype(torch.uint8)]))
    assert _names(h3.host_ops) == ["RandomCrop", "ToDtype"] and h3.device_ops == []
    assert "device (every read, float, where the batch goes: loader(device=...)): none" in repr(h3)


def test_hybrid_constructor_places_the_device_stage_by_hand_or_splits():
    auto = HybridTransform("center_crop=32", [v2.RandomCrop(32), v2.ToDtype(torch.float32, scale=True)])
    assert _names(auto.host_ops) == ["RandomCrop"] and _names(auto.device_ops) == ["ToDtype"]
    by_hand = HybridTransform("center_crop=32", [v2.RandomCrop(32)],
                              device=[v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True)])
    assert _names(by_hand.device_ops) == ["RandomHorizontalFlip", "ToDtype"]
    assert _names(by_hand.dynamic_ops) == ["RandomCrop", "RandomHorizontalFlip", "ToDtype"]
    none = HybridTransform("center_crop=32", [v2.RandomCrop(32), v2.ToDtype(torch.float32, scale=True)], device=[])
    assert none.device_ops == [] and _names(none.host_ops) == ["RandomCrop", "ToDtype"]
    host = by_hand.host_only()
    assert host.static_spec == by_hand.static_spec and host.device_ops == [] and _names(host.host_ops) == ["RandomCrop"]


def test_hybrid_constructor_refuses_random_static_part():
    with pytest.raises(TransformSpecError, match="freeze one random draw"):
        HybridTransform([v2.RandomCrop(32)], [v2.RandomHorizontalFlip()])


# --- a store converted with the hybrid ----------------------------------------------------

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("hy") / "img", classes=3, per_class=8, size=(40, 48))


@pytest.fixture(scope="module")
def cifar_store(folder, tmp_path_factory):
    h = split_transforms(cifar_train([v2.Resize(36), v2.CenterCrop(32)]))
    dst = tmp_path_factory.mktemp("hy") / "c.shards"
    dlstore.convert(folder, dst, static=h, workers=0, progress=False)
    return dst, h


def test_convert_with_hybrid_then_read_equals_the_whole_pipeline(folder, cifar_store, tmp_path):
    dst, h = cifar_store
    assert dlstore.open_dataset(dst).manifest["static"] == h.static_spec
    ds = dlstore.open_dataset(dst, transform=h)
    pipeline = cifar_train([v2.Resize(36), v2.CenterCrop(32)])
    paths = [p for p, _ in scan(folder).samples]
    for i in (0, 5, 23):
        torch.manual_seed(100 + i)
        image, label = ds[i]
        torch.manual_seed(100 + i)
        expected = pipeline(pil_loader(paths[i]))
        assert label == ds.targets[i]
        torch.testing.assert_close(image, expected, atol=0, rtol=0)
    # deterministic pipeline: store + hybrid == torchvision on the source files, exactly
    h_eval = split_transforms(imagenet_eval(36, 32))
    dlstore.convert(folder, tmp_path / "e.shards", static=h_eval, workers=0, progress=False)
    ev = dlstore.open_dataset(tmp_path / "e.shards", transform=h_eval)
    for i in (1, 17):
        torch.testing.assert_close(ev[i][0], imagenet_eval(36, 32)(pil_loader(paths[i])), atol=0, rtol=0)
        torch.testing.assert_close(h_eval(pil_loader(paths[i])), ev[i][0], atol=0, rtol=0)


def test_static_mismatch_is_an_error_showing_both_specs(cifar_store):
    dst, _ = cifar_store
    other = split_transforms(cifar_train([v2.Resize(40), v2.CenterCrop(32)]))
    with pytest.raises(StaticMismatchError) as err:
        dlstore.open_dataset(dst, transform=other)
    text = str(err.value)
    assert "'resize=36,center_crop=32x32'" in text and "'resize=40,center_crop=32x32'" in text
    assert str(dst) in text
    assert isinstance(err.value, ValueError)
    # differences describe() does not show (antialias) are spelled out in full
    subtle = HybridTransform([v2.Resize(36, antialias=False), v2.CenterCrop(32)], [v2.RandomHorizontalFlip()])
    with pytest.raises(StaticMismatchError, match="'antialias': False"):
        dlstore.open_dataset(dst, transform=subtle)
    # a plain transform is not checked: it says nothing about the static part
    dlstore.open_dataset(dst, transform=v2.RandomHorizontalFlip())


def test_batch_ops_are_mapped_and_unmappable_ops_run_per_sample(cifar_store):
    dst, h = cifar_store
    ds = dlstore.open_dataset(dst, transform=h)
    assert ds.per_sample_ops == []
    assert [type(t) for t in ds.batch_ops] == [BatchRandomCrop, BatchRandomHorizontalFlip, BatchNormalize]
    assert ds.batch_ops[2].mean == MEAN and ds.batch_ops[2].dtype == torch.float32
    jitter = HybridTransform(h.static_spec, [v2.RandomCrop(32, padding=4), v2.ColorJitter(0.3),
                                             v2.RandomHorizontalFlip(), v2.ToDtype(torch.float16, scale=True)])
    ds2 = dlstore.open_dataset(dst, transform=jitter)
    # ColorJitter keeps the size: it runs per sample inside the batch, the ops around it per batch
    assert ds2.per_sample_ops == []
    assert [type(t) for t in ds2.batch_ops] == [BatchRandomCrop, PerSample, BatchRandomHorizontalFlip, BatchNormalize]
    assert type(ds2.batch_ops[1].op) is v2.ColorJitter
    images, labels = ds2.get_batch(range(6), generator=_gen(0))
    assert images.shape == (6, 3, 32, 32) and images.dtype == torch.float16
    assert labels.tolist() == ds2.targets[:6]


@pytest.mark.parametrize("crop,padding,fill", [(32, 4, 0), (24, 0, 0), (28, (1, 6), 7), (32, 40, 3)])
@pytest.mark.parametrize("kernel", ["windows", "loop"])
def test_fused_gather_equals_unfused_batch_ops(cifar_store, monkeypatch, crop, padding, fill, kernel):
    dst, h = cifar_store
    if kernel == "loop":
        monkeypatch.setattr(dataset_module, "VECTORISED_MAX_PIXELS", 0)
    c, f = BatchRandomCrop(crop, padding=padding, fill=fill), BatchRandomHorizontalFlip()
    ds = dlstore.open_dataset(dst, batch_transform=BatchCompose([c, f]))
    fused = dlstore.open_dataset(dst, transform=HybridTransform(
        h.static_spec, [v2.RandomCrop(crop, padding=padding, fill=fill), v2.RandomHorizontalFlip()]))
    assert fused.batch_path.crop is not None and fused.batch_path.flip is not None and fused.batch_rest == []
    idx = [5, 0, 23, 7, 7, 12, 3, 19, 2, 11]
    raw, _ = ds.read_batch(idx)
    for seed in range(3):
        expected = BatchCompose([c, f])(raw, _gen(seed))
        got, labels = fused.get_batch(idx, generator=_gen(seed))
        assert torch.equal(got, expected), f"seed {seed}"
        assert torch.equal(ds.get_batch(idx, generator=_gen(seed))[0], expected)
        assert labels.tolist() == [ds.targets[i] for i in idx]
    assert torch.equal(raw, ds.read_batch(idx)[0]), "the store's samples were modified"


def test_fused_flip_alone_and_crop_alone(cifar_store):
    dst, h = cifar_store
    for ops, batch in (([v2.RandomHorizontalFlip(0.5)], BatchRandomHorizontalFlip(0.5)),
                       ([v2.RandomCrop(30, padding=2)], BatchRandomCrop(30, padding=2))):
        ds = dlstore.open_dataset(dst, transform=HybridTransform(h.static_spec, ops))
        raw, _ = ds.read_batch(range(24))
        assert torch.equal(ds.get_batch(range(24), generator=_gen(1))[0], batch(raw, _gen(1)))


@pytest.mark.slow
def test_loader_batches_with_workers_are_complete_and_reproducible(cifar_store):
    dst, h = cifar_store
    ds = dlstore.open_dataset(dst, transform=h)

    def epoch(seed: int, workers: int, context=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        dl = dlstore.loader(ds, 5, shuffle=True, num_workers=workers, generator=_gen(seed),
                            multiprocessing_context=context)
        return list(dl)

    a = epoch(0, 2, "fork")
    assert [len(y) for _, y in a] == [5, 5, 5, 5, 4]
    assert all(x.shape[1:] == (3, 32, 32) and x.dtype == torch.float32 for x, _ in a)
    assert sorted(torch.cat([y for _, y in a]).tolist()) == sorted(ds.targets)
    b = epoch(0, 2, "fork")
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
    c = epoch(1, 2, "fork")
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))
    s = epoch(0, 2, "spawn")
    assert sorted(torch.cat([y for _, y in s]).tolist()) == sorted(ds.targets)
    assert all(torch.equal(xa, xs) for (xa, _), (xs, _) in zip(a, s)), "fork and spawn disagree"


def test_variable_shape_store_runs_size_fixing_op_per_sample_then_batches(tmp_path):
    src = make_image_folder(tmp_path / "var", classes=2, per_class=5, size=(30, 40), vary_size=True)
    h = split_transforms(v2.Compose([v2.RandomResizedCrop(16, scale=(0.5, 1.0)), v2.RandomHorizontalFlip(),
                                     v2.ToImage(), v2.ToDtype(torch.float16, scale=True)]))
    dlstore.convert(src, tmp_path / "v.shards", static=h, workers=0, progress=False)
    ds = dlstore.open_dataset(tmp_path / "v.shards", transform=h)
    assert ds.shape is None
    assert _names(ds.per_sample_ops) == ["RandomResizedCrop"]
    assert [type(t) for t in ds.batch_ops] == [BatchRandomHorizontalFlip, BatchNormalize]
    batches = list(dlstore.loader(ds, 4, num_workers=2))
    assert [tuple(x.shape) for x, _ in batches] == [(4, 3, 16, 16), (4, 3, 16, 16), (2, 3, 16, 16)]
    assert batches[0][0].dtype == torch.float16
    flip_only = dlstore.open_dataset(tmp_path / "v.shards", transform=HybridTransform(None, [v2.RandomHorizontalFlip()]))
    with pytest.raises(TransformSpecError, match="different shapes"):
        flip_only.get_batch([0, 1, 2])


def test_batch_transform_argument_through_loader_and_plain_dataloader(cifar_store):
    dst, _ = cifar_store
    bt = BatchCompose([BatchRandomResizedCrop(16), BatchNormalize(dtype=torch.float16)])
    ds = dlstore.open_dataset(dst, batch_transform=bt)
    x, y = next(iter(dlstore.loader(ds, 8)))
    assert x.shape == (8, 3, 16, 16) and x.dtype == torch.float16 and y.tolist() == ds.targets[:8]
    x2, y2 = next(iter(DataLoader(ds, batch_size=8)))     # __getitems__ path, default_collate
    assert x2.shape == (8, 3, 16, 16) and y2.tolist() == ds.targets[:8]
    assert ds[3][0].shape == (3, 16, 16)
    with pytest.raises(TypeError, match="StoreDataset"):
        dlstore.loader(list(range(4)), 2)


@pytest.mark.parametrize("make", [v2.RandomCrop, v1.RandomCrop])
def test_mapped_random_crop_pads_like_torchvision(make):
    # a crop the size of the padded image is deterministic: the batch op must give torchvision's pixels
    x = torch.randint(0, 256, (4, 3, 10, 12), dtype=torch.uint8)
    t = make((10 + 2 + 4, 12 + 1 + 3), padding=[1, 2, 3, 4], fill=9)
    ds_ops = dlstore.transforms.batch_plan([t], fixed_shape=True)[1]
    assert isinstance(ds_ops[0], BatchRandomCrop) and ds_ops[0].padding == (1, 2, 3, 4)
    expected = torch.stack([t(s) for s in x])
    assert torch.equal(ds_ops[0](x), expected)


def test_loader_worker_batches_equal_in_process_batches(cifar_store, monkeypatch):
    dst, h = cifar_store
    plain = dlstore.open_dataset(dst)
    got = list(dlstore.loader(plain, 7, num_workers=2))
    assert all(x.dtype == torch.uint8 for x, _ in got)
    assert torch.equal(torch.cat([x for x, _ in got]), plain.read_batch(range(len(plain)))[0])
    # per-sample loop kernel (as for large images), in forked workers writing to shared memory
    monkeypatch.setattr(dataset_module, "VECTORISED_MAX_PIXELS", 0)
    ds = dlstore.open_dataset(dst, transform=HybridTransform(h.static_spec, [v2.RandomCrop(32, padding=4),
                                                                           v2.RandomHorizontalFlip()]))
    ref = dlstore.open_dataset(dst, batch_transform=BatchCompose([BatchRandomCrop(32, padding=4),
                                                                  BatchRandomHorizontalFlip()]))
    a = list(dlstore.loader(ds, 6, shuffle=True, num_workers=2, generator=_gen(3),
                            multiprocessing_context="fork"))
    b = list(dlstore.loader(ref, 6, shuffle=True, num_workers=2, generator=_gen(3),
                            multiprocessing_context="fork"))
    assert len(a) == 4
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))


@pytest.mark.parametrize("kernel", ["plain", "loop"])
def test_batch_buffers_are_reused_only_when_nothing_refers_to_them(cifar_store, monkeypatch, kernel):
    """A loader's buffers (``BatchBuffers``), handed to get_batch as ``out=``."""
    from dlstore.data.loaders.buffers import BatchBuffers

    dst, h = cifar_store
    monkeypatch.setattr(dataset_module, "VECTORISED_MAX_PIXELS", 0)
    ds = dlstore.open_dataset(dst) if kernel == "plain" else \
        dlstore.open_dataset(dst, transform=HybridTransform(h.static_spec, [v2.RandomCrop(32, padding=4)]))
    reference = dlstore.open_dataset(dst)
    buffers = BatchBuffers(2)

    def build(idx, seed):
        out = buffers.take(ds.batch_shape(len(idx)))
        batch = ds.get_batch(idx, generator=_gen(seed), out=out)[0]
        assert batch is out
        return batch

    idx_a, idx_b = [0, 1, 2, 3], [20, 21, 22, 23]
    a = build(idx_a, 0)
    a_copy, a_ptr = a.clone(), a.data_ptr()
    view = a[1:3]
    del a
    b = build(idx_b, 1)
    c = build(idx_b, 2)
    assert torch.equal(view, a_copy[1:3]), "a batch still in use was overwritten"
    assert len({a_ptr, b.data_ptr(), c.data_ptr()}) == 3
    if kernel == "plain":
        assert torch.equal(b, reference.read_batch(idx_b)[0])
    ptr = b.data_ptr()
    del b
    d = build(idx_b, 3)
    assert d.data_ptr() == ptr, "a free buffer was not reused"


@pytest.mark.parametrize("suffix", [".shards", ".lmdb", ".h5"])
@pytest.mark.parametrize("kernel", ["windows", "loop"])
def test_hybrid_batch_path_on_every_format(folder, tmp_path, monkeypatch, suffix, kernel):
    if kernel == "loop":
        monkeypatch.setattr(dataset_module, "VECTORISED_MAX_PIXELS", 0)
    h = split_transforms(v2.Compose([v2.Resize(20), v2.CenterCrop(16), v2.RandomCrop(16, padding=3),
                                     v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True)]))
    dlstore.convert(folder, tmp_path / f"s{suffix}", static=h, workers=0, progress=False)
    ds = dlstore.open_dataset(tmp_path / f"s{suffix}", transform=h)
    plain = dlstore.open_dataset(tmp_path / f"s{suffix}")
    idx = [3, 0, 17, 9, 9, 22]
    raw, labels = plain.read_batch(idx)
    expected = BatchCompose(ds.batch_ops)(raw, _gen(5))
    got, got_labels = ds.get_batch(idx, generator=_gen(5))
    assert torch.equal(got, expected) and torch.equal(got_labels, labels)
    assert torch.equal(plain.get_batch(idx)[0], raw)
    batches = list(dlstore.loader(ds, 10, shuffle=True, num_workers=2))
    assert sorted(torch.cat([y for _, y in batches]).tolist()) == sorted(ds.targets)


def test_loader_in_process_draws_from_its_generator(cifar_store):
    dst, h = cifar_store
    ds = dlstore.open_dataset(dst, transform=h)
    torch.manual_seed(1)
    a = list(dlstore.loader(ds, 8, shuffle=True, generator=_gen(0)))
    torch.manual_seed(2)      # the global RNG does not matter
    b = list(dlstore.loader(ds, 8, shuffle=True, generator=_gen(0)))
    c = list(dlstore.loader(ds, 8, shuffle=True, generator=_gen(1)))
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))
