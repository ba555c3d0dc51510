"""Distributed conversion and reading with real gloo process groups of 2 processes on localhost.

Ranks are forked with ``torch.multiprocessing.start_processes`` (fork: no re-import,
fast) and report back through small files; one test goes through ``torchrun -m
dlstore convert``, the command users run.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.multiprocessing as tmp
from _helpers import free_port, rank_main

from dlstore import convert, loader, open_dataset, verify
from dlstore.conversion.distributed import hdf5_parts_path, part_ranges, work_path
from dlstore.errors import DistributedError

WORLD = 2
SUFFIX = {"shards": ".shards", "hdf5": ".h5", "lmdb": ".lmdb"}


def run_ranks(fn, *args, tmp_path: Path) -> list[dict]:
    """Run ``fn(rank, *args)`` on WORLD forked processes in one gloo group; each rank's result or error."""
    out = tmp_path / f"results-{fn.__name__}"
    out.mkdir(exist_ok=True)
    tmp.start_processes(rank_main, args=(WORLD, free_port(), str(out), fn, args), nprocs=WORLD, join=True,
                        start_method="fork")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _store_digest(path: Path) -> dict:
    """Labels and per-sample sha256 of a store, read through the public dataset."""
    ds = open_dataset(path)
    return {"labels": [int(x) for x in ds.targets],
            "samples": [hashlib.sha256(np.ascontiguousarray(ds.reader.get(i)).tobytes()).hexdigest()
                        for i in range(len(ds))]}


def _convert_all(rank: int, src: str, dst_dir: str, kwargs: dict) -> dict:
    results = {}
    for fmt, suffix in SUFFIX.items():
        r = convert(src, Path(dst_dir) / f"dist{suffix}", progress=False, workers=1, distributed=True, **kwargs)
        results[fmt] = {"count": r.count, "workers": r.workers}
    return results


@pytest.mark.parametrize("kind", ["fixed", "variable", "encoded"])
def test_distributed_conversion_equals_single_process(rgb_folder, varsize_folder, tmp_path, kind):
    variable = kind != "fixed"  # encoded records (PNG bytes) vary in length
    src = varsize_folder if kind == "variable" else rgb_folder
    kwargs = {"static": "" if kind == "variable" else "resize=20,center_crop=16", "shard_size": 3000}
    if kind == "encoded":
        kwargs["encoding"] = "png"
    results = run_ranks(_convert_all, str(src), str(tmp_path), kwargs, tmp_path=tmp_path)
    for rank, result in enumerate(results):
        assert "ok" in result, result.get("trace")
    n = len(list(Path(src).rglob("*.jpg")))
    for fmt, suffix in SUFFIX.items():
        assert results[0]["ok"][fmt]["count"] == results[1]["ok"][fmt]["count"] == n
        dist_store, single = tmp_path / f"dist{suffix}", tmp_path / f"single{suffix}"
        convert(src, single, progress=False, workers=0, **kwargs)
        assert _store_digest(dist_store) == _store_digest(single), fmt
        report = verify(dist_store, deep=True)
        assert report.ok, str(report)
        m_dist, m_single = open_dataset(dist_store).manifest, open_dataset(single).manifest
        assert m_dist["count"] == m_single["count"] and m_dist["source"] == m_single["source"]
        if fmt != "shards":  # payload digests (samples, labels, shapes) are those of one process
            assert m_dist["checksums"] == m_single["checksums"], fmt
        assert not work_path(dist_store).exists()
    # shards: the ranks' files were renamed into one folder, listed in rank order
    names = [e["file"] for e in open_dataset(tmp_path / "dist.shards").manifest["layout"]
             ["files" if variable else "shards"]]
    assert names[0].startswith("rank00000-") and names[-1].startswith("rank00001-")
    # hdf5: plain h5py reads the virtual dataset over the per-rank files
    with h5py.File(tmp_path / "dist.h5", "r") as f, h5py.File(tmp_path / "single.h5", "r") as g:
        assert f["images"].is_virtual
        assert sorted(p.name for p in hdf5_parts_path(tmp_path / "dist.h5").iterdir()) == \
            ["part-00000.h5", "part-00001.h5"]
        if not variable:
            np.testing.assert_array_equal(f["images"][()], g["images"][()])
        np.testing.assert_array_equal(f["labels"][()], g["labels"][()])


