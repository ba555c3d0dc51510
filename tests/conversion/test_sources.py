"""Converting what users have: datasets, arrays and file lists, with the folder's guarantees.

Every source: pixels equal torchvision's on what the source yields, classes as the
source names them, order kept, bytes independent of the worker count, bad items
named, resume and distributed conversion giving the store an uninterrupted
single-process run gives.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.datasets import FakeData
from torchvision.transforms import v2

import dlstore
from dlstore.conversion import pool
from dlstore.errors import DecodeError
from dlstore.sources.demo import synthetic_image
from dlstore.transforms.static import parse_static, to_torchvision

SUFFIX = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}
STATIC = "resize=20,center_crop=16"


def _convert(src, dst, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("workers", 0)
    return dlstore.convert(src, dst, **kw)


def _pil_reference(img: Image.Image, static: str) -> torch.Tensor:
    return v2.Compose([*to_torchvision(parse_static(static)), v2.PILToTensor()])(img)


def _tensor_reference(img, static: str) -> torch.Tensor:
    return v2.Compose([v2.ToImage(), *to_torchvision(parse_static(static))])(img)


def _store_bytes(path) -> dict:
    ds = dlstore.open_dataset(path)
    return {"checksums": ds.manifest["checksums"], "targets": ds.targets, "classes": ds.classes,
            "samples": list(ds.samples)}


class Pairs(torch.utils.data.Dataset):
    """(image, target) pairs from a list; ``fail`` indices raise, like a broken record."""

    def __init__(self, images, targets, classes=None, fail=()):
        self.images, self.targets, self.fail = images, targets, set(fail)
        if classes is not None:
            self.classes = classes

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        if i in self.fail:
            raise OSError(f"record {i} is damaged")
        return self.images[i], self.targets[i]


@pytest.fixture(scope="module")
def fake():
    return FakeData(size=24, image_size=(3, 30, 26), num_classes=5, random_offset=7)


@pytest.mark.parametrize("fmt", list(SUFFIX))
def test_fakedata_pixels_and_labels_equal_torchvision(fake, tmp_path, fmt):
    result = _convert(fake, tmp_path / f"f{SUFFIX[fmt]}", static=STATIC)
    ds = dlstore.open_dataset(tmp_path / f"f{SUFFIX[fmt]}")
    assert result.count == len(ds) == 24 and ds.shape == (3, 16, 16)
    assert ds.classes == ["0", "1", "2", "3", "4"]  # FakeData has num_classes, no names
    for i in range(24):
        img, target = fake[i]
        assert torch.equal(ds[i][0], _pil_reference(img, STATIC)), i
        assert ds.targets[i] == target
    assert ds.manifest["source"]["kind"] == "dataset" and ds.manifest["source"]["type"] == "FakeData"


def test_fixed_shape_without_static_ops_for_in_memory_datasets(fake, tmp_path):
    _convert(fake, tmp_path / "raw.shards")
    ds = dlstore.open_dataset(tmp_path / "raw.shards")
    assert ds.shape == (3, 30, 26)  # FakeData's images all have its image_size
    assert torch.equal(ds[3][0], v2.PILToTensor()(fake[3][0]))


def test_byte_identical_for_any_worker_count(fake, tmp_path):
    _convert(fake, tmp_path / "w0.h5", static=STATIC, workers=0)
    _convert(fake, tmp_path / "w2.h5", static=STATIC, workers=2)
    assert _store_bytes(tmp_path / "w0.h5") == _store_bytes(tmp_path / "w2.h5")


def test_dataset_classes_are_kept(tmp_path):
    images = [Image.fromarray(synthetic_image(k % 3, k, (12, 14))) for k in range(9)]
    ds = Pairs(images, [k % 3 for k in range(9)], classes=["cat", "dog", "eel"])
    _convert(ds, tmp_path / "c.shards")
    store = dlstore.open_dataset(tmp_path / "c.shards")
    assert store.classes == ["cat", "dog", "eel"] and store.class_to_idx == {"cat": 0, "dog": 1, "eel": 2}
    assert store.targets == [k % 3 for k in range(9)]
    assert store.shape is None  # a user Dataset of PIL images: sizes may vary, so a variable-shape store


def test_grayscale_pil_images_keep_one_channel(tmp_path):
    images = [Image.fromarray(synthetic_image(0, k, (28, 28))[..., 0]) for k in range(6)]  # mode L, like MNIST
    ds = Pairs(images, [k % 2 for k in range(6)])
    _convert(ds, tmp_path / "g.h5", static="center_crop=20")
    store = dlstore.open_dataset(tmp_path / "g.h5")
    assert store.shape == (1, 20, 20) and store.classes == ["0", "1"]
    assert all(torch.equal(store[k][0], _pil_reference(images[k], "center_crop=20")) for k in range(6))


@pytest.mark.parametrize("layout", ["HWC ndarray", "CHW tensor", "HW ndarray"])
def test_datasets_of_arrays_and_tensors_use_torchvision_tensor_kernels(tmp_path, layout):
    rng = np.random.default_rng(3)
    hwc = [rng.integers(0, 256, (22, 18, 3), dtype=np.uint8) for _ in range(8)]
    if layout == "CHW tensor":
        images = [torch.from_numpy(a).permute(2, 0, 1).contiguous() for a in hwc]
    elif layout == "HW ndarray":
        images = [a[..., 0].copy() for a in hwc]
    else:
        images = hwc
    _convert(Pairs(images, list(range(8))), tmp_path / "t.shards", static=STATIC, workers=2)
    store = dlstore.open_dataset(tmp_path / "t.shards")
    for k in range(8):
        assert torch.equal(store[k][0], _tensor_reference(images[k], STATIC)), k


@pytest.mark.parametrize("layout", ["NHWC", "NCHW", "NHW"])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_arrays_convert_like_torchvision(tmp_path, layout, kind):
    rng = np.random.default_rng(5)
    images = rng.integers(0, 256, (10, 24, 20, 3), dtype=np.uint8)
    if layout == "NCHW":
        images = np.ascontiguousarray(images.transpose(0, 3, 1, 2))
    elif layout == "NHW":
        images = np.ascontiguousarray(images[..., 1])
    labels = np.arange(10) % 4
    # the layout is the array's, so each image goes to ToImage as the numpy array it would be
    references = [_tensor_reference(torch.from_numpy(a) if layout == "NCHW" else a, STATIC) for a in images]
    if kind == "torch":
        images, labels = torch.from_numpy(images), torch.from_numpy(labels)
    _convert((images, labels), tmp_path / "a.lmdb", static=STATIC)
    store = dlstore.open_dataset(tmp_path / "a.lmdb")
    assert store.classes == ["0", "1", "2", "3"] and store.targets == (np.arange(10) % 4).tolist()
    channels = 1 if layout == "NHW" else 3
    assert store.shape == (channels, 16, 16)
    for k in range(10):
        assert torch.equal(store[k][0], references[k]), k


def test_arrays_without_static_ops_are_stored_as_they_are(tmp_path):
    images = np.random.default_rng(1).integers(0, 256, (50, 32, 32, 3), dtype=np.uint8)
    _convert((images, np.zeros(50, np.int64)), tmp_path / "c.shards", workers=2)
    store = dlstore.open_dataset(tmp_path / "c.shards")
    assert store.shape == (3, 32, 32)
    batch, _ = store.read_batch(list(range(50)))
    assert np.array_equal(batch.numpy(), images.transpose(0, 3, 1, 2))


def test_a_failing_item_is_named_or_skipped_by_index(tmp_path):
    images = [Image.fromarray(synthetic_image(0, k, (12, 12))) for k in range(10)]
    ds = Pairs(images, [0] * 10, classes=["a"], fail={3, 7})
    with pytest.raises(DecodeError, match=r"Pairs item 3: dataset\[3\] raised OSError: record 3 is damaged"):
        _convert(ds, tmp_path / "x.shards", workers=2)
    assert not (tmp_path / "x.shards").exists()
    result = _convert(ds, tmp_path / "x.shards", on_error="skip", workers=2)
    assert result.count == 8 and "item 3: dataset[3] raised OSError" in str(result)
    skipped = dlstore.open_dataset(tmp_path / "x.shards").manifest["source"]["skipped"]
    assert [(s["index"], s["reason"]) for s in skipped] == [
        (3, "dataset[3] raised OSError: record 3 is damaged"), (7, "dataset[7] raised OSError: record 7 is damaged")]


def test_float_images_and_bad_labels_are_refused_with_the_fix(tmp_path):
    floats = Pairs([torch.rand(3, 8, 8)] * 3, [0, 1, 2])
    with pytest.raises(DecodeError, match=r"item 0.*float32 image, expected uint8.*without transform="):
        _convert(floats, tmp_path / "f.shards")
    labels = Pairs([np.zeros((8, 8, 3), np.uint8)] * 3, [0, 5, 1], classes=["a", "b"])
    with pytest.raises(DecodeError, match=r"item 1: label 5 is not a class index \(0..1\)"):
        _convert(labels, tmp_path / "l.shards")


class Lambdas(Pairs):
    """A dataset holding a lambda: it cannot be pickled."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.fn = lambda x: x

    def __getitem__(self, i):
        image, target = super().__getitem__(i)
        return self.fn(image), target


