"""Segmentation stores: (image, mask) pairs converted into every format and read back, each against
torchvision v2 on ``(tv_tensors.Image, tv_tensors.Mask)`` with the same parameters."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

import dlstore
from dlstore.errors import (
    ArgumentError,
    SourceError,
    StoreCorruptError,
    TransformSpecError,
    VariableShapeError,
)
from dlstore.transforms import compiled

FORMATS = ("shards", "lmdb", "hdf5")
IGNORE = 255


def _pairs(root, sizes, classes=6, seed=0):
    """Real JPEG images and palette PNG masks of ``sizes`` (H, W) under root/images, root/masks."""
    rng = np.random.default_rng(seed)
    for k, (h, w) in enumerate(sizes):
        (root / "images" / "a").mkdir(parents=True, exist_ok=True)
        (root / "masks" / "a").mkdir(parents=True, exist_ok=True)
        yy, xx = np.mgrid[:h, :w]
        image = np.stack([(xx * 7 + k) % 256, (yy * 5) % 256, rng.integers(0, 256, (h, w))], -1).astype(np.uint8)
        Image.fromarray(image).save(root / "images" / "a" / f"s{k:02d}.jpg", quality=90)
        mask = ((xx // 5 + yy // 3 + k) % classes).astype(np.uint8)
        mask[rng.random((h, w)) < 0.02] = IGNORE
        Image.fromarray(mask, "P").save(root / "masks" / "a" / f"s{k:02d}.png")


STATIC = "resize=36,center_crop=34x40"
STATIC_V2 = [v2.Resize(36), v2.CenterCrop([34, 40])]   # the same, as a torchvision user writes it


def _reference_static(root, k):
    """What v2 makes of pair k's files as a segmentation Dataset reads them (the image a PIL image, the
    palette mask's indices a Mask), the image then PILToTensor: (uint8 (C, H, W), (H, W))."""
    image = Image.open(root / "images" / "a" / f"s{k:02d}.jpg").convert("RGB")
    mask = tv_tensors.Mask(torch.from_numpy(np.array(Image.open(root / "masks" / "a" / f"s{k:02d}.png"))))
    out = v2.Compose(STATIC_V2)(image, mask)
    return v2.PILToTensor()(out[0]), out[1].as_subclass(torch.Tensor)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Stores of 12 pairs of odd sizes (some smaller than the crop), resize + center_crop, every format."""
    root = tmp_path_factory.mktemp("seg")
    sizes = [(37 + 3 * k, 50 - 2 * k) for k in range(10)] + [(20, 23), (31, 17)]
    _pairs(root, sizes)
    static = STATIC
    made = {fmt: root / f"store.{fmt}" for fmt in FORMATS}
    for fmt, dst in made.items():
        dlstore.convert(root / "images", dst, masks=root / "masks", static=static, store_format=fmt,
                        progress=False, workers=0)
    return root, static, made


@pytest.mark.parametrize("fmt", FORMATS)
def test_stored_pairs_equal_v2_static_on_the_files(stores, fmt):
    root, _, made = stores
    ds = dlstore.open_dataset(made[fmt])
    assert len(ds) == 12 and ds.shape == (3, 34, 40) and ds.fields.mask_dtype == "uint8"
    for k in range(len(ds)):
        image, mask = ds[k]
        ref_image, ref_mask = _reference_static(root, k)
        assert image.dtype == torch.uint8 and mask.dtype == torch.uint8 and mask.shape == (34, 40)
        assert torch.equal(image, ref_image), k
        assert torch.equal(mask, ref_mask), k
    images, masks = ds.read_batch(list(range(12)))
    assert torch.equal(masks[3], ds[3][1]) and torch.equal(images[5], ds[5][0])


def _draw_reference(ds, indices, transform, seed):
    """v2's functional kernels on each (Image, Mask) pair, with what get_batch draws from ``seed``:
    the crop's (top, left) first, then the flips, as the ops draw in order."""
    crop_op = transform.transforms[0]
    h, w = ds.shape[1:]
    g = torch.Generator().manual_seed(seed)
    from dlstore.transforms.joint import plan_joint

    joint = plan_joint(transform)
    crop = joint.head[0].crop
    params = crop.sample((len(indices), 3, h, w), generator=g)
    flips = joint.head[1].sample((len(indices), 3, *crop.size), generator=g)["flip"]
    images, masks = [], []
    padding = list(crop.padding_for(h, w))
    image_fill = crop_op.fill[tv_tensors.Image] if isinstance(crop_op.fill, dict) else crop_op.fill
    mask_fill = crop_op.fill.get(tv_tensors.Mask, 0) if isinstance(crop_op.fill, dict) else crop_op.fill
    for k, i in enumerate(indices):
        image, mask = ds.read(i)
        pair = [F.pad(tv_tensors.Image(image), padding, fill=image_fill),
                F.pad(tv_tensors.Mask(mask), padding, fill=mask_fill)]
        top, left = int(params["top"][k]), int(params["left"][k])
        pair = [F.crop(x, top, left, *crop.size) for x in pair]
        if flips[k]:
            pair = [F.horizontal_flip(x) for x in pair]
        images.append(pair[0].as_subclass(torch.Tensor))
        masks.append(pair[1].as_subclass(torch.Tensor))
    return torch.stack(images), torch.stack(masks)