def test_distributed_segmentation_conversion_equals_single_process(tmp_path):
    """Image and mask pairs: each rank's records hold both, assembled into the store one process writes."""
    from dlstore.sources.demo import make_segmentation_folder

    seg = make_segmentation_folder(tmp_path / "seg", count=14, size=(30, 40))
    kwargs = {"static": "resize=20,center_crop=16", "shard_size": 3000, "masks": str(seg / "masks")}
    results = run_ranks(_convert_all, str(seg / "images"), str(tmp_path), kwargs, tmp_path=tmp_path)
    for result in results:
        assert "ok" in result, result.get("trace")
    for fmt, suffix in SUFFIX.items():
        dist_store, single = tmp_path / f"dist{suffix}", tmp_path / f"single{suffix}"
        convert(seg / "images", single, progress=False, workers=0, **kwargs)
        assert _store_digest(dist_store) == _store_digest(single), fmt
        assert verify(dist_store, deep=True).ok
        ds = open_dataset(dist_store)
        assert ds.fields is not None and ds.manifest["fields"] == open_dataset(single).manifest["fields"]
        assert ds.read(13)[1].shape == (16, 16)


def _convert_one(rank: int, src: str, dst: str, kwargs: dict) -> dict:
    r = convert(src, dst, progress=False, workers=1, distributed=True, **kwargs)
    return {"count": r.count, "skipped": r.skipped}


@pytest.fixture
def broken_folder(rgb_folder, tmp_path) -> tuple[Path, Path]:
    """A copy of rgb_folder with one corrupt JPEG in the last class: in rank 1's range."""
    src = tmp_path / "images"
    shutil.copytree(rgb_folder, src)
    bad = sorted((src / "class_02").iterdir())[3]
    bad.write_bytes(bad.read_bytes()[:200])
    n = len(list(src.rglob("*.jpg")))
    position = sorted(str(p) for p in src.rglob("*.jpg")).index(str(bad))
    assert part_ranges(n, WORLD)[1][0] <= position
    return src, bad


@pytest.mark.parametrize("fmt", ["shards", "hdf5"])
def test_failing_rank_stops_every_rank_and_leaves_no_store(broken_folder, tmp_path, fmt):
    src, bad = broken_folder
    dst = tmp_path / f"out{SUFFIX[fmt]}"
    results = run_ranks(_convert_one, str(src), str(dst), {"static": "center_crop=16", "on_error": "fail"},
                        tmp_path=tmp_path)
    assert results[1]["error"] == "DecodeError" and bad.name in results[1]["message"]
    assert results[0]["error"] == "DistributedError"
    assert "rank 1" in results[0]["message"] and bad.name in results[0]["message"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images", "results-_convert_one"]


def test_skipped_files_are_recorded_like_a_single_process_conversion(broken_folder, tmp_path):
    src, bad = broken_folder
    kwargs = {"static": "center_crop=16", "on_error": "skip"}
    results = run_ranks(_convert_one, str(src), str(tmp_path / "out.lmdb"), kwargs, tmp_path=tmp_path)
    assert all("ok" in r for r in results), results
    assert results[0]["ok"]["skipped"] == [{"path": f"class_02/{bad.name}", "reason": results[0]["ok"]
                                            ["skipped"][0]["reason"]}]
    convert(src, tmp_path / "single.lmdb", progress=False, workers=0, **kwargs)
    single, multi = open_dataset(tmp_path / "single.lmdb").manifest, open_dataset(tmp_path / "out.lmdb").manifest
    assert multi["source"] == single["source"] and multi["checksums"] == single["checksums"]


def test_rank_zero_failure_before_the_split_reaches_every_rank(rgb_folder, tmp_path):
    dst = tmp_path / "exists.shards"
    dst.mkdir()
    (dst / "notes.txt").write_text("not empty")   # (an empty folder would be taken)
    results = run_ranks(_convert_one, str(rgb_folder), str(dst), {}, tmp_path=tmp_path)
    assert results[0]["error"] == "StoreExistsError"
    assert results[1]["error"] == "DistributedError" and "already exists" in results[1]["message"]


@pytest.mark.parametrize("fmt", list(SUFFIX))
def test_distributed_overwrite_of_a_folder_that_is_not_a_store_is_refused_on_every_rank(rgb_folder, tmp_path, fmt):
    dst = tmp_path / f"mine{SUFFIX[fmt]}"
    dst.mkdir()
    (dst / "notes.txt").write_text("precious")
    before = sorted(p.name for p in tmp_path.iterdir())
    results = run_ranks(_convert_one, str(rgb_folder), str(dst), {"overwrite": True, "store_format": fmt},
                        tmp_path=tmp_path)
    assert results[0]["error"] == "NotAStoreError" and "notes.txt" in results[0]["message"]
    assert results[1]["error"] == "DistributedError" and "notes.txt" in results[1]["message"]
    assert (dst / "notes.txt").read_text() == "precious" and os.listdir(dst) == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("results-")) == before