def test_unpicklable_dataset_converts_with_fork_and_falls_back_without(tmp_path, monkeypatch):
    images = [np.full((6, 6, 3), k, np.uint8) for k in range(12)]
    ds = Lambdas(images, [k % 2 for k in range(12)])
    _convert(ds, tmp_path / "fork.shards", workers=2)  # fork: workers inherit the dataset, no pickling
    monkeypatch.setattr(pool, "_mp_context", lambda: multiprocessing.get_context("spawn"))
    messages = []
    result = _convert(ds, tmp_path / "spawn.shards", workers=2, log=messages.append)
    assert result.workers == 0
    assert any("cannot be sent to worker processes" in m and "workers=0" in m for m in messages)
    assert _store_bytes(tmp_path / "fork.shards") == _store_bytes(tmp_path / "spawn.shards")


class Interrupting(Pairs):
    """Raises KeyboardInterrupt at item ``stop_at`` (like Ctrl-C mid-conversion) while armed."""

    stop_at: int | None = None

    def __getitem__(self, i):
        if i == self.stop_at:
            raise KeyboardInterrupt
        return super().__getitem__(i)


@pytest.mark.parametrize("fmt, options", [("shards", {"shard_size": 16 * 16 * 3 * 4}),
                                          ("hdf5", {"batch_bytes": 16 * 16 * 3 * 4}),
                                          ("lmdb", {"batch_bytes": 16 * 16 * 3 * 4})])
