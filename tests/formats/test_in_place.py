"""LMDB and HDF5 samples read in place (from a map of the file at each sample's offset) against
the same stores read natively (``in_place=False``: lmdb transactions, h5py), against the arrays
they were written from, and against stores written by hand the way other tools write them:
HDF5 with compressed chunks, chunks of several samples, chunks that split a sample, a
contiguous dataset, a chunk never written; LMDB with its keys put in a random order."""

from __future__ import annotations

import json

import h5py
import lmdb
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchvision.transforms import v2

import dlstore
from dlstore.errors import StoreCorruptError
from dlstore.formats.lmdb.layout import LABELS_KEY, MANIFEST_KEY, SUMS_KEY, sample_key
from dlstore.transforms import compiled

N, SHAPE = 24, (3, 20, 28)      # 1,680-byte samples: LMDB keeps them in leaf pages
BIG = (3, 40, 36)                # 4,320 bytes: overflow pages


def _images(n: int, shape: tuple[int, int, int], seed: int) -> np.ndarray:
    c, h, w = shape
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, c), dtype=np.uint8)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """dlstore-written stores (name -> path) and their samples as CHW arrays (name -> (N, C, H, W))."""
    root = tmp_path_factory.mktemp("inplace")
    paths, samples = {}, {}
    for name, shape in (("small", SHAPE), ("big", BIG)):
        images = _images(N, shape, seed=len(name))
        for suffix in ("lmdb", "h5"):
            key = f"{name}.{suffix}"
            paths[key] = root / key
            dlstore.convert((images, np.arange(N) % 3), paths[key], workers=0, progress=False)
            samples[key] = images.transpose(0, 3, 1, 2)
    return paths, samples


def _readers(path, **options):
    in_place = dlstore.open_dataset(path, reader_options=options or None).reader
    native = dlstore.open_dataset(path, reader_options={"in_place": False}).reader
    return in_place, native


def _kernel_in_place(reader, order, tops, lefts, flips, padding):
    located = reader.sample_addresses(order)
    assert located is not None, reader.read_path_reason
    addresses, _mapped = located
    out = np.empty((len(order), *reader.shape), np.uint8)
    return compiled.crop_flip_at(addresses, reader.shape, out, tops, lefts, flips, padding, 0)


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(["small.lmdb", "big.lmdb", "small.h5", "big.h5"]), data=st.data())
def test_in_place_reads_equal_native_reads_and_the_source(stores, name, data):
    paths, samples = stores
    order = np.array(data.draw(st.lists(st.integers(0, N - 1), min_size=1, max_size=3 * N)))
    reader, native = _readers(paths[name])
    assert reader.read_path == "in place" and native.read_path == "native"
    expected = samples[name][order]
    np.testing.assert_array_equal(reader.get_batch(order), expected)
    np.testing.assert_array_equal(native.get_batch(order), expected)
    for got, want in zip(reader.get_many(order.tolist()), expected):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(reader.get(int(order[0])), expected[0])
    if compiled.available():
        rng = np.random.default_rng(len(order))
        tops, lefts, flips = rng.integers(0, 9, len(order)), rng.integers(0, 9, len(order)), rng.random(len(order)) < .5
        want = compiled.crop_flip(native.get_many(order.tolist()), np.empty(expected.shape, np.uint8), tops, lefts,
                                  flips, (4, 4, 4, 4), 0)
        np.testing.assert_array_equal(_kernel_in_place(reader, order, tops, lefts, flips, (4, 4, 4, 4)), want)


@pytest.mark.parametrize("small", [True, False], ids=["numpy index", "memmove"])
@pytest.mark.parametrize("name", ["small.lmdb", "big.h5"])
def test_in_place_batches_without_the_compiled_kernel(stores, monkeypatch, name, small):
    """The gather's pure paths where numba is not used: one numpy index of the map (small
    samples), one memmove per sample (large ones)."""
    from dlstore.formats import inplace

    paths, samples = stores
    monkeypatch.setenv("DLSTORE_COMPILED", "0")
    monkeypatch.setattr(inplace, "SMALL_SAMPLE", 1 << 30 if small else 0)
    reader, _ = _readers(paths[name])
    order = np.random.default_rng(5).integers(0, N, 30)
    np.testing.assert_array_equal(reader.get_batch(order), samples[name][order])