@pytest.mark.slow
def test_torchrun_cli_converts_with_two_ranks(rgb_folder, tmp_path):
    dst = tmp_path / "cli.shards"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "dlstore", "convert", str(rgb_folder), str(dst), "--static", "center_crop=16",
           "--workers", "1", "--quiet"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("wrote ") == 1  # rank 0 prints the summary
    convert(rgb_folder, tmp_path / "single.shards", static="center_crop=16", progress=False, workers=0)
    assert _store_digest(dst) == _store_digest(tmp_path / "single.shards")
    assert verify(dst).ok


# --- distributed reading -----------------------------------------------------------------------

def _read_epochs(rank: int, store: str, batch_size: int, drop_last: bool) -> dict:
    ds = open_dataset(store)
    lookup = {hashlib.sha256(np.ascontiguousarray(ds.reader.get(i)).tobytes()).hexdigest(): i
              for i in range(len(ds))}
    dl = loader(ds, batch_size, shuffle=True, num_workers=1, distributed=True, drop_last=drop_last, seed=3)
    epochs = []
    for epoch in range(2):
        dl.sampler.set_epoch(epoch)
        order, batches = [], 0
        for images, labels in dl:
            batches += 1
            for image, label in zip(images, labels):
                i = lookup[hashlib.sha256(image.numpy().tobytes()).hexdigest()]
                assert int(label) == ds.targets[i]
                order.append(i)
        epochs.append({"order": order, "batches": batches, "len": len(dl)})
    # plain torch: open_dataset stores work with DistributedSampler and a worker process
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    plain = DataLoader(ds, batch_size=batch_size, sampler=DistributedSampler(ds, shuffle=False), num_workers=1)
    seen = [int(label) for _, labels in plain for label in labels]
    return {"epochs": epochs, "plain_labels": seen}


