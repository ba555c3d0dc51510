"""A reader open on a store while ``convert(..., overwrite=True)`` replaces it: old samples or a clear error.

The new store has the same count, shape and classes as the old one but other pixels
(another static resize before the same crop), so a mix could not show as a shape or size
error: only as pixels. Every read of a reader opened before the replacement must give
the old sample or raise a DlstoreError, never the new sample; a reader opened after it
reads the new store.

Two readers per store: "warm" has read a sample before the replacement (its data
handles are open: the old files live on), "cold" has only been opened (manifest and
labels read, no data handle yet: its first read comes after the replacement).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dlstore
from dlstore.errors import DlstoreError, StoreCorruptError
from dlstore.sources.demo import make_image_folder

OLD = "resize=20,center_crop=16"
NEW = "resize=40,center_crop=16"
NAMES = ["s.shards", "s.lmdb", "s.h5"]
OPTIONS = {"workers": 0, "progress": False, "shard_size": 3 * 16 * 16 * 4}   # shards: 3 files of 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("overwrite") / "images", classes=2, per_class=6,
                             size=(24, 30))


def _pixels(path: Path) -> list[torch.Tensor]:
    ds = dlstore.open_dataset(path)
    return [ds.read(i).clone() for i in range(len(ds))]


def _classify(ds, old: list[torch.Tensor], new: list[torch.Tensor]) -> list[str]:
    """For every sample: "old", "new", "error" (a DlstoreError) or "other" (pixels of neither)."""
    out = []
    for i in range(len(old)):
        try:
            x = ds.read(i)
        except DlstoreError:
            out.append("error")
            continue
        out.append("old" if torch.equal(x, old[i]) else "new" if torch.equal(x, new[i]) else "other")
    return out


@pytest.fixture(scope="module")
def references(folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("refs")
    refs = {}
    for name in NAMES:
        dlstore.convert(folder, root / ("old-" + name), static=OLD, **OPTIONS)
        dlstore.convert(folder, root / ("new-" + name), static=NEW, **OPTIONS)
        refs[name] = (_pixels(root / ("old-" + name)), _pixels(root / ("new-" + name)))
        assert not any(torch.equal(a, b) for a, b in zip(*refs[name]))   # every sample tells old from new
    return refs


@pytest.mark.parametrize("name", NAMES)
def test_readers_opened_before_an_overwrite_never_mix(folder, references, tmp_path, name):
    old, new = references[name]
    dst = tmp_path / name
    dlstore.convert(folder, dst, static=OLD, **OPTIONS)
    warm = dlstore.open_dataset(dst)
    assert warm.read(0).equal(old[0])           # data handles now open (shards: the first file only)
    cold = dlstore.open_dataset(dst)
    dlstore.convert(folder, dst, static=NEW, overwrite=True, **OPTIONS)

    seen = {"warm": _classify(warm, old, new), "cold": _classify(cold, old, new)}
    for reader, kinds in seen.items():
        assert "new" not in kinds and "other" not in kinds, (reader, kinds)
    if name != "s.shards":   # LMDB, HDF5: one data file, open since the first read: all of it stays readable
        assert seen["warm"] == ["old"] * len(old)
    else:                    # the file read before lives on; the others are gone with the old store
        assert seen["warm"] == ["old"] * 4 + ["error"] * 8
    assert seen["cold"] == ["error"] * len(old)  # nothing of the old store was open: a clear error
    with pytest.raises(StoreCorruptError, match="replaced .* open the store again"):
        cold.read(0)
    assert _classify(dlstore.open_dataset(dst), old, new) == ["new"] * len(new)


@pytest.mark.parametrize("name", ["s.lmdb", "s.h5"])
def test_dataloader_workers_forked_after_an_overwrite_raise(folder, references, tmp_path, name):
    """A worker reopens the store by path after its fork: the replaced store is an error there too."""
    old, _ = references[name]
    dst = tmp_path / name
    dlstore.convert(folder, dst, static=OLD, **OPTIONS)
    ds = dlstore.open_dataset(dst)
    assert ds.read(0).equal(old[0])
    dlstore.convert(folder, dst, static=NEW, overwrite=True, **OPTIONS)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="fork")
    with pytest.raises(StoreCorruptError, match="replaced"):
        list(loader)
    assert all(ds.read(i).equal(old[i]) for i in range(len(old)))   # the parent's handle still reads the old file


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_reads_while_another_process_overwrites(folder, references, tmp_path, name):
    """Real concurrency: a separate process converts with overwrite=True while this one reads in a loop."""
    old, new = references[name]
    dst = tmp_path / name
    dlstore.convert(folder, dst, static=OLD, **OPTIONS)
    warm = dlstore.open_dataset(dst)
    for i in range(len(old)):
        warm.read(i)                             # every data file open
    cold = dlstore.open_dataset(dst)
    script = (f"import dlstore; dlstore.convert({str(folder)!r}, {str(dst)!r}, static={NEW!r}, overwrite=True, "
              f"**{OPTIONS!r})")
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    counts = {"warm": {}, "cold": {}, "fresh": {}}
    rounds = 0
    end = None
    while end is None or time.monotonic() < end:
        if end is None and proc.poll() is not None:
            end = time.monotonic() + 0.5          # a few more rounds after the replacement
        for reader, ds in (("warm", warm), ("cold", cold)):
            for kind in _classify(ds, old, new):
                counts[reader][kind] = counts[reader].get(kind, 0) + 1
        try:                                     # a reader opened now: either whole store, never a mix
            kinds = set(_classify(dlstore.open_dataset(dst), old, new))
        except DlstoreError:                     # between the two renames, or a half-copied manifest
            kinds = {"error"}
        assert kinds in ({"old"}, {"new"}, {"error"}) or kinds <= {"old", "error"} or kinds <= {"new", "error"}, kinds
        for kind in kinds:
            counts["fresh"][kind] = counts["fresh"].get(kind, 0) + 1
        rounds += 1
    assert proc.returncode == 0, proc.stderr.read()
    assert counts["warm"] == {"old": rounds * len(old)}, counts   # every file was open: all old, always
    assert "new" not in counts["cold"] and "other" not in counts["cold"], counts
    assert _classify(dlstore.open_dataset(dst), old, new) == ["new"] * len(new)
    print(f"\n{name}: {rounds} rounds while converting: {counts}")