def test_resume_gives_the_uninterrupted_store(tmp_path, fmt, options):
    rng = np.random.default_rng(9)
    images = [rng.integers(0, 256, (20, 20, 3), dtype=np.uint8) for _ in range(100)]
    ds = Interrupting(images, [k % 3 for k in range(100)])
    dst = tmp_path / f"r{SUFFIX[fmt]}"
    ds.stop_at = 90  # in-memory items are decoded 64 at a time: 64 are written, with checkpoints
    with pytest.raises(KeyboardInterrupt):
        _convert(ds, dst, static=STATIC, **options)
    ds.stop_at = None
    messages = []
    result = _convert(ds, dst, static=STATIC, resume=True, log=messages.append, **options)
    assert "resuming after 64 of 100 items" in messages, messages
    # images/s counts what this run converted: the 64 samples written before are named, not counted
    assert result.resumed == 64 and "resumed: 64 samples were written before" in str(result)
    assert result.rate < result.count / result.seconds
    _convert(ds, tmp_path / f"clean{SUFFIX[fmt]}", static=STATIC, **options)
    assert _store_bytes(dst) == _store_bytes(tmp_path / f"clean{SUFFIX[fmt]}")


def _write_images(root, n=9):
    rels = []
    for k in range(n):
        rel = f"{'ab'[k % 2]}/sub/img_{k:02d}.png"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(synthetic_image(k % 2, k, (18, 22))).save(root / rel)
        rels.append(rel)
    return rels