@pytest.mark.parametrize("drop_last", [False, True])
def test_distributed_loader_gives_every_rank_the_same_batch_count(rgb_folder, tmp_path, drop_last):
    src = tmp_path / "images"
    shutil.copytree(rgb_folder, src)
    next((src / "class_01").iterdir()).unlink()  # 23 samples: 2 ranks get 12 (padded) or 11 (trimmed)
    store = tmp_path / "s.shards"
    convert(src, store, static="center_crop=16", progress=False, workers=0)
    n = len(open_dataset(store))
    results = run_ranks(_read_epochs, str(store), 5, drop_last, tmp_path=tmp_path)
    assert all("ok" in r for r in results), [r.get("trace") for r in results]
    per_rank = n // WORLD if drop_last else -(-n // WORLD)
    expected_batches = per_rank // 5 if drop_last else -(-per_rank // 5)
    for epoch in range(2):
        orders = [r["ok"]["epochs"][epoch]["order"] for r in results]
        for r, order in zip(results, orders):
            assert r["ok"]["epochs"][epoch]["batches"] == r["ok"]["epochs"][epoch]["len"] == expected_batches
            assert len(order) == (expected_batches * 5 if drop_last else per_rank)
        if drop_last:
            assert not set(orders[0]) & set(orders[1])  # disjoint shares
        else:
            assert set(orders[0]) | set(orders[1]) == set(range(n))  # everything, one sample repeated
    for r in results:  # set_epoch reshuffles
        assert r["ok"]["epochs"][0]["order"] != r["ok"]["epochs"][1]["order"]
    labels = [int(x) for x in open_dataset(store).targets]
    plain = results[0]["ok"]["plain_labels"] + results[1]["ok"]["plain_labels"]
    assert sorted(set(plain)) == sorted(set(labels)) and len(plain) == 2 * -(-n // WORLD)


def test_distributed_loader_needs_a_process_group(rgb_folder, tmp_path):
    store = tmp_path / "s.shards"
    convert(rgb_folder, store, static="center_crop=16", progress=False, workers=0)
    with pytest.raises(ValueError, match="process group"):
        loader(open_dataset(store), 4, distributed=True)


# --- the compact file list the ranks receive ------------------------------------------------------

def test_scanned_samples_are_compact_and_behave_like_a_list(rgb_folder):
    import pickle

    from torchvision.datasets import ImageFolder

    from dlstore.sources import scan

    samples = scan(rgb_folder).samples
    reference = [(os.path.normpath(p), y) for p, y in ImageFolder(str(rgb_folder)).samples]
    as_list = [(os.path.normpath(p), y) for p, y in samples]
    assert as_list == reference
    assert samples[-1] == samples[len(samples) - 1] and samples[0][0] == as_list[0][0]
    with pytest.raises(IndexError):
        samples[len(samples)]
    a, b = part_ranges(len(samples), 3)[1]
    part = samples[a:b]
    assert list(part) == list(samples)[a:b] and list(samples[::5]) == list(samples)[::5]
    # a rank's slice pickles its own paths only, not the whole folder's
    assert len(pickle.dumps(part)) < len(pickle.dumps(samples))
    assert pickle.loads(pickle.dumps(part)) == part


def test_a_rank_with_no_files_still_takes_part(tmp_path):
    from dlstore.sources.demo import make_image_folder

    src = make_image_folder(tmp_path / "one", classes=1, per_class=1, size=(20, 20))  # rank 0's range is empty
    results = run_ranks(_convert_all, str(src), str(tmp_path), {"static": "center_crop=16"}, tmp_path=tmp_path)
    assert all("ok" in r for r in results), [r.get("trace") for r in results]
    for fmt, suffix in SUFFIX.items():
        convert(src, tmp_path / f"single{suffix}", static="center_crop=16", progress=False, workers=0)
        assert _store_digest(tmp_path / f"dist{suffix}") == _store_digest(tmp_path / f"single{suffix}"), fmt
        assert verify(tmp_path / f"dist{suffix}").ok


def test_ranks_stop_converting_when_another_rank_has_failed(tmp_path):
    """The failure marker another rank drops in the shared work folder stops this rank within 256 files."""
    import io

    from PIL import Image

    from dlstore import formats
    from dlstore.conversion.job import Job, feed_writer, finish_writer
    from dlstore.conversion.parts import convert_part
    from dlstore.conversion.ranks import mark_failed
    from dlstore.sources import scan
    from dlstore.sources.demo import synthetic_image
    from dlstore.transforms import parse_static

    buf = io.BytesIO()
    Image.fromarray(synthetic_image(0, 0, (8, 8))).save(buf, format="PNG")
    (tmp_path / "src" / "c").mkdir(parents=True)
    for i in range(300):
        (tmp_path / "src" / "c" / f"{i:04d}.png").write_bytes(buf.getvalue())
    job = Job(source=scan(tmp_path / "src"), spec=parse_static(""), shape=None,
               store_format=formats.get_format("shards"), decode={}, workers=0, on_error="fail", options={})
    work = tmp_path / "work"
    work.mkdir()
    count, _, _ = convert_part(job, work / "part-00000.shards", 0, 300, work, 0, 2, False, "x",
                               feed_writer, finish_writer)
    assert count == 300  # no marker: the whole range
    mark_failed(work, 1)
    with pytest.raises(DistributedError, match="rank 1 failed; rank 0 stopped"):
        convert_part(job, work / "part-00000b.shards", 0, 300, work, 0, 2, False, "x", feed_writer, finish_writer)
    assert not (work / "part-00000b.shards" / "manifest.json").exists()  # stopped mid-range, not at the end


def test_hdf5_store_without_its_parts_folder_is_refused(rgb_folder, tmp_path):
    results = run_ranks(_convert_one, str(rgb_folder), str(tmp_path / "s.h5"), {"static": "center_crop=16"},
                        tmp_path=tmp_path)
    assert all("ok" in r for r in results), results
    open_dataset(tmp_path / "s.h5")
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.move(tmp_path / "s.h5", moved / "s.h5")  # the parts folder stays behind
    from dlstore.errors import StoreCorruptError

    with pytest.raises(StoreCorruptError, match="s.h5.parts"):
        open_dataset(moved / "s.h5")
    shutil.move(tmp_path / "s.h5.parts", moved / "s.h5.parts")
    assert len(open_dataset(moved / "s.h5")) == 24 and verify(moved / "s.h5").ok


def test_open_hdf5_reader_keeps_reading_its_parts_after_they_are_removed(rgb_folder, tmp_path):
    """HDF5 reads a virtual dataset's missing source as zeros, silently. A reader that has read one
    sample holds every part open: removing the parts folder (an overwrite deletes the old one)
    leaves it reading the old pixels of every part, never zeros."""
    results = run_ranks(_convert_one, str(rgb_folder), str(tmp_path / "s.h5"), {"static": "center_crop=16"},
                        tmp_path=tmp_path)
    assert all("ok" in r for r in results), results
    expected = open_dataset(tmp_path / "s.h5").read_batch(range(24))[0].clone()
    assert expected.flatten(1).amax(1).min() > 0   # no sample is all zeros: a zero read would show
    ds = open_dataset(tmp_path / "s.h5")
    assert torch.equal(ds.read(0), expected[0])    # warm: rank 0's part read, rank 1's not yet
    shutil.rmtree(tmp_path / "s.h5.parts")
    got = torch.stack([ds.read(i) for i in range(24)])
    assert torch.equal(got, expected)


def test_plain_h5py_reads_a_distributed_hdf5_store_beside_an_open_dataset(rgb_folder, tmp_path):
    """HDF5 opens a virtual dataset's parts with the main file's locking flags, and dlstore opens
    each part again by name to check it: every one of those opens must match a user's h5py handles."""
    results = run_ranks(_convert_one, str(rgb_folder), str(tmp_path / "s.h5"), {"static": "center_crop=16"},
                        tmp_path=tmp_path)
    assert all("ok" in r for r in results), results
    ds = open_dataset(tmp_path / "s.h5")
    expected = ds.read_batch(range(24))[0].numpy()     # every part held open from here
    with h5py.File(tmp_path / "s.h5", "r") as f:
        np.testing.assert_array_equal(f["images"][()], expected)
    del ds   # (locking=False cannot open beside it: docs/robustness.md)
    gc.collect()
    for locking in (None, False):                      # h5py first, then a dataset
        with h5py.File(tmp_path / "s.h5", "r", locking=locking) as f:
            images = f["images"][()]                   # h5py holds the parts too
            np.testing.assert_array_equal(open_dataset(tmp_path / "s.h5").read_batch(range(24))[0].numpy(), images)
    assert verify(tmp_path / "s.h5").ok


def test_single_process_overwrite_of_a_distributed_hdf5_store_removes_its_parts(rgb_folder, tmp_path):
    results = run_ranks(_convert_one, str(rgb_folder), str(tmp_path / "s.h5"), {"static": "center_crop=16"},
                        tmp_path=tmp_path)
    assert all("ok" in r for r in results), results
    old = open_dataset(tmp_path / "s.h5")
    old_pixels = old.read_batch(range(24))[0].clone()
    convert(rgb_folder, tmp_path / "s.h5", static="center_crop=12", workers=0, progress=False, overwrite=True)
    assert not (tmp_path / "s.h5.parts").exists()
    assert open_dataset(tmp_path / "s.h5").read(0).shape[-1] == 12 and verify(tmp_path / "s.h5").ok
    # a reader of the old store that has read holds its parts open: still the old pixels, no zeros
    assert torch.equal(old.read_batch(range(24))[0], old_pixels)


# --- a reader between the two renames of a distributed HDF5 overwrite ------------------------------

@pytest.mark.parametrize("new", ["other-pixels", "shorter-parts", "one-sample-differs"])
def test_reader_opening_an_hdf5_store_mid_overwrite_never_mixes_two_stores(rgb_folder, tmp_path, monkeypatch, new):
    """An overwrite publishes the new ``DST.parts`` before the new ``DST``. A reader opening the old
    ``DST`` in between resolves its virtual dataset to the new parts (HDF5 maps sources by name):
    the old labels with the new pixels, silently (a shorter new part: the new pixels, then an HDF5
    error past its end). It must get a clear error instead (open again: the new store)."""
    from dlstore.conversion import assemble
    from dlstore.errors import StoreCorruptError
    from dlstore.sources.demo import make_image_folder

    dst = tmp_path / "s.h5"
    results = run_ranks(_convert_one, str(rgb_folder), str(dst), {"static": "center_crop=16"}, tmp_path=tmp_path)
    assert all("ok" in r for r in results), results
    # the new store: a distributed conversion of the same name elsewhere, published below as the
    # overwrite publishes it (its main file plays the staged one)
    other = tmp_path / "other"
    other.mkdir()
    src, static = rgb_folder, "resize=20,center_crop=16"   # same shape and count, other pixels
    if new == "shorter-parts":   # 6 samples per part where the old store has 12
        src, static = make_image_folder(tmp_path / "few", classes=3, per_class=4, size=(32, 40)), "center_crop=16"
    if new == "one-sample-differs":   # sample 3 only (rank 0's part): the other part is the old store's
        src = tmp_path / "changed"
        shutil.copytree(rgb_folder, src)
        shutil.copyfile(src / "class_02" / "img_0005.jpg", src / "class_00" / "img_0003.jpg")
        static = "center_crop=16"
    results = run_ranks(_convert_one, str(src), str(other / "s.h5"), {"static": static}, tmp_path=tmp_path)
    assert all("ok" in r for r in results), results
    old_pixels = open_dataset(dst).read_batch(range(24))[0].clone()
    new_pixels = open_dataset(other / "s.h5").read_batch(range(len(open_dataset(other / "s.h5"))))[0].clone()
    assert old_pixels.flatten(1).amax(1).min() > 0   # no sample is all zeros: a zero read would show
    # (no reader of the old store is open in this process: HDF5 would share its open parts with the next)
    seen: dict = {}

    def publish_after_a_reader(staged, target, overwrite):   # the real publish, a reader opening first
        try:
            seen["pixels"] = open_dataset(target).read_batch(range(24))[0].clone()
        except StoreCorruptError as exc:
            seen["error"] = str(exc)
        publish(staged, target, overwrite)

    publish = assemble.publish
    monkeypatch.setattr(assemble, "publish", publish_after_a_reader)
    assemble.publish_with_parts(other / "s.h5.parts", other / "s.h5", dst, True)
    if "pixels" in seen:   # (what the reader got, spelt out in the failure)
        got = seen["pixels"]
        foreign = sum(not torch.equal(got[i], old_pixels[i]) for i in range(24))
        new_ones = sum(torch.equal(got[i], new_pixels[i]) for i in range(min(24, len(new_pixels))))
        zeros = int((got.flatten(1).amax(1) == 0).sum())
        assert "pixels" not in seen, (f"the old store's reader read {foreign} of 24 samples that are not the old "
                                      f"store's ({new_ones} are the new store's, {zeros} all zeros), no error")
    assert "replaced" in seen["error"] and str(dst) in seen["error"], seen["error"]
    assert "part-00000.h5" in seen["error"] and "checksums differ" in seen["error"], seen["error"]
    # the store is whole again: a new reader reads the new store
    assert torch.equal(open_dataset(dst).read_batch(range(len(new_pixels)))[0], new_pixels)
    assert verify(dst, deep=True).ok


def test_hdf5_store_assembled_before_parts_had_checksums_still_reads(rgb_folder, tmp_path):
    """A main file whose manifest lists its parts without their checksums (dlstore before they were
    recorded) opens and reads as before."""
    dst = tmp_path / "s.h5"
    results = run_ranks(_convert_one, str(rgb_folder), str(dst), {"static": "center_crop=16"}, tmp_path=tmp_path)
    assert all("ok" in r for r in results), results
    expected = open_dataset(dst).read_batch(range(24))[0].clone()
    with h5py.File(dst, "r+") as f:
        manifest = json.loads(f.attrs["dlstore"])
        assert all(len(p["checksums"]["samples"]) == 64 for p in manifest["layout"]["virtual"]["parts"])
        for part in manifest["layout"]["virtual"]["parts"]:
            del part["checksums"]
        f.attrs["dlstore"] = json.dumps(manifest)
    assert torch.equal(open_dataset(dst).read_batch(range(24))[0], expected)
    assert verify(dst, deep=True).ok
