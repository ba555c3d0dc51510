"""The store contract, checked on every format: shards, LMDB, HDF5.

Every store is a real file or folder written by ``dlstore.convert`` from real
JPEG/PNG files, and read back through real DataLoader worker processes.
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
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.transforms import v2

import dlstore
from dlstore.cli import main as cli
from dlstore.errors import StoreCorruptError
from dlstore.sources.demo import make_image_folder

FORMATS = ["shards", "lmdb", "hdf5"]
SUFFIX = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}
STATIC = "resize=36,center_crop=32"
REFERENCE = v2.Compose([v2.Resize(36), v2.CenterCrop(32), v2.PILToTensor()])


def _convert(src, dst, **kw):
    kw.setdefault("static", STATIC)
    kw.setdefault("workers", 0)
    kw.setdefault("progress", False)
    return dlstore.convert(src, dst, **kw)


@pytest.fixture(scope="module")
def stores(rgb_folder, tmp_path_factory):
    """The 24-sample RGB folder converted to every format (3x32x32)."""
    root = tmp_path_factory.mktemp("stores")
    return {fmt: _convert(rgb_folder, root / f"s{SUFFIX[fmt]}").path for fmt in FORMATS}


@pytest.fixture(scope="module")
def var_stores(varsize_folder, tmp_path_factory):
    """The variable-size folder converted without a size-fixing op, to every format."""
    root = tmp_path_factory.mktemp("var")
    return {fmt: _convert(varsize_folder, root / f"v{SUFFIX[fmt]}", static="").path for fmt in FORMATS}


def _all_images(ds) -> list[torch.Tensor]:
    return [ds[i][0] for i in range(len(ds))]


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
    assert lm == h5 and set(lm) == {"samples", "labels"}
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
    _convert(mixed_folder, tmp_path / f"m{SUFFIX[fmt]}", static=static)
    ds = dlstore.open_dataset(tmp_path / f"m{SUFFIX[fmt]}")
    reference = datasets.ImageFolder(str(mixed_folder), transform=v2.Compose(ops))
    assert len(ds) == len(reference) == 10
    assert ds.shape == ((1 if gray else 3), 16, 16)
    for i in range(len(ds)):
        assert torch.equal(ds[i][0], reference[i][0]), f"{fmt}: sample {i} ({reference.samples[i][0]}) differs"
    assert ds.targets == reference.targets


@pytest.mark.parametrize("fmt", FORMATS)
def test_payload_is_identical_whatever_the_worker_count(fmt, rgb_folder, tmp_path):
    one = _convert(rgb_folder, tmp_path / f"w1{SUFFIX[fmt]}", workers=1)
    two = _convert(rgb_folder, tmp_path / f"w2{SUFFIX[fmt]}", workers=2)
    m1 = dlstore.open_dataset(one.path).manifest
    m2 = dlstore.open_dataset(two.path).manifest
    assert m1["checksums"] == m2["checksums"] and m1["layout"] == m2["layout"]
    a, _ = dlstore.open_dataset(one.path).read_batch(range(24))
    b, _ = dlstore.open_dataset(two.path).read_batch(range(24))
    assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_getitems_returns_the_requested_order(fmt, stores):
    ds = dlstore.open_dataset(stores[fmt])
    order = [7, 0, 7, 23, 3, 1, 12]
    batch = ds.__getitems__(order)
    assert [label for _, label in batch] == [ds.targets[i] for i in order]
    for (image, _), i in zip(batch, order):
        assert torch.equal(image, ds[i][0])
    images, labels = ds.read_batch(order)
    assert torch.equal(images, torch.stack([ds[i][0] for i in order]))
    assert labels.tolist() == [ds.targets[i] for i in order]


# --- processes -----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers(fmt, context, stores):
    ds = dlstore.open_dataset(stores[fmt])
    expected, expected_labels = ds.read_batch(range(len(ds)))  # the parent has read (and opened) first
    loader = DataLoader(ds, batch_size=5, num_workers=2, multiprocessing_context=context)
    images, labels = zip(*loader)
    assert torch.equal(torch.cat(images), expected)
    assert torch.equal(torch.cat(labels), expected_labels)


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
        with pytest.raises(RuntimeError, match="s.lmdb.*already has the environment open outside dlstore"):
            dlstore.open_dataset(stores["lmdb"])
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
    with pytest.raises(ValueError, match="do not apply to shards stores"):
        dlstore.open_dataset(tmp_path / "s.shards", reader_options={"readahead": False})


@pytest.mark.parametrize("name", ["s.shards", "s.lmdb", "s.h5"])
def test_variable_shape_store_whose_samples_share_one_size(tmp_path, name):
    """No size-fixing op, but every image has the same size: blocks of equal-length records."""
    src = make_image_folder(tmp_path / "same", classes=2, per_class=6, size=(30, 40))
    dlstore.convert(src, tmp_path / name, static="resize=20", workers=0, progress=False, batch_bytes=5000)
    ds = dlstore.open_dataset(tmp_path / name)
    assert ds.shape is None and len(ds) == 12
    reference = datasets.ImageFolder(str(src), transform=v2.Compose([v2.Resize(20), v2.PILToTensor()]))
    assert all(torch.equal(ds[i][0], reference[i][0]) for i in range(len(ds)))
