"""The store contract, checked on every format: shards, LMDB, HDF5.

Every store is a real file or folder written by ``dlstore.convert`` from real
JPEG/PNG files, and read back through real DataLoader worker processes. What
only the shards layout has (``.npy`` files, shard rollover, ``index.npy``) is
checked in the shards-specific section at the end.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import pickle
import shutil

import h5py
import lmdb
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.transforms import v2

import dlstore
from dlstore.cli import main as cli
from dlstore.errors import DecodeError, StoreCorruptError, StoreExistsError
from dlstore.sources.demo import make_image_folder, synthetic_image
from dlstore.transforms import parse_static

FORMATS = ["shards", "lmdb", "hdf5"]
SUFFIX = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}
STATIC = "resize=36,center_crop=32"
REFERENCE = v2.Compose([v2.Resize(36), v2.CenterCrop(32), v2.PILToTensor()])
SAMPLE_BYTES = 3 * 32 * 32
# Shards stores here span several files (5, 5, 5, 5, 4 samples), so every contract test reads
# across file boundaries; LMDB and HDF5 take no shard size.
SHARDED = {"shards": {"shard_size": 5 * SAMPLE_BYTES}, "lmdb": {}, "hdf5": {}}


def _convert(src, dst, **kw):
    kw.setdefault("static", STATIC)
    kw.setdefault("workers", 0)
    kw.setdefault("progress", False)
    return dlstore.convert(src, dst, **kw)


@pytest.fixture(scope="module")
def stores(rgb_folder, tmp_path_factory):
    """The 24-sample RGB folder converted to every format (3x32x32)."""
    root = tmp_path_factory.mktemp("stores")
    return {fmt: _convert(rgb_folder, root / f"s{SUFFIX[fmt]}", **SHARDED[fmt]).path for fmt in FORMATS}


@pytest.fixture(scope="module")
def var_stores(varsize_folder, tmp_path_factory):
    """The variable-size folder converted without a size-fixing op, to every format."""
    root = tmp_path_factory.mktemp("var")
    return {fmt: _convert(varsize_folder, root / f"v{SUFFIX[fmt]}", static="").path for fmt in FORMATS}


def _all_images(ds) -> list[torch.Tensor]:
    return [ds[i][0] for i in range(len(ds))]


def _native_manifest(path) -> str:
    """The manifest text where the format itself keeps it (shards file, LMDB key, HDF5 attribute)."""
    if path.suffix == ".shards":
        return (path / "manifest.json").read_text()
    if path.suffix == ".lmdb":
        env = lmdb.open(str(path), readonly=True, lock=False)
        try:
            with env.begin() as txn:
                return bytes(txn.get(b"__dlstore__")).decode()
        finally:
            env.close()
    with h5py.File(path, "r") as f:
        return f.attrs["dlstore"]


def _write_native_manifest(path, text: str) -> None:
    if path.suffix == ".shards":
        (path / "manifest.json").write_text(text)
    elif path.suffix == ".lmdb":
        env = lmdb.open(str(path))
        try:
            with env.begin(write=True) as txn:
                txn.put(b"__dlstore__", text.encode())
        finally:
            env.close()
    else:
        with h5py.File(path, "a") as f:
            f.attrs["dlstore"] = text


def _copy_store(path, dst):
    (shutil.copytree if path.is_dir() else shutil.copy)(path, dst)
    return dst


def _folder_with_one_bad_file(src, content: bytes):
    make_image_folder(src, classes=2, per_class=3, size=(20, 20))
    (src / "class_01" / "img_0001.jpg").write_bytes(content)
    return src


# --- the contract --------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_is_bit_identical_to_imagefolder(fmt, stores, rgb_folder):
    ds = dlstore.open_dataset(stores[fmt])
    reference = datasets.ImageFolder(str(rgb_folder), transform=REFERENCE)
    assert ds.format == fmt and ds.manifest["format"] == fmt
    assert len(ds) == len(reference) == 24
    assert ds.classes == reference.classes and ds.class_to_idx == reference.class_to_idx
    assert ds.targets == reference.targets
    assert ds.shape == (3, 32, 32)
    for i in range(len(ds)):
        image, label = ds[i]
        ref_image, ref_label = reference[i]
        assert image.dtype == torch.uint8 and image.shape == (3, 32, 32)
        assert torch.equal(image, ref_image), f"{fmt}: sample {i} differs from ImageFolder"
        assert label == ref_label


@pytest.mark.parametrize("fmt", FORMATS)
def test_manifest_describes_the_store(fmt, stores):
    m = json.loads(_native_manifest(stores[fmt]))
    assert m["format"] == fmt and m["format_version"] == 1 and m["count"] == 24
    assert m["sample"] == {"dtype": "uint8", "layout": "CHW", "encoding": "raw", "shape": [3, 32, 32]}
    assert m["classes"] == ["class_00", "class_01", "class_02"]
    assert m["static"] == parse_static(STATIC)
    assert m["source"]["files"] == 24 and m["source"]["skipped"] == []
    assert m == dlstore.open_dataset(stores[fmt]).manifest


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_same_samples_and_labels_as_the_shards_store(fmt, stores):
    ds, shards = dlstore.open_dataset(stores[fmt]), dlstore.open_dataset(stores["shards"])
    assert ds.targets == shards.targets and ds.classes == shards.classes
    assert ds.manifest["static"] == shards.manifest["static"]
    images, labels = ds.read_batch(range(len(ds)))
    ref_images, ref_labels = shards.read_batch(range(len(shards)))
    assert torch.equal(images, ref_images) and torch.equal(labels, ref_labels)


def test_lmdb_and_hdf5_record_the_same_payload_digests(stores):
    lm = dlstore.open_dataset(stores["lmdb"]).manifest["checksums"]["files"]
    h5 = dlstore.open_dataset(stores["hdf5"]).manifest["checksums"]["files"]
    assert lm == h5 and set(lm) == {"samples", "labels", "crc32"}
    shards = dlstore.open_dataset(stores["shards"])
    images, labels = shards.read_batch(range(len(shards)))
    assert lm["samples"] == hashlib.sha256(images.numpy().tobytes()).hexdigest()
    assert lm["labels"] == hashlib.sha256(labels.numpy().astype("<i8").tobytes()).hexdigest()


@pytest.mark.parametrize("fmt", FORMATS)
def test_variable_shape_store(fmt, var_stores, varsize_folder):
    ds = dlstore.open_dataset(var_stores[fmt])
    reference = datasets.ImageFolder(str(varsize_folder), transform=v2.PILToTensor())
    assert ds.shape is None and ds.manifest["sample"]["shape"] is None
    shapes = {tuple(image.shape) for image in _all_images(ds)}
    assert len(shapes) > 1
    for i in range(len(ds)):
        assert torch.equal(ds[i][0], reference[i][0]), f"{fmt}: sample {i} differs"
        assert ds[i][1] == reference[i][1]
    batch = ds.__getitems__([9, 0, 4, 4])
    assert [label for _, label in batch] == [reference.targets[i] for i in (9, 0, 4, 4)]
    assert all(torch.equal(image, reference[i][0]) for (image, _), i in zip(batch, (9, 0, 4, 4)))
    with pytest.raises(ValueError, match="fixed-shape"):
        ds.reader.get_batch(np.arange(2))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gray", [False, True], ids=["rgb", "grayscale"])
def test_png_rgba_palette_grayscale_inputs(fmt, gray, mixed_folder, tmp_path):
    """pil_loader's convert("RGB") for every mode; the static grayscale op gives 1 channel."""
    static = ("grayscale," if gray else "") + "resize=20,center_crop=16"
    ops = ([v2.Grayscale()] if gray else []) + [v2.Resize(20), v2.CenterCrop(16), v2.PILToTensor()]
    result = _convert(mixed_folder, tmp_path / f"m{SUFFIX[fmt]}", static=static)
    ds = dlstore.open_dataset(tmp_path / f"m{SUFFIX[fmt]}")
    reference = datasets.ImageFolder(str(mixed_folder), transform=v2.Compose(ops))
    assert result.count == len(ds) == len(reference) == 10
    assert ds.shape == ((1 if gray else 3), 16, 16)
    for i in range(len(ds)):
        assert torch.equal(ds[i][0], reference[i][0]), f"{fmt}: sample {i} ({reference.samples[i][0]}) differs"
    assert ds.targets == reference.targets


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_static_spec_keeps_original_pixels(fmt, mixed_folder, tmp_path):
    _convert(mixed_folder, tmp_path / f"raw{SUFFIX[fmt]}", static=None)
    ds = dlstore.open_dataset(tmp_path / f"raw{SUFFIX[fmt]}")
    reference = datasets.ImageFolder(str(mixed_folder), transform=v2.PILToTensor())
    assert len(ds) == len(reference)
    assert all(torch.equal(ds[i][0], reference[i][0]) for i in range(len(ds)))