def test_csv_list_converts_in_list_order_with_named_classes(tmp_path):
    root = tmp_path / "imgs"
    rels = _write_images(root)[::-1]  # the list's order, not the folder's
    listing = tmp_path / "train.csv"
    listing.write_text("path,label\n" + "".join(f"{rel},{'zebra' if k % 3 else 'ant'}\n"
                                                 for k, rel in enumerate(rels)))
    result = _convert(listing, tmp_path / "l.shards", root=root, static=STATIC, workers=2)
    store = dlstore.open_dataset(tmp_path / "l.shards")
    assert result.count == 9 and store.classes == ["ant", "zebra"]
    assert store.targets == [1 if k % 3 else 0 for k in range(9)]
    for k, rel in enumerate(rels):
        assert torch.equal(store[k][0], _pil_reference(dlstore.sources.pil_loader(root / rel), STATIC)), rel
    assert store.manifest["source"]["kind"] == "list"
    assert store.manifest["source"]["list"] == str(listing)


def test_jsonl_list_with_int_labels_and_a_missing_file_skipped(tmp_path):
    root = tmp_path / "imgs"
    rels = _write_images(root, 4) + ["a/missing.png"]
    listing = tmp_path / "l.jsonl"
    listing.write_text("".join(f'{{"path": "{rel}", "label": {k % 2}}}\n' for k, rel in enumerate(rels)))
    with pytest.raises(DecodeError, match="missing.png"):
        _convert(listing, tmp_path / "x.h5", root=root)
    result = _convert(listing, tmp_path / "x.h5", root=root, on_error="skip")
    assert result.count == 4
    skipped = dlstore.open_dataset(tmp_path / "x.h5").manifest["source"]["skipped"]
    assert [s["path"] for s in skipped] == ["a/missing.png"]


def test_list_root_defaults_to_the_list_folder(tmp_path):
    rels = _write_images(tmp_path, 3)
    (tmp_path / "l.csv").write_text("".join(f"{rel},0\n" for rel in rels))
    assert _convert(tmp_path / "l.csv", tmp_path / "o.shards").count == 3


def test_folder_conversion_is_unchanged(rgb_folder, tmp_path):
    _convert(rgb_folder, tmp_path / "d.shards")
    m = dlstore.open_dataset(tmp_path / "d.shards").manifest
    assert m["source"]["kind"] == "folder" and m["source"]["root"] == os.path.abspath(rgb_folder)
    copy = tmp_path / "copy"
    shutil.copytree(rgb_folder, copy)
    _convert(copy, tmp_path / "e.shards")
    assert _store_bytes(tmp_path / "d.shards")["checksums"] == _store_bytes(tmp_path / "e.shards")["checksums"]


def _convert_in_memory(rank: int, dst_dir: str, listing: str, distributed: bool) -> dict:
    from pathlib import Path

    rng = np.random.default_rng(11)  # every rank builds the same arrays, as every rank of a job would
    images = rng.integers(0, 256, (21, 20, 20, 3), dtype=np.uint8)
    out = {}
    for suffix in SUFFIX.values():
        dataset = Pairs(list(images), [k % 3 for k in range(21)], fail={4})
        for name, src in (("arrays", (images, np.arange(21) % 3)), ("dataset", dataset)):
            r = dlstore.convert(src, Path(dst_dir) / f"{name}{suffix}", static=STATIC, workers=1, progress=False,
                                on_error="skip", distributed=distributed)
            out[f"{name}{suffix}"] = r.count
        r = dlstore.convert(listing, Path(dst_dir) / f"list{suffix}", workers=1, progress=False, on_error="skip",
                            distributed=distributed)
        out[f"list{suffix}"] = r.count
    return out