@pytest.mark.parametrize("name", ["small.lmdb", "big.h5"])
def test_fused_crop_flip_reads_in_place_and_equals_the_native_path(stores, name):
    """StoreDataset.get_batch (the lead's gather) takes the addresses and gives the pixels the
    native path gives for the same generator."""
    paths, _ = stores
    transform = v2.Compose([v2.RandomCrop(SHAPE[1:] if name.startswith("small") else BIG[1:], padding=3),
                            v2.RandomHorizontalFlip()])
    fast = dlstore.open_dataset(paths[name], transform=transform)
    slow = dlstore.open_dataset(paths[name], transform=transform, reader_options={"in_place": False})
    idx = list(range(N))[::-1] + [5, 5]
    calls = []
    addresses = fast.reader.sample_addresses
    fast.reader.sample_addresses = lambda i: calls.append(len(i)) or addresses(i)
    a, _ = fast.get_batch(idx, generator=torch.Generator().manual_seed(3))
    b, _ = slow.get_batch(idx, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    if compiled.available():
        assert calls == [len(idx)]


def test_views_handed_out_are_writable_and_never_change_the_store(stores):
    """Views of a copy-on-write map, as the shards reader hands out: writable for torch, and a
    write changes this process's copy of the page (this reader's later reads of it), never the file."""
    paths, samples = stores
    for name in ("small.lmdb", "big.h5"):
        reader, _ = _readers(paths[name])
        view = reader.get_many([2])[0]
        assert view.flags.writeable and not view.flags.owndata
        view[:] = 0
        del reader, view
        for fresh in _readers(paths[name]):
            np.testing.assert_array_equal(fresh.get(2), samples[name][2])


@pytest.mark.parametrize("name", ["small.lmdb", "big.lmdb", "small.h5"])
def test_sample_sums_are_checked_on_the_in_place_path(stores, tmp_path, name):
    """check="sample": a sample whose bytes changed in the file is named before a kernel reads it."""
    paths, samples = stores
    dst = tmp_path / name
    data = dst / "data.mdb" if name.endswith(".lmdb") else dst
    if name.endswith(".lmdb"):
        dst.mkdir()
        (dst / "data.mdb").write_bytes((paths[name] / "data.mdb").read_bytes())
    else:
        dst.write_bytes(paths[name].read_bytes())
    raw = bytearray(data.read_bytes())
    at = bytes(raw).find(samples[name][7].tobytes())
    assert at > 0 and bytes(raw).find(samples[name][7].tobytes(), at + 1) < 0
    raw[at + 5] ^= 0xFF
    data.write_bytes(bytes(raw))
    reader = dlstore.open_dataset(dst, check="sample").reader
    assert reader.read_path == "in place"
    assert reader.sample_addresses(np.array([3, 4])) is not None
    with pytest.raises(StoreCorruptError, match="sample 7 fails its CRC32"):
        reader.sample_addresses(np.array([3, 7]))
    with pytest.raises(StoreCorruptError, match="sample 7 fails its CRC32"):
        reader.get_batch(np.array([7]))


# --- HDF5 written by hand -----------------------------------------------------------------

def _hdf5_by_hand(dst, template, images, **create):
    """An HDF5 store as h5py writes one: /images (N, C, H, W) with ``create``'s chunks and
    filters, /labels, the manifest of a dlstore store of the same samples (``template``)."""
    with h5py.File(template, "r") as f:
        manifest, labels, crc = f.attrs["dlstore"], f["labels"][()], f["crc32"][()]
    with h5py.File(dst, "w") as f:
        f.create_dataset("images", data=images, **create)
        f["labels"], f["crc32"] = labels, crc
        f.attrs["dlstore"] = manifest
    return dst


HAND_WRITTEN = {   # name -> (h5py create_dataset options, read path expected)
    "gzip, one per chunk": ({"chunks": (1, *BIG), "compression": "gzip"}, "native"),
    "lzf, 5 per chunk": ({"chunks": (5, *BIG), "compression": "lzf"}, "native"),
    "raw, 5 per chunk": ({"chunks": (5, *BIG)}, "in place"),
    "raw, chunks split samples": ({"chunks": (2, 3, 20, 36)}, "native"),
    "contiguous": ({}, "in place"),
    "shuffle only": ({"chunks": (1, *BIG), "shuffle": True}, "native"),
}


@pytest.mark.parametrize("case", list(HAND_WRITTEN))
def test_hand_written_hdf5_reads_the_samples_h5py_reads(stores, tmp_path, case):
    paths, samples = stores
    create, expected_path = HAND_WRITTEN[case]
    images = samples["big.h5"]
    dst = _hdf5_by_hand(tmp_path / "hand.h5", paths["big.h5"], images, **create)
    reader = dlstore.open_dataset(dst).reader
    order = np.random.default_rng(1).integers(0, N, 40)
    with h5py.File(dst, "r") as f:
        reference = np.stack([f["images"][i] for i in order])       # what h5py reads
    np.testing.assert_array_equal(reference, images[order])
    np.testing.assert_array_equal(reader.get_batch(order), reference)
    for got, want in zip(reader.get_many(order.tolist()), reference):
        np.testing.assert_array_equal(got, want)
    assert reader.read_path == expected_path, reader.read_path_reason
    assert (reader.sample_addresses(order) is not None) == (expected_path == "in place")
    layout = reader.sample_layout()
    assert layout.read_path == expected_path and layout.in_order is True


def test_a_chunk_never_written_reads_h5pys_fill_and_turns_the_reader_native(stores, tmp_path):
    paths, samples = stores
    dst = tmp_path / "holes.h5"
    with h5py.File(paths["big.h5"], "r") as f:
        manifest, labels = f.attrs["dlstore"], f["labels"][()]
    with h5py.File(dst, "w") as f:
        images = f.create_dataset("images", shape=(N, *BIG), dtype=np.uint8, chunks=(1, *BIG), fillvalue=9)
        for i in range(N):
            if i != 6:
                images[i] = samples["big.h5"][i]
        f["labels"] = labels
        f.attrs["dlstore"] = manifest
    reader = dlstore.open_dataset(dst).reader
    assert reader.read_path == "in place"            # what the dataset's properties allow ...
    batch = reader.get_batch(np.array([5, 6, 7]))
    assert reader.read_path == "native" and "sample 6 was never written" in reader.read_path_reason
    np.testing.assert_array_equal(batch[[0, 2]], samples["big.h5"][[5, 7]])
    assert (batch[1] == 9).all()


# --- LMDB written by hand, keys out of order --------------------------------------------------

def test_lmdb_with_keys_put_out_of_order_reads_in_place(stores, tmp_path):
    """A folder2lmdb-style script: keys put one transaction at a time in a random order (no
    MDB_APPEND: pages split, values scattered over the file)."""
    paths, samples = stores
    images = samples["big.lmdb"]
    with lmdb.open(str(paths["big.lmdb"]), readonly=True, lock=False) as env, env.begin() as txn:
        meta = {key: txn.get(key) for key in (MANIFEST_KEY, LABELS_KEY, SUMS_KEY)}
    dst = tmp_path / "shuffled.lmdb"
    with lmdb.open(str(dst), map_size=64 << 20) as env:
        for i in np.random.default_rng(4).permutation(N).tolist():
            with env.begin(write=True) as txn:
                txn.put(sample_key(i), images[i].tobytes())
        with env.begin(write=True) as txn:
            for key, value in meta.items():
                txn.put(key, value)
    reader, native = _readers(dst)
    order = np.random.default_rng(2).integers(0, N, 50)
    with lmdb.open(str(dst), readonly=True, lock=False) as env, env.begin() as txn:
        reference = np.stack([np.frombuffer(txn.get(sample_key(i)), np.uint8).reshape(BIG) for i in order])
    np.testing.assert_array_equal(reference, images[order])
    np.testing.assert_array_equal(reader.get_batch(order), reference)
    np.testing.assert_array_equal(native.get_batch(order), reference)
    assert reader.read_path == "in place"
    layout = reader.sample_layout()
    assert layout.read_path == "in place" and layout.in_order is False
    assert dlstore.open_dataset(paths["big.lmdb"]).reader.sample_layout().in_order is True



# --- what dlstore convert writes, and what dlstore info says ---------------------------------

def _info(path) -> dict:
    from click.testing import CliRunner

    from dlstore.cli import main

    result = CliRunner().invoke(main, ["info", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["summary"]


def test_dlstore_convert_writes_gatherable_stores_and_info_says_so(tmp_path, stores):
    from click.testing import CliRunner

    from dlstore.cli import main
    from dlstore.sources.demo import make_image_folder

    paths, samples = stores
    src = make_image_folder(tmp_path / "images", classes=2, per_class=6, size=(30, 40))
    for suffix in ("lmdb", "h5"):
        dst = tmp_path / f"cli.{suffix}"
        result = CliRunner().invoke(main, ["convert", str(src), str(dst), "--static", "resize=24,center_crop=24",
                                           "--workers", "0", "--quiet"])
        assert result.exit_code == 0, result.output
        summary = _info(dst)
        assert (summary["read_path"], summary["gatherable"], summary["in_order"]) == ("in place", True, True)
        text = CliRunner().invoke(main, ["info", str(dst)]).output
        assert "layout    gatherable" in text and "reads     in place: " in text
    lzf = _hdf5_by_hand(tmp_path / "lzf.h5", paths["big.h5"], samples["big.h5"], chunks=(4, *BIG), compression="lzf")
    summary = _info(lzf)
    assert (summary["read_path"], summary["gatherable"], summary["in_order"]) == ("native", False, True)
    assert "filtered (lzf)" in summary["read_path_reason"]


def test_a_plain_in_place_read_does_not_load_numba(stores):
    """The gather uses the compiled kernel only where a fused crop built it: importing numba for a
    static read cost a cold first epoch its libraries' reads (and, in a small cgroup, cache room)."""
    import subprocess
    import sys

    paths, _ = stores
    code = ("import sys, numpy as np, dlstore\n"
            f"for p in ({str(paths['small.lmdb'])!r}, {str(paths['big.h5'])!r}):\n"
            "    r = dlstore.open_dataset(p).reader\n"
            "    assert r.read_path == 'in place'\n"
            "    r.get_batch(np.arange(5))\n"
            "print('numba' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