def _file_bytes(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())} if path.is_dir() else {"": path.read_bytes()}


@pytest.mark.parametrize("fmt", FORMATS)
def test_payload_is_identical_whatever_the_worker_count(fmt, rgb_folder, tmp_path):
    one = _convert(rgb_folder, tmp_path / f"w1{SUFFIX[fmt]}", workers=1, **SHARDED[fmt])
    two = _convert(rgb_folder, tmp_path / f"w2{SUFFIX[fmt]}", workers=2, **SHARDED[fmt])
    # Byte for byte, every file of the store (data, labels, manifest; LMDB's lock file too).
    assert _file_bytes(one.path) == _file_bytes(two.path)
    m1 = dlstore.open_dataset(one.path).manifest
    m2 = dlstore.open_dataset(two.path).manifest
    assert m1["checksums"] == m2["checksums"] and m1["layout"] == m2["layout"]
    a, _ = dlstore.open_dataset(one.path).read_batch(range(24))
    b, _ = dlstore.open_dataset(two.path).read_batch(range(24))
    assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_getitems_returns_the_requested_order(fmt, stores):
    ds = dlstore.open_dataset(stores[fmt])
    order = [7, 0, 7, 23, 3, 1, 12, -1]
    batch = ds.__getitems__(order)
    assert [label for _, label in batch] == [ds.targets[i] for i in order]
    for (image, _), i in zip(batch, order):
        assert torch.equal(image, ds[i][0])
    images, labels = ds.read_batch(order)
    assert images.shape == (8, 3, 32, 32)
    assert torch.equal(images, torch.stack([ds[i][0] for i in order]))
    assert labels.tolist() == [ds.targets[i] for i in order]
    with pytest.raises(IndexError):
        ds[24]