def test_distributed_conversion_of_in_memory_sources_and_lists_equals_single_process(tmp_path):
    import json

    import torch.multiprocessing as tmp
    from _helpers import free_port, rank_main   # ranks meet at a barrier before leaving the group

    rels = _write_images(tmp_path / "imgs", 7)
    listing = tmp_path / "imgs" / "l.csv"
    listing.write_text("".join(f"{rel},{k % 2}\n" for k, rel in enumerate(rels)) + "a/gone.png,1\n")
    (tmp_path / "dist").mkdir()
    tmp.start_processes(rank_main, nprocs=2, join=True, start_method="fork",
                        args=(2, free_port(), str(tmp_path), _convert_in_memory,
                              (str(tmp_path / "dist"), str(listing), True)))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all("ok" in r for r in results), results
    (tmp_path / "single").mkdir()
    single = _convert_in_memory(0, str(tmp_path / "single"), str(listing), False)
    assert results[0]["ok"] == single
    for name in single:
        a, b = dlstore.open_dataset(tmp_path / "dist" / name), dlstore.open_dataset(tmp_path / "single" / name)
        assert a.targets == b.targets and a.classes == b.classes, name
        assert list(a.samples) == list(b.samples), name
        if not name.startswith("list"):
            assert (4 in [i for i, _ in a.samples]) == name.startswith("arrays"), name  # the dataset skips item 4
        assert a.manifest["source"]["skipped"] == b.manifest["source"]["skipped"], name
        assert all(torch.equal(a[i][0], b[i][0]) for i in range(len(a))), name
    assert len(dlstore.open_dataset(tmp_path / "dist" / "list.h5").samples) == 7


@pytest.mark.parametrize("fmt", list(SUFFIX))
def test_provenance_names_each_samples_origin_in_every_format(tmp_path, fmt, rgb_folder):
    from torchvision.datasets import ImageFolder

    images = [np.full((6, 6, 3), k, np.uint8) for k in range(10)]
    _convert(Pairs(images, [k % 2 for k in range(10)], fail={2, 7}), tmp_path / f"d{SUFFIX[fmt]}", on_error="skip")
    ds = dlstore.open_dataset(tmp_path / f"d{SUFFIX[fmt]}")
    assert list(ds.samples) == [(k, k % 2) for k in range(10) if k not in (2, 7)]
    assert ds.imgs[-1] == (9, 1)

    _convert(rgb_folder, tmp_path / f"f{SUFFIX[fmt]}")
    store = dlstore.open_dataset(tmp_path / f"f{SUFFIX[fmt]}")
    assert list(store.samples) == [(os.path.abspath(p), t) for p, t in ImageFolder(str(rgb_folder)).samples]

    root = tmp_path / "imgs"
    rels = _write_images(root, 4)
    (tmp_path / "l.csv").write_text("".join(f"{rel},{k % 2}\n" for k, rel in enumerate(rels)) + "a/gone.png,0\n")
    _convert(tmp_path / "l.csv", tmp_path / f"l{SUFFIX[fmt]}", root=root, on_error="skip")
    listed = dlstore.open_dataset(tmp_path / f"l{SUFFIX[fmt]}")
    assert listed.origins.kind == "path" and list(listed.origins) == rels
    assert listed.samples[1] == (str(root / rels[1]), 1)


def test_provenance_is_plain_arrays_each_format_reads_natively(tmp_path, rgb_folder):
    import h5py
    import lmdb

    _convert(rgb_folder, tmp_path / "f.shards")
    _convert(rgb_folder, tmp_path / "f.h5")
    _convert(rgb_folder, tmp_path / "f.lmdb")
    first = "class_00/img_0000.jpg"
    offsets = np.load(tmp_path / "f.shards" / "provenance-offsets.npy")
    blob = np.load(tmp_path / "f.shards" / "provenance-blob.npy")
    assert blob[offsets[0]:offsets[1]].tobytes().decode() == first
    with h5py.File(tmp_path / "f.h5") as f:
        assert f["provenance/blob"][f["provenance/offsets"][0]:f["provenance/offsets"][1]].tobytes().decode() == first
    with lmdb.open(str(tmp_path / "f.lmdb"), readonly=True, lock=False) as env, env.begin() as txn:
        ends = np.frombuffer(txn.get(b"__provenance_offsets__"), "<i8")
        assert txn.get(b"__provenance_blob__")[ends[0]:ends[1]].decode() == first
    assert dlstore.verify(tmp_path / "f.shards").ok
