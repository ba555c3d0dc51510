"""A reader opened on store A, then A overwritten twice (A -> B -> C): the reader never reads C.

A reader recognises its store by the (device, inode) of the store's folder or file and
checks it after every later open by name. After two overwrites A's inode is free, and
ext4 hands freed inodes out again: C's folder or file can get A's inode, and a reader
that only compared numbers then read C's pixels beside A's labels and manifest (found by
benchmarks/soak.py). A reader holds a descriptor on the store's inode for as long as it
lives, so that inode cannot be reused: C always differs, and the first read is a clear
"replaced" error, never C's pixels.

Each round opens a cold reader (manifest and labels read, no data handle yet), replaces
the store twice, and reads. Many rounds, because whether the filesystem reuses an inode
is its choice; without the pin this failed on ext4 within a few rounds.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import dlstore
from dlstore.errors import StoreCorruptError
from dlstore.sources.demo import make_image_folder

ROUNDS = 12
STATICS = ["resize=20,center_crop=16", "resize=40,center_crop=16", "resize=28,center_crop=16"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("reuse") / "images", classes=2, per_class=3, size=(24, 30))


@pytest.mark.parametrize("name", ["s.shards", "s.lmdb", "s.h5"])
def test_reader_never_reads_a_store_that_took_its_inode(folder, tmp_path, name):
    dst = tmp_path / name
    dlstore.convert(folder, dst, static=STATICS[0], workers=0, progress=False)
    reused = 0
    for r in range(ROUNDS):
        reader = dlstore.open_dataset(dst)
        before = os.stat(dst).st_ino
        for k in (1, 2):
            dlstore.convert(folder, dst, static=STATICS[(r + k) % 3], workers=0, progress=False, overwrite=True)
        reused += os.stat(dst).st_ino == before
        assert os.stat(dst).st_ino != before, "the store's inode was handed to a new store while a reader held it"
        with pytest.raises(StoreCorruptError, match="replaced"):
            reader.read(0)
        del reader
    assert reused == 0


def test_a_pickled_reader_pins_the_store_again(folder, tmp_path):
    """A reader sent to a spawned worker (pickled) holds its own pin once unpickled."""
    dst = tmp_path / "p.shards"
    dlstore.convert(folder, dst, static=STATICS[0], workers=0, progress=False)
    ds = dlstore.open_dataset(dst)
    clone = pickle.loads(pickle.dumps(ds))
    first = clone.read(0).clone()
    assert torch.equal(first, ds.read(0))
    before = os.stat(dst).st_ino
    del ds
    for k in (1, 2):
        dlstore.convert(folder, dst, static=STATICS[k], workers=0, progress=False, overwrite=True)
    assert os.stat(dst).st_ino != before