@pytest.mark.parametrize("fmt", FORMATS)
def test_unlabelled_flat_folder(fmt, tmp_path):
    src = tmp_path / "flat"
    src.mkdir()
    for i in range(4):
        Image.fromarray(synthetic_image(0, i, (20, 20))).save(src / f"{i}.png")
    _convert(src, tmp_path / f"u{SUFFIX[fmt]}")
    ds = dlstore.open_dataset(tmp_path / f"u{SUFFIX[fmt]}")
    assert ds.classes == [] and ds.targets == [-1] * 4
    assert ds[2][1] == -1


# --- conversion errors ---------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_existing_destination_needs_overwrite(fmt, rgb_folder, tmp_path):
    name = f"s{SUFFIX[fmt]}"
    dst = tmp_path / name
    _convert(rgb_folder, dst)
    before = _native_manifest(dst)
    with pytest.raises(StoreExistsError, match="overwrite"):
        _convert(rgb_folder, dst, static="resize=10,center_crop=8")
    assert _native_manifest(dst) == before
    _convert(rgb_folder, dst, static="resize=10,center_crop=8", overwrite=True)
    assert dlstore.open_dataset(dst).shape == (3, 8, 8)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no staging or lock left


@pytest.mark.parametrize("fmt", FORMATS)
def test_corrupt_file_fails_and_writes_nothing(fmt, tmp_path):
    _folder_with_one_bad_file(tmp_path / "src", b"\xff\xd8\xff\xe0 definitely not a jpeg")
    with pytest.raises(DecodeError) as info:
        _convert(tmp_path / "src", tmp_path / f"bad{SUFFIX[fmt]}", workers=2)
    assert "class_01/img_0001.jpg" in str(info.value) and "--on-error skip" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_corrupt_file_skipped_and_recorded(fmt, tmp_path):
    _folder_with_one_bad_file(tmp_path / "src", b"")
    result = _convert(tmp_path / "src", tmp_path / f"s{SUFFIX[fmt]}", on_error="skip")
    assert result.count == 5
    assert [s["path"] for s in result.skipped] == ["class_01/img_0001.jpg"]
    assert "class_01/img_0001.jpg" in str(result)
    ds = dlstore.open_dataset(tmp_path / f"s{SUFFIX[fmt]}")
    assert ds.manifest["source"]["skipped"][0]["path"] == "class_01/img_0001.jpg"
    assert ds.targets == [0, 0, 0, 1, 1]


