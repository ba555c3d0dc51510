"""``overwrite`` replaces only what dlstore wrote, byte for byte: data a user added inside an LMDB or
HDF5 store (a dataset, an attribute, a key, with h5py and lmdb themselves) is named and refused, with
``overwrite=True`` and with ``overwrite="damaged"`` alike; every byte stays. A store as dlstore
wrote it is still replaced."""

from __future__ import annotations

import hashlib
from pathlib import Path

import h5py
import lmdb
import numpy as np
import pytest
import torch
from _helpers import LastItemDoes
from click.testing import CliRunner

import dlstore
from dlstore.cli import main
from dlstore.errors import NotAStoreError
from dlstore.formats.ownership import not_a_store
from dlstore.sources.demo import make_image_folder


@pytest.fixture(scope="module")
def imgs(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("own") / "imgs", classes=2, per_class=3, size=(20, 16))


def digest(path: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(path.iterdir())
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def h5_dataset(f):
    f["my_features"] = np.arange(6, dtype=np.float32)


def h5_group(f):
    f.create_group("experiments").create_dataset("run1", data=[1, 2, 3])


def h5_root_attribute(f):
    f.attrs["author"] = "me"


def h5_dataset_attribute(f):
    f["images"].attrs["note"] = "checked by hand"


def lmdb_key(txn):
    txn.put(b"my-notes", b"precious")


def lmdb_sample_past_the_end(txn):
    txn.put(b"%010d" % 6, b"an extra sample")


def lmdb_named_database(env):
    db = env.open_db(b"annotations")
    with env.begin(write=True, db=db) as txn:
        txn.put(b"0", b"a box")


EDITS = {   # name: (format, the edit, what the refusal names)
    "h5-dataset": ("hdf5", h5_dataset, "dataset /my_features"),
    "h5-group": ("hdf5", h5_group, "group /experiments"),
    "h5-root-attribute": ("hdf5", h5_root_attribute, "attribute 'author' of /"),
    "h5-dataset-attribute": ("hdf5", h5_dataset_attribute, "attribute 'note' of /images"),
    "lmdb-key": ("lmdb", lmdb_key, "key 'my-notes'"),
    "lmdb-sample-past-the-end": ("lmdb", lmdb_sample_past_the_end, "key '0000000006'"),
    "lmdb-named-database": ("lmdb", lmdb_named_database, "key 'annotations'"),
}


def edit(path: Path, fmt: str, change) -> None:
    if fmt == "hdf5":
        with h5py.File(path, "r+") as f:
            change(f)
        return
    env = lmdb.open(str(path), max_dbs=4)
    try:
        if change is lmdb_named_database:
            change(env)
        else:
            with env.begin(write=True) as txn:
                change(txn)
    finally:
        env.close()


@pytest.mark.parametrize("via", ["api", "cli"])
@pytest.mark.parametrize("case", list(EDITS))
def test_data_added_inside_a_store_is_named_and_never_replaced(imgs, tmp_path, case, via):
    fmt, change, named = EDITS[case]
    dst = tmp_path / ("s.h5" if fmt == "hdf5" else "s.lmdb")
    dlstore.convert(imgs, dst, workers=0, progress=False)
    edit(dst, fmt, change)
    before = digest(dst)
    for overwrite in (True, "damaged"):
        if via == "api":
            with pytest.raises(NotAStoreError) as err:
                dlstore.convert(imgs, dst, workers=0, progress=False, overwrite=overwrite)
            message = str(err.value)
        else:
            flag = "--overwrite" if overwrite is True else "--overwrite-damaged"
            result = CliRunner().invoke(main, ["convert", str(imgs), str(dst), flag, "--workers", "0", "--quiet"])
            assert result.exit_code == 2 and "Traceback" not in result.output, result.output
            message = result.output
            assert len(message.strip().splitlines()) == 1, message
        assert named in message and "did not write" in message, message
        assert digest(dst) == before                                         # every byte stays
        assert sorted(p.name for p in tmp_path.iterdir()) == [dst.name]    # no staging, lock or copy left


def test_an_addition_deleted_again_leaves_a_store_replaced_only_as_damaged(imgs, tmp_path):
    """h5py's ``del`` frees the space but the file is not what dlstore wrote: nothing is named, so
    ``overwrite=True`` refuses it as damaged and ``overwrite="damaged"`` replaces it."""
    dst = tmp_path / "s.h5"
    dlstore.convert(imgs, dst, workers=0, progress=False)
    edit(dst, "hdf5", h5_dataset)
    with h5py.File(dst, "r+") as f:
        del f["my_features"]
    with pytest.raises(NotAStoreError, match="differs from what dlstore wrote .*sha256 mismatch"):
        dlstore.convert(imgs, dst, workers=0, progress=False, overwrite=True)
    dlstore.convert(imgs, dst, workers=0, progress=False, overwrite="damaged")
    assert not_a_store(dst) is None


@pytest.mark.parametrize("fmt", ["hdf5", "lmdb", "shards"])
def test_a_store_as_dlstore_wrote_it_is_replaced(imgs, tmp_path, fmt):
    dst = tmp_path / {"hdf5": "s.h5", "lmdb": "s.lmdb", "shards": "s.shards"}[fmt]
    dlstore.convert(imgs, dst, workers=0, progress=False, static="center_crop=12")
    if fmt != "shards":   # read with the format's own library first: reading changes nothing
        if fmt == "hdf5":
            with h5py.File(dst, "r") as f:
                f["images"][0]
        else:
            env = lmdb.open(str(dst), readonly=True, lock=False)
            with env.begin() as txn:
                txn.get(b"0000000000")
            env.close()
    assert not_a_store(dst) is None
    dlstore.convert(imgs, dst, workers=0, progress=False, overwrite=True)    # another static: other bytes
    assert dlstore.open_dataset(dst)[0][0].shape == (3, 20, 16)


def test_a_shards_file_edited_in_place_is_damage(imgs, tmp_path):
    """A shards data file that differs from the sha256 its manifest records: replaced only when said damaged."""
    dst = tmp_path / "s.shards"
    dlstore.convert(imgs, dst, workers=0, progress=False, static="center_crop=12")
    labels = dst / "labels.npy"
    data = bytearray(labels.read_bytes())
    data[-1] ^= 1                                        # relabelled by hand
    labels.write_bytes(bytes(data))
    with pytest.raises(NotAStoreError, match=r"labels\.npy: sha256 mismatch"):
        dlstore.convert(imgs, dst, workers=0, progress=False, overwrite=True)
    dlstore.convert(imgs, dst, workers=0, progress=False, overwrite="damaged")
    assert dlstore.verify(dst, deep=True).ok


def test_data_added_while_the_conversion_runs_is_seen_at_the_end(tmp_path):
    dst = tmp_path / "s.h5"
    dlstore.convert(torch.zeros(4, 3, 8, 8, dtype=torch.uint8).numpy(), dst, workers=0, progress=False)
    with pytest.raises(NotAStoreError, match="dataset /added_meanwhile"):
        dlstore.convert(LastItemDoes(lambda: _add_dataset(dst)), dst, workers=0, progress=False, overwrite=True)
    with h5py.File(dst, "r") as f:
        assert list(f["added_meanwhile"][()]) == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.h5"]


def test_overwrite_takes_only_true_false_or_damaged(imgs, tmp_path):
    with pytest.raises(dlstore.ArgumentError, match="overwrite must be"):
        dlstore.convert(imgs, tmp_path / "s.shards", workers=0, progress=False, overwrite="yes")
    assert not any(tmp_path.iterdir())


def _add_dataset(dst: Path) -> None:
    """A user adds a dataset to the HDF5 store about to be replaced."""
    with h5py.File(dst, "r+") as f:
        f["added_meanwhile"] = [1, 2, 3]