@pytest.mark.parametrize("kernel", ["compiled", "numpy"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(FORMATS), size=st.tuples(st.integers(8, 34), st.integers(8, 40)),
       pad=st.integers(0, 9), image_fill=st.integers(0, 255), mask_fill=st.sampled_from([0, 7, 255]),
       seed=st.integers(0, 2**31 - 1), indices=st.lists(st.integers(0, 11), min_size=1, max_size=9))
def test_batches_equal_v2_on_image_and_mask(stores, monkeypatch, kernel, fmt, size, pad, image_fill, mask_fill,
                                            seed, indices):
    """RandomCrop (padding, a fill per type) + RandomHorizontalFlip fused into the gather, by the compiled
    kernel and by the numpy loop, equal v2 on each pair with the drawn parameters."""
    if kernel == "compiled" and not compiled.available():
        pytest.skip(f"compiled kernel: {compiled.unavailable_reason()}")
    monkeypatch.setattr(compiled, "available", lambda: kernel == "compiled")
    transform = v2.Compose([v2.RandomCrop(list(size), padding=pad,
                                          fill={tv_tensors.Image: image_fill, tv_tensors.Mask: mask_fill}),
                            v2.RandomHorizontalFlip()])
    ds = dlstore.open_dataset(stores[2][fmt], transform=transform)
    assert ds.fuses_crop_flip
    images, masks = ds.get_batch(indices, generator=torch.Generator().manual_seed(seed))
    ref_images, ref_masks = _draw_reference(ds, indices, transform, seed)
    assert torch.equal(images, ref_images)
    assert torch.equal(masks, ref_masks)


@pytest.mark.parametrize("fmt", FORMATS)
def test_resized_crop_resamples_the_mask_nearest(stores, fmt):
    """RandomResizedCrop: the image bilinear (antialiased), the mask by v2's Mask kernel, same box."""
    op = v2.RandomResizedCrop((24, 28), scale=(0.2, 1.0))
    ds = dlstore.open_dataset(stores[2][fmt], transform=v2.Compose([op, v2.RandomHorizontalFlip(p=0.5)]))
    indices = list(range(12))
    images, masks = ds.get_batch(indices, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    rrc = ds.plan.head[0]
    params = rrc.sample((12, 3, *ds.shape[1:]), generator=g)
    flips = ds.plan.head[1].sample((12, 3, 24, 28), generator=g)["flip"]
    for k, i in enumerate(indices):
        image, mask = ds.read(i)
        box = [int(params[n][k]) for n in ("top", "left", "height", "width")]
        ref = [F.resized_crop(tv_tensors.Image(image), *box, [24, 28], antialias=True),
               F.resized_crop(tv_tensors.Mask(mask), *box, [24, 28])]
        if flips[k]:
            ref = [F.horizontal_flip(x) for x in ref]
        assert torch.equal(images[k], ref[0].as_subclass(torch.Tensor)), k
        assert torch.equal(masks[k], ref[1].as_subclass(torch.Tensor)), k
    assert set(masks.unique().tolist()) <= set(range(6)) | {IGNORE}   # nearest: no blended class


def test_colour_and_dtype_ops_touch_only_the_image(stores):
    """The tail after the joint ops (v2 passes a Mask through them) runs on the images only: the masks
    are those of the head alone, the images normalised."""
    head = [v2.RandomCrop(30, padding=2, fill={tv_tensors.Image: 0, tv_tensors.Mask: IGNORE}),
            v2.RandomHorizontalFlip()]
    tail = [v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.25] * 3)]
    plain = dlstore.open_dataset(stores[2]["shards"], transform=v2.Compose(head))
    full = dlstore.open_dataset(stores[2]["shards"], transform=v2.Compose(head + tail))
    a_images, a_masks = plain.get_batch(range(12), generator=torch.Generator().manual_seed(1))
    b_images, b_masks = full.get_batch(range(12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(a_masks, b_masks) and b_masks.dtype == torch.uint8
    assert b_images.dtype == torch.float32
    torch.testing.assert_close(b_images, (a_images.float() / 255 - 0.5) / 0.25)


def test_getitem_runs_the_v2_pipeline_on_the_pair(stores):
    """ds[i] is the pipeline as given, on (Image, Mask): torchvision's own result for the same seed."""
    transform = v2.Compose([v2.RandomCrop(30, padding=3, fill={tv_tensors.Image: 9, tv_tensors.Mask: IGNORE}),
                            v2.RandomHorizontalFlip()])
    ds = dlstore.open_dataset(stores[2]["lmdb"], transform=transform)
    image, mask = ds.read(4)
    torch.manual_seed(11)
    ref = transform(tv_tensors.Image(image), tv_tensors.Mask(mask))
    torch.manual_seed(11)
    got = ds[4]
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert type(got[0]) is torch.Tensor and type(got[1]) is torch.Tensor


@pytest.mark.parametrize("transform, problem", [
    (v2.Compose([v2.RandomCrop(24), v2.ColorJitter(0.2), v2.RandomHorizontalFlip()]), "RandomHorizontalFlip"),
    (v2.RandomRotation(10), "RandomRotation"),
    (v2.RandomResizedCrop(24, interpolation=v2.InterpolationMode.NEAREST), "bilinear"),
    (v2.RandomCrop(24, padding=2, fill={tv_tensors.Mask: 3.5}), "one class index"),
])
def test_ops_dlstore_cannot_run_jointly_are_refused(stores, transform, problem):
    with pytest.raises(TransformSpecError, match=problem):
        dlstore.open_dataset(stores[2]["shards"], transform=transform)


def test_a_v1_pipeline_is_refused_naming_v2(stores):
    import torchvision.transforms as T

    with pytest.raises(TransformSpecError, match="v1 op RandomCrop.*transforms.v2"):
        dlstore.open_dataset(stores[2]["hdf5"], transform=T.Compose([T.RandomCrop(24), T.RandomHorizontalFlip()]))
    with pytest.raises(TransformSpecError, match="not a torchvision v2 op"):
        dlstore.open_dataset(stores[2]["hdf5"], transform=lambda image: image)


def test_uint16_masks_round_trip_and_overflow_names_the_file(tmp_path):
    root = tmp_path / "src"
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    rng = np.random.default_rng(5)
    for k in range(4):
        Image.fromarray(rng.integers(0, 256, (18, 22, 3), dtype=np.uint8)).save(root / "images" / f"{k}.png")
        mask = rng.integers(0, 700, (18, 22)).astype(np.uint16)
        Image.fromarray(mask).save(root / "masks" / f"{k}.png")    # a 16-bit PNG ("I;16")
    with pytest.raises(SourceError, match=r"0\.png.*class \d+.*uint8.*mask_dtype=\"uint16\""):
        dlstore.convert(root / "images", tmp_path / "a.shards", masks=root / "masks", progress=False, workers=0)
    assert not (tmp_path / "a.shards").exists()
    dlstore.convert(root / "images", tmp_path / "b.h5", masks=root / "masks", mask_dtype="uint16",
                    static="center_crop=18x22", progress=False, workers=0)
    ds = dlstore.open_dataset(tmp_path / "b.h5", transform=v2.Compose([
        v2.RandomCrop(16, padding=3, fill={tv_tensors.Image: 0, tv_tensors.Mask: 300}), v2.RandomHorizontalFlip()]))
    for k in range(4):
        stored = np.array(Image.open(root / "masks" / f"{k}.png")).astype(np.int32)
        assert np.array_equal(ds.read(k)[1].numpy(), stored)
    images, masks = ds.get_batch(range(4), generator=torch.Generator().manual_seed(0))
    assert masks.dtype == torch.int32 and masks.max() <= 699
    ref_images, ref_masks = _draw_reference(ds, list(range(4)), ds.transform, 0)
    assert torch.equal(masks, ref_masks.to(torch.int32)) and torch.equal(images, ref_images)


def test_encoded_segmentation_store_is_refused(tmp_path):
    _pairs(tmp_path, [(20, 24)])
    with pytest.raises(ArgumentError, match="encoding='jpeg'.*raw"):
        dlstore.convert(tmp_path / "images", tmp_path / "x.shards", masks=tmp_path / "masks", encoding="jpeg",
                        progress=False, workers=0)


def test_variable_shape_store_reads_pairs_but_refuses_batches(tmp_path):
    _pairs(tmp_path, [(20, 24), (17, 30)])
    dlstore.convert(tmp_path / "images", tmp_path / "v.shards", masks=tmp_path / "masks", progress=False, workers=0)
    ds = dlstore.open_dataset(tmp_path / "v.shards")
    assert ds.shape is None and ds[1][0].shape == (3, 17, 30) and ds[1][1].shape == (17, 30)
    with pytest.raises(VariableShapeError, match="vary in size.*center_crop"):
        ds.get_batch([0, 1])


def test_manifest_fields_that_do_not_fit_the_records_are_refused(tmp_path):
    import json

    _pairs(tmp_path, [(20, 24)])
    dst = tmp_path / "m.shards"
    dlstore.convert(tmp_path / "images", dst, masks=tmp_path / "masks", static="center_crop=16", progress=False,
                    workers=0)
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest["dlstore_manifest"] == 2 and manifest["sample"]["shape"] == [4, 16, 16]
    assert manifest["fields"]["mask"] == {"kind": "planes", "dtype": "uint8", "planes": 1}
    from dlstore.formats.manifest import validate

    manifest["fields"]["mask"]["dtype"] = "uint16"   # 2 planes: 3 + 2 != 4
    with pytest.raises(StoreCorruptError, match="invalid 'fields'"):
        validate(manifest, str(dst))
    manifest["fields"]["mask"] = {"kind": "boxes"}
    with pytest.raises(StoreCorruptError, match="kind 'boxes'.*upgrade"):
        validate(manifest, str(dst))


def test_unpaired_files_skipped_are_named_in_the_manifest(tmp_path):
    _pairs(tmp_path, [(20, 24), (20, 24)])
    Image.fromarray(np.zeros((20, 24, 3), np.uint8)).save(tmp_path / "images" / "a" / "lonely.jpg")
    with pytest.raises(SourceError, match="lonely"):
        dlstore.convert(tmp_path / "images", tmp_path / "x.shards", masks=tmp_path / "masks", progress=False)
    result = dlstore.convert(tmp_path / "images", tmp_path / "y.shards", masks=tmp_path / "masks",
                             on_error="skip", progress=False, workers=0)
    assert result.count == 2
    ds = dlstore.open_dataset(tmp_path / "y.shards")
    assert any("lonely" in entry.get("path", "") for entry in ds.manifest["source"]["skipped"])


def test_command_line_converts_pairs_and_describes_the_mask(tmp_path):
    """``convert --masks``, then info, show (the mask drawn over the image) and verify know the field;
    verify names a sample whose mask plane was damaged."""
    from click.testing import CliRunner

    from dlstore.cli import main

    _pairs(tmp_path, [(26, 30), (28, 33), (30, 31)])
    dst = tmp_path / "c.shards"
    runner = CliRunner()
    result = runner.invoke(main, ["convert", str(tmp_path / "images"), str(dst), "--masks", str(tmp_path / "masks"),
                                  "--static", "center_crop=24", "--quiet", "--workers", "0"])
    assert result.exit_code == 0, result.output
    assert "3 images with uint8 masks" in result.output
    info = runner.invoke(main, ["info", str(dst)]).output
    assert "masks     uint8, one per image" in info and "sample    3x24x24 uint8 CHW" in info
    assert "(3 files, folder pairs)" in info
    shown = runner.invoke(main, ["show", str(dst), "1", "--out", str(tmp_path / "one.png")])
    assert shown.exit_code == 0, shown.output
    image, mask = dlstore.open_dataset(dst).read(1)
    drawn = np.asarray(Image.open(tmp_path / "one.png"), dtype=np.int64)
    plain = image.permute(1, 2, 0).numpy().astype(np.int64)
    coloured = (mask.numpy() != 0) & (mask.numpy() != IGNORE)
    assert (drawn[~coloured] == plain[~coloured]).all() and (drawn[coloured] != plain[coloured]).any(axis=-1).all()
    values, counts = np.unique(mask.numpy(), return_counts=True)
    assert "mask      classes " + ", ".join(f"{v} ({100 * c / mask.numel():.0f}%)" for v, c in zip(values, counts)) \
        in shown.output
    assert runner.invoke(main, ["verify", str(dst), "--deep"]).exit_code == 0
    # damage one byte of sample 2's mask plane (after its 3 x 24 x 24 image bytes)
    shard = min(dst.glob("shard-*.npy"))
    data = bytearray(shard.read_bytes())
    header = len(data) - 3 * 4 * 24 * 24
    data[header + 2 * 4 * 24 * 24 + 3 * 24 * 24 + 5] ^= 1
    shard.write_bytes(bytes(data))
    ds = dlstore.open_dataset(dst, check="sample")
    with pytest.raises(StoreCorruptError, match="sample 2"):
        ds.read(2)


def test_a_whole_v2_pipeline_split_by_split_transforms(tmp_path):
    """split_transforms of a v2 pipeline for (Image, Mask): its static part converts the pairs; the
    hybrid, the whole pipeline and its random part alone then read the same batches and the same ds[i]
    (the static ops are not run twice); a pipeline whose static ops differ from the store's is refused."""
    from dlstore.errors import StaticMismatchError

    _pairs(tmp_path, [(30 + k, 41 - k) for k in range(6)])
    random_part = [v2.RandomCrop(24, padding=3, fill={tv_tensors.Image: 1, tv_tensors.Mask: IGNORE}),
                   v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True)]
    whole = v2.Compose([v2.Resize(30), v2.CenterCrop([28, 32]), *random_part])
    hybrid = dlstore.split_transforms(whole)
    dlstore.convert(tmp_path / "images", tmp_path / "h.lmdb", masks=tmp_path / "masks", static=hybrid,
                    progress=False, workers=0)
    batches, items = [], []
    for transform in (hybrid, whole, v2.Compose(random_part)):
        ds = dlstore.open_dataset(tmp_path / "h.lmdb", transform=transform)
        batches.append(ds.get_batch(range(6), generator=torch.Generator().manual_seed(4)))
        torch.manual_seed(8)
        items.append(ds[2])
    for (images, masks), (image, mask) in zip(batches[1:], items[1:]):
        assert torch.equal(images, batches[0][0]) and torch.equal(masks, batches[0][1])
        assert torch.equal(image, items[0][0]) and torch.equal(mask, items[0][1])
    assert items[0][0].shape == (3, 24, 24) and items[0][0].dtype == torch.float32
    with pytest.raises(StaticMismatchError, match="resize=28"):
        dlstore.open_dataset(tmp_path / "h.lmdb", transform=v2.Compose([v2.Resize(28), *random_part]))


def test_a_dataset_of_dict_rows_with_named_image_and_mask_columns(tmp_path):
    """Hugging Face-style rows: ``image_key`` and ``mask_key`` name the columns; the palette mask keeps
    its indices."""
    rows = [{"img": Image.fromarray(np.full((20, 24, 3), 10 * k, np.uint8)),
             "seg": Image.fromarray(np.full((20, 24), k + 2, np.uint8), "P")} for k in range(5)]
    result = dlstore.convert(rows, tmp_path / "rows.h5", image_key="img", mask_key="seg", static="center_crop=16",
                             progress=False, workers=0)
    assert result.masks == "uint8" and result.count == 5
    ds = dlstore.open_dataset(tmp_path / "rows.h5")
    for k in range(5):
        image, mask = ds.read(k)
        assert (image == 10 * k).all() and (mask == k + 2).all() and mask.shape == (16, 16)


def test_profile_trains_a_dense_step_on_masks(stores, monkeypatch):
    """``dlstore profile``'s conv step on a segmentation store predicts a class per pixel (255 ignored)
    instead of one per image, and learns: its loss falls over a few steps."""
    from dlstore.tools.profiling import synthetic_step

    ds = dlstore.open_dataset(stores[2]["shards"])
    images, masks = ds.get_batch(range(12))
    losses = []
    real = torch.nn.functional.cross_entropy

    def recording(out, target, **kwargs):
        assert out.shape[-2:] == target.shape[-2:] and kwargs.get("ignore_index") == IGNORE
        loss = real(out, target, **kwargs)
        losses.append(loss.item())
        return loss

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", recording)
    torch.manual_seed(0)
    step = synthetic_step("conv", device="cpu", num_classes=6)
    for _ in range(30):
        step(images, masks)
    assert len(losses) == 30 and losses[-1] < 0.9 * losses[0]