# A manifest count that disagrees with the data: a shards store finds it in its file counts;
# LMDB and HDF5 stores check the labels first and name them.
COUNT_MISMATCH = {"shards": "declares 25", "lmdb": r"__labels__ .*\(25,\)", "hdf5": r"/labels .*\(25,\)"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_damaged_manifest_is_a_clear_error(fmt, stores, tmp_path):
    broken = _copy_store(stores[fmt], tmp_path / f"broken{SUFFIX[fmt]}")
    m = json.loads(_native_manifest(broken))
    m["count"] = 25
    _write_native_manifest(broken, json.dumps(m))
    with pytest.raises(StoreCorruptError, match=f"broken{SUFFIX[fmt]}.*{COUNT_MISMATCH[fmt]}"):
        dlstore.open_dataset(broken)
    _write_native_manifest(broken, "{not json")
    with pytest.raises(StoreCorruptError, match=f"broken{SUFFIX[fmt]}.*not valid JSON"):
        dlstore.open_dataset(broken)


# --- processes -----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_dataloader_workers(fmt, context, stores):
    # A transform travels to the workers with the dataset (pickled, under spawn); p=0: identity.
    ds = dlstore.open_dataset(stores[fmt], transform=v2.RandomHorizontalFlip(p=0.0))
    expected, expected_labels = ds.read_batch(range(len(ds)))  # the parent has read (and opened) first
    assert torch.equal(expected, torch.stack(_all_images(ds)))
    loader = DataLoader(ds, batch_size=5, num_workers=2, multiprocessing_context=context)
    images, labels = zip(*loader)
    assert torch.equal(torch.cat(images), expected)
    assert torch.equal(torch.cat(labels), expected_labels)
    assert torch.cat(labels).tolist() == ds.targets


def _digest_of_store(path, barrier, queue) -> None:
    ds = dlstore.open_dataset(path)
    barrier.wait(timeout=60)  # both children read at the same time
    order = np.random.default_rng().permutation(len(ds))
    images = {int(i): ds.read(int(i)).numpy().tobytes() for i in order}
    queue.put(hashlib.sha256(b"".join(images[i] for i in range(len(ds)))).hexdigest())


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_processes_read_one_store_at_once(fmt, stores):
    ds = dlstore.open_dataset(stores[fmt])
    expected = hashlib.sha256(b"".join(ds.read(i).numpy().tobytes() for i in range(len(ds)))).hexdigest()
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_digest_of_store, args=(stores[fmt], barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    digests = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert digests == [expected, expected]
    assert ds.read(5).shape == (3, 32, 32)  # the parent still reads


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_reader_pickles_without_handles(fmt, stores):
    ds = dlstore.open_dataset(stores[fmt])
    first = ds[3][0]
    copy = pickle.loads(pickle.dumps(ds))
    assert torch.equal(copy[3][0], first)


def test_several_readers_of_one_lmdb_store_in_one_process(stores):
    """py-lmdb refuses a second open of one environment in a process; readers must share it."""
    a = dlstore.open_dataset(stores["lmdb"])
    b = dlstore.open_dataset(stores["lmdb"])
    assert torch.equal(a[1][0], b[1][0])
    del a
    c = dlstore.open_dataset(stores["lmdb"])
    assert torch.equal(b[2][0], c[2][0])
    d = dlstore.open_dataset(stores["lmdb"] / "data.mdb")  # detection accepts the data file too
    assert d.format == "lmdb" and torch.equal(d[2][0], c[2][0])
    del b, c, d


def test_lmdb_store_already_open_outside_dlstore_is_explained(stores):
    env = lmdb.open(str(stores["lmdb"]), readonly=True, lock=False)
    try:
        if int(lmdb.__version__.split(".")[0]) >= 2:   # py-lmdb 2 refuses a second open in one process
            with pytest.raises(RuntimeError, match="s.lmdb.*already has the environment open outside dlstore"):
                dlstore.open_dataset(stores["lmdb"])
        else:                                          # py-lmdb 1.x allows it (lock=False: no flock to break)
            assert dlstore.open_dataset(stores["lmdb"])[0][1] == 0
            with env.begin() as txn:
                assert txn.get(b"__dlstore__") is not None
    finally:
        env.close()
    assert dlstore.open_dataset(stores["lmdb"])[0][1] == 0


# --- native readability: plain lmdb / h5py / numpy, no dlstore -----------------------------

def test_native_lmdb_read(stores, var_stores, rgb_folder, varsize_folder):
    # Exactly the README's recipe.
    env = lmdb.open(str(stores["lmdb"]), readonly=True, lock=False)
    with env.begin() as txn:
        m = json.loads(txn.get(b"__dlstore__"))
        labels = np.frombuffer(txn.get(b"__labels__"), dtype="<i8")
        first = np.frombuffer(txn.get(b"%010d" % 0), dtype=np.uint8).reshape(m["sample"]["shape"])
        images = [np.frombuffer(txn.get(b"%010d" % i), dtype=np.uint8).reshape(m["sample"]["shape"])
                  for i in range(m["count"])]
    env.close()
    reference = datasets.ImageFolder(str(rgb_folder), transform=REFERENCE)
    assert m["classes"] == reference.classes and labels.tolist() == reference.targets
    assert np.array_equal(first, reference[0][0].numpy())
    assert all(np.array_equal(images[i], reference[i][0].numpy()) for i in range(len(reference)))

    env = lmdb.open(str(var_stores["lmdb"]), readonly=True, lock=False)
    with env.begin() as txn:
        shapes = np.frombuffer(txn.get(b"__shapes__"), dtype="<i8").reshape(-1, 3)
        images = [np.frombuffer(txn.get(b"%010d" % i), dtype=np.uint8).reshape(shapes[i])
                  for i in range(len(shapes))]
    env.close()
    reference = datasets.ImageFolder(str(varsize_folder), transform=v2.PILToTensor())
    assert all(np.array_equal(images[i], reference[i][0].numpy()) for i in range(len(reference)))


def test_native_hdf5_read(stores, var_stores, rgb_folder, varsize_folder):
    # Exactly the README's recipe.
    with h5py.File(stores["hdf5"], "r") as f:
        m = json.loads(f.attrs["dlstore"])
        images = f["images"]  # (N, 3, 32, 32) uint8
        first, labels, everything = images[0], f["labels"][:], images[:]
    reference = datasets.ImageFolder(str(rgb_folder), transform=REFERENCE)
    assert m["classes"] == reference.classes and labels.tolist() == reference.targets
    assert np.array_equal(first, reference[0][0].numpy())
    assert np.array_equal(everything, np.stack([reference[i][0].numpy() for i in range(len(reference))]))

    with h5py.File(var_stores["hdf5"], "r") as f:
        images = [f["images"][i].reshape(f["shapes"][i]) for i in range(len(f["images"]))]
    reference = datasets.ImageFolder(str(varsize_folder), transform=v2.PILToTensor())
    assert all(np.array_equal(images[i], reference[i][0].numpy()) for i in range(len(reference)))


# --- format options ------------------------------------------------------------------------

@pytest.mark.parametrize("compression", ["lzf", "gzip"])
def test_hdf5_compression(compression, stores, rgb_folder, tmp_path):
    _convert(rgb_folder, tmp_path / "c.h5", compression=compression)
    with h5py.File(tmp_path / "c.h5", "r") as f:
        assert f["images"].compression == compression and f["images"].chunks == (1, 3, 32, 32)
    ds = dlstore.open_dataset(tmp_path / "c.h5")
    assert ds.manifest["layout"]["compression"] == compression
    plain = dlstore.open_dataset(stores["hdf5"])
    assert torch.equal(ds.read_batch(range(24))[0], plain.read_batch(range(24))[0])
    assert ds.manifest["checksums"] == plain.manifest["checksums"]


def test_cli_compression_option(rgb_folder, tmp_path):
    runner = CliRunner()
    result = runner.invoke(cli, ["convert", str(rgb_folder), str(tmp_path / "c.h5"), "--static", STATIC,
                                 "--workers", "0", "--quiet", "--compression", "gzip"])
    assert result.exit_code == 0, result.output
    with h5py.File(tmp_path / "c.h5", "r") as f:
        assert f["images"].compression == "gzip"
    result = runner.invoke(cli, ["convert", str(rgb_folder), str(tmp_path / "c.lmdb"), "--static", STATIC,
                                 "--workers", "0", "--quiet", "--compression", "lzf"])
    assert result.exit_code != 0 and "hdf5" in result.output and not (tmp_path / "c.lmdb").exists()
    result = runner.invoke(cli, ["convert", str(rgb_folder), str(tmp_path / "d.h5"), "--compression", "zstd"])
    assert result.exit_code != 0 and not (tmp_path / "d.h5").exists()


def test_compression_refused_where_it_cannot_apply(varsize_folder, rgb_folder, tmp_path):
    with pytest.raises(ValueError, match="fixed-shape"):
        _convert(varsize_folder, tmp_path / "v.h5", static="", compression="gzip")
    with pytest.raises(ValueError, match="valid: none, lzf, gzip"):
        _convert(rgb_folder, tmp_path / "x.h5", compression="zstd")
    with pytest.raises(ValueError, match="hdf5"):
        _convert(rgb_folder, tmp_path / "x.lmdb", compression="gzip")
    with pytest.raises(ValueError, match="compression applies to hdf5"):
        _convert(rgb_folder, tmp_path / "x.shards", compression="gzip")
    assert list(tmp_path.iterdir()) == []  # nothing left behind, not even a staging path


def test_lmdb_map_grows_past_its_initial_size(rgb_folder, tmp_path):
    # 24 samples of 3 KiB need ~130 KiB of pages; start with 64 KiB and commit 4 samples at a time.
    _convert(rgb_folder, tmp_path / "g.lmdb", map_size=1 << 16, batch_bytes=4 * 3072)
    # The data file never exceeds the map: being larger than the initial map, the map grew.
    assert (tmp_path / "g.lmdb" / "data.mdb").stat().st_size > 1 << 16
    ds = dlstore.open_dataset(tmp_path / "g.lmdb")
    reference = datasets.ImageFolder(str(rgb_folder), transform=REFERENCE)
    assert all(torch.equal(ds[i][0], reference[i][0]) for i in range(len(ds)))


def test_lmdb_readahead_is_overridable(stores):
    from dlstore.formats.lmdb import LmdbReader

    assert LmdbReader(stores["lmdb"]).readahead is True  # a tiny store fits in RAM
    reader = LmdbReader(stores["lmdb"], readahead=False)
    assert reader.readahead is False and reader.get(0).shape == (3, 32, 32)


# --- damaged stores ------------------------------------------------------------------------

def test_damaged_lmdb_store_is_refused_naming_it(stores, tmp_path):
    broken = tmp_path / "broken.lmdb"
    shutil.copytree(stores["lmdb"], broken)
    env = lmdb.open(str(broken))
    with env.begin(write=True) as txn:
        txn.delete(b"%010d" % 23)
    env.close()
    with pytest.raises(StoreCorruptError, match="broken.lmdb.*0000000023"):
        dlstore.open_dataset(broken)

    env = lmdb.open(str(broken))
    with env.begin(write=True) as txn:
        txn.put(b"%010d" % 23, b"short")
        txn.put(b"__labels__", np.zeros(3, "<i8").tobytes())
    env.close()
    with pytest.raises(StoreCorruptError, match="broken.lmdb.*__labels__"):
        dlstore.open_dataset(broken)

    env = lmdb.open(str(broken))
    with env.begin(write=True) as txn:
        txn.delete(b"__dlstore__")
    env.close()
    with pytest.raises(StoreCorruptError, match="broken.lmdb.*__dlstore__"):
        dlstore.open_dataset(broken)


def test_truncated_stores_are_refused_not_crashing(stores, tmp_path):
    lm = tmp_path / "cut.lmdb"
    shutil.copytree(stores["lmdb"], lm)
    data = lm / "data.mdb"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # reading past EOF of a map: SIGBUS
    with pytest.raises(StoreCorruptError, match="cut.lmdb.*truncated"):
        dlstore.open_dataset(lm)
    h5 = tmp_path / "cut.h5"
    h5.write_bytes(stores["hdf5"].read_bytes()[:-5000])
    with pytest.raises(StoreCorruptError, match="cut.h5"):
        dlstore.open_dataset(h5)


def test_damaged_hdf5_store_is_refused_naming_it(stores, tmp_path):
    broken = tmp_path / "broken.h5"
    shutil.copy(stores["hdf5"], broken)
    with h5py.File(broken, "a") as f:
        del f["labels"]
    with pytest.raises(StoreCorruptError, match="broken.h5.*labels"):
        dlstore.open_dataset(broken)

    shutil.copy(stores["hdf5"], broken)
    with h5py.File(broken, "a") as f:
        f["images"].resize(20, axis=0)
    with pytest.raises(StoreCorruptError, match=r"broken.h5.*/images"):
        dlstore.open_dataset(broken)

    shutil.copy(stores["hdf5"], broken)
    with h5py.File(broken, "a") as f:
        f.attrs["dlstore"] = "{not json"
    with pytest.raises(StoreCorruptError, match="broken.h5.*JSON"):
        dlstore.open_dataset(broken)

    shutil.copy(stores["hdf5"], broken)
    with h5py.File(broken, "a") as f:
        del f.attrs["dlstore"]
    with pytest.raises(StoreCorruptError, match="broken.h5.*dlstore"):
        dlstore.open_dataset(broken)


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_batch_path_with_dynamic_transforms_matches_shards(fmt, stores):
    """StoreDataset.get_batch (random crop + flip fused into the gather) on every reader."""
    dynamic = v2.Compose([v2.RandomCrop(28, padding=2), v2.RandomHorizontalFlip()])
    ds = dlstore.open_dataset(stores[fmt], transform=dynamic)
    shards = dlstore.open_dataset(stores["shards"], transform=dynamic)
    order = [5, 17, 0, 5, 23, 9]
    images, labels = ds.get_batch(order, generator=torch.Generator().manual_seed(3))
    ref_images, ref_labels = shards.get_batch(order, generator=torch.Generator().manual_seed(3))
    assert images.shape == (6, 3, 28, 28)
    assert torch.equal(images, ref_images) and torch.equal(labels, ref_labels)


def test_reader_options_reach_the_reader(rgb_folder, tmp_path):
    dlstore.convert(rgb_folder, tmp_path / "s.lmdb", workers=0, progress=False)
    dlstore.convert(rgb_folder, tmp_path / "s.shards", workers=0, progress=False)
    assert dlstore.open_dataset(tmp_path / "s.lmdb", reader_options={"readahead": False}).reader.readahead is False
    assert dlstore.open_dataset(tmp_path / "s.lmdb", reader_options={"readahead": True}).reader.readahead is True
    assert dlstore.open_dataset(tmp_path / "s.shards", reader_options={"readahead": False}).reader.readahead is False
    with pytest.raises(ValueError, match="do not apply to shards stores"):
        dlstore.open_dataset(tmp_path / "s.shards", reader_options={"chunk_cache_bytes": 1 << 20})


@pytest.mark.parametrize("name", ["s.shards", "s.lmdb", "s.h5"])
def test_variable_shape_store_whose_samples_share_one_size(tmp_path, name):
    """No size-fixing op, but every image has the same size: blocks of equal-length records."""
    src = make_image_folder(tmp_path / "same", classes=2, per_class=6, size=(30, 40))
    # blocks of ~5000 bytes: a shards store rolls its .bin files over, LMDB and HDF5 commit
    block = {"shard_size": 5000} if name.endswith(".shards") else {"batch_bytes": 5000}
    dlstore.convert(src, tmp_path / name, static="resize=20", workers=0, progress=False, **block)
    ds = dlstore.open_dataset(tmp_path / name)
    assert ds.shape is None and len(ds) == 12
    reference = datasets.ImageFolder(str(src), transform=v2.Compose([v2.Resize(20), v2.PILToTensor()]))
    assert all(torch.equal(ds[i][0], reference[i][0]) for i in range(len(ds)))


# --- shards-specific: the layout of a .shards folder ---------------------------------------
#
#   manifest.json     the manifest; layout.shards lists each file with its sample count
#   labels.npy        int64 (N,)
#   shard-00000.npy   uint8 (k, C, H, W), k <= shard_size // sample bytes; the last file may be shorter
#   data-00000.bin    variable-shape stores: raw CHW bytes, rolled over at shard_size ...
#   index.npy         ... int64 (N, 5): file, offset, C, H, W per sample

def test_native_shards_read(stores, rgb_folder):
    # Exactly the README's recipe, for every file of a store that rolled over into five.
    path = stores["shards"]
    m = json.loads((path / "manifest.json").read_text())
    labels = np.load(path / "labels.npy")
    names = sorted(p.name for p in path.glob("shard-*.npy"))
    assert names == [f"shard-{i:05d}.npy" for i in range(5)]
    assert [s["file"] for s in m["layout"]["shards"]] == names
    shards = [np.load(path / name, mmap_mode="r") for name in names]
    # 5+5+5+5+4: the last file is shorter and still a valid .npy
    assert [s.shape for s in shards] == [(5, 3, 32, 32)] * 4 + [(4, 3, 32, 32)]
    assert all(s.dtype == np.uint8 for s in shards) and labels.dtype == np.int64
    reference = datasets.ImageFolder(str(rgb_folder), transform=REFERENCE)
    assert m["classes"] == reference.classes and labels.tolist() == reference.targets
    everything = np.concatenate(shards)
    assert all(np.array_equal(everything[i], reference[i][0].numpy()) for i in range(len(reference)))


def test_shards_checksums_are_the_sha256_of_each_file(stores):
    path = stores["shards"]
    files = json.loads((path / "manifest.json").read_text())["checksums"]["files"]
    assert set(files) == {f"shard-{i:05d}.npy" for i in range(5)} | {"labels.npy", "provenance-offsets.npy",
                         "provenance-blob.npy", "crc32.npy"}
    for name, digest in files.items():
        assert hashlib.sha256((path / name).read_bytes()).hexdigest() == digest, name


def test_variable_shape_shards_roll_over_into_bin_files_with_an_index(mixed_folder, tmp_path):
    _convert(mixed_folder, tmp_path / "v.shards", static="resize=11", shard_size=2000)
    ds = dlstore.open_dataset(tmp_path / "v.shards")
    reference = datasets.ImageFolder(str(mixed_folder), transform=v2.Compose([v2.Resize(11), v2.PILToTensor()]))
    assert ds.shape is None
    shapes = set()
    for i in range(len(ds)):
        assert torch.equal(ds[i][0], reference[i][0])
        shapes.add(tuple(ds[i][0].shape))
    assert len(shapes) > 1
    assert len(list((tmp_path / "v.shards").glob("data-*.bin"))) > 1
    index = np.load(tmp_path / "v.shards" / "index.npy")
    assert index.shape == (len(ds), 5)


def test_files_of_unequal_counts_are_indexed_by_their_starts(stores, tmp_path):
    """A store assembled from several writers (e.g. one per rank) has short files mid-store."""
    dst = _copy_store(stores["shards"], tmp_path / "s.shards")  # files of 5, 5, 5, 5, 4 samples
    expected = [dlstore.open_dataset(dst)[i][0].clone() for i in range(24)]
    # split shard-00001 into two files of 2 and 3 samples: files of 5, 2, 3, 5, 5, 4
    m = json.loads((dst / "manifest.json").read_text())
    first = np.load(dst / "shard-00001.npy")
    np.save(dst / "shard-00001.npy", first[:2])
    np.save(dst / "shard-00001b.npy", first[2:])
    m["layout"]["shards"][1:2] = [{"file": "shard-00001.npy", "count": 2}, {"file": "shard-00001b.npy", "count": 3}]
    (dst / "manifest.json").write_text(json.dumps(m))
    ds = dlstore.open_dataset(dst)
    assert all(torch.equal(ds[i][0], expected[i]) for i in range(24))
    order = [23, 6, 7, 5, 0, 8, 9]
    images, _ = ds.read_batch(order)
    assert all(torch.equal(images[j], expected[i]) for j, i in enumerate(order))


def test_unsafe_file_name_in_a_shards_manifest_is_refused(stores, tmp_path):
    dst = _copy_store(stores["shards"], tmp_path / "s.shards")
    m = json.loads((dst / "manifest.json").read_text())
    m["layout"]["shards"][0]["file"] = "../../etc/passwd"
    (dst / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreCorruptError, match="unsafe"):
        dlstore.open_dataset(dst)
