"""Resuming an interrupted distributed conversion, and what an interrupted one leaves behind.

Real gloo groups of forked processes on localhost, as in test_distributed.py. A rank is
stopped deterministically by the dataset it converts: at one item of its own range it
raises KeyboardInterrupt (Ctrl-C, or the SIGTERM torchrun sends) or kills its process
with SIGKILL (a crash, an OOM kill). Items are decoded 64 at a time in the rank's own
process (workers=0), so the stop comes after checkpoints, not in a race with the end.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from _helpers import free_port, rank_main

from dlstore import convert, open_dataset, verify
from dlstore.conversion.distributed import hdf5_parts_path, work_path
from dlstore.conversion.lock import lock_path

SUFFIX = {"shards": ".shards", "hdf5": ".h5", "lmdb": ".lmdb"}
OPTIONS = {"shards": {"shard_size": 4 * 16 * 16 * 3}, "hdf5": {"batch_bytes": 4 * 16 * 16 * 3},
           "lmdb": {"batch_bytes": 4 * 16 * 16 * 3}}  # a checkpoint every 4 samples
STATIC = "resize=20,center_crop=16"
N = 300  # rank 0 converts items 0..149, rank 1 items 150..299


class Stopping(torch.utils.data.Dataset):
    """(image, label) pairs; item ``stop_at`` interrupts (``how="interrupt"``) or kills its process."""

    def __init__(self, n: int = N):
        rng = np.random.default_rng(5)
        self.images = rng.integers(0, 256, (n, 20, 20, 3), dtype=np.uint8)
        self.stop_at: int | None = None
        self.how = "interrupt"

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        if i == self.stop_at:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise KeyboardInterrupt
        return self.images[i], i % 3


def run_ranks(fn, *args, tmp_path: Path, world: int = 2) -> list[dict | None]:
    """Run ``fn(rank, *args)`` on ``world`` forked ranks; what each returned, or None where it was killed.

    Not ``torch.multiprocessing.start_processes``: it terminates every rank when one dies,
    and these tests kill one on purpose.
    """
    out = tmp_path / f"results-{len(list(tmp_path.glob('results-*')))}"
    out.mkdir()
    port = free_port()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=rank_main, args=(r, world, port, str(out), fn, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode is not None, "a rank hung"
    results = [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None
               for r in range(world)]
    for r in results:
        assert r is None or "ok" in r, r["trace"]
    return [None if r is None else r["ok"] for r in results]


def _converting(src, dst: str, kwargs: dict) -> dict:
    """``convert(src, dst)`` collectively: the count, or the error (KeyboardInterrupt included), with what it logged."""
    messages: list[str] = []
    try:
        r = convert(src, dst, progress=False, workers=0, distributed=True, log=messages.append, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt included: reported to the test
        return {"error": type(exc).__name__, "message": str(exc), "messages": messages}
    return {"count": r.count, "messages": messages}


def _convert_rank(rank: int, ds: Stopping, dst: str, kwargs: dict, stop: dict) -> dict:
    """Convert ``ds`` collectively; the result or the error, with what the conversion logged."""
    if rank == stop.get("rank"):
        ds.stop_at, ds.how = stop["at"], stop.get("how", "interrupt")
    return _converting(ds, dst, kwargs)


def _store(path: Path) -> dict:
    """Everything a reader sees: the manifest (checksums included), labels, provenance, every sample's bytes."""
    ds = open_dataset(path)
    return {"manifest": ds.manifest, "targets": list(ds.targets), "origins": list(ds.samples),
            "samples": [np.ascontiguousarray(ds.reader.get(i)).tobytes() for i in range(len(ds))]}


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _h5_content(path: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    with h5py.File(path, "r") as f:
        out.update((f"@{k}", v) for k, v in f.attrs.items())
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()].tobytes())
                     if isinstance(obj, h5py.Dataset) and obj.dtype.kind != "O" else None)
        out["images"] = [np.asarray(x).tobytes() for x in f["images"]]
        if "offsets" in f:   # where this file's chunks lie, not what it holds: right for this file
            chunks = [f["images"].id.get_chunk_info_by_coord((i, 0, 0, 0)).byte_offset for i in range(len(f["offsets"]))]
            out["offsets"] = bool((f["offsets"][()] == chunks).all())
    return out


def _leftovers(folder: Path, dst: Path) -> list[str]:
    """The paths in ``folder`` named after the store: the store and what its conversion left."""
    return sorted(p.name for p in folder.iterdir() if dst.name in p.name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted distributed and single-process stores of ``Stopping()``, per format."""
    folder = tmp_path_factory.mktemp("reference")
    (folder / "dist").mkdir()
    ds = Stopping()
    out = {}
    for fmt, suffix in SUFFIX.items():  # (the name of the store is in an HDF5 store's manifest: the same)
        dist_store = folder / "dist" / f"r{suffix}"
        results = run_ranks(_convert_rank, ds, str(dist_store), {"static": STATIC, **OPTIONS[fmt]}, {},
                            tmp_path=folder)
        assert all("count" in r for r in results), results
        convert(ds, folder / f"single{suffix}", static=STATIC, progress=False, workers=0, **OPTIONS[fmt])
        out[fmt] = (dist_store, folder / f"single{suffix}")
    return out


def _check_resumed(dst: Path, fmt: str, reference) -> None:
    dist_store, single = reference[fmt]
    assert _store(dst) == _store(dist_store)
    if fmt == "shards":  # byte for byte, every file
        assert _files(dst) == _files(dist_store)
    if fmt == "hdf5":  # every dataset and attribute of the parts (HDF5's own metadata differs: a
        for part in ("part-00000.h5", "part-00001.h5"):  # resumed file was reopened and resized)
            assert _h5_content(hdf5_parts_path(dst) / part) == _h5_content(hdf5_parts_path(dist_store) / part)
    resumed, one = _store(dst), _store(single)
    assert resumed["samples"] == one["samples"] and resumed["targets"] == one["targets"]
    assert resumed["manifest"]["source"] == one["manifest"]["source"]
    if fmt != "shards":
        assert resumed["manifest"]["checksums"] == one["manifest"]["checksums"]
    assert verify(dst, deep=True).ok


@pytest.mark.parametrize("fmt", list(SUFFIX))
@pytest.mark.parametrize("stop", [{"rank": 1, "at": 250}, {"rank": 0, "at": 100, "how": "kill"},
                                  {"rank": 1, "at": 250, "how": "kill"}],
                         ids=["rank1-interrupted", "rank0-killed", "rank1-killed"])
def test_interrupted_distributed_conversion_resumes_to_the_uninterrupted_store(tmp_path, reference, fmt, stop):
    dst = tmp_path / f"r{SUFFIX[fmt]}"
    kwargs = {"static": STATIC, **OPTIONS[fmt]}
    ds = Stopping()
    results = run_ranks(_convert_rank, ds, str(dst), kwargs, stop, tmp_path=tmp_path)
    stopped, other = results[stop["rank"]], results[1 - stop["rank"]]
    if stop.get("how") == "kill":
        assert stopped is None
        assert other["error"] == "DistributedError" and "lost contact" in other["message"]
    else:
        assert stopped["error"] == "KeyboardInterrupt"
        assert other["error"] == "DistributedError" and "rank 1" in other["message"]
    assert not dst.exists()
    work = work_path(dst)
    # only what --resume needs is left: the work folder, no staging (and the lock file of a killed rank 0) ...
    killed0 = stop["rank"] == 0 and stop.get("how") == "kill"
    assert _leftovers(tmp_path, dst) == sorted([work.name] + ([lock_path(dst).name] if killed0 else []))
    if not killed0:  # ... and rank 0, which holds the lock, says so
        assert [m for m in results[0]["messages"] if "kept in" in m] == \
            [f"partial conversion kept in {work}; run the same command with --resume on 2 ranks to continue"]
    states = {p.name: json.loads(p.read_text()) for p in work.glob("rank-*.json")}
    assert states[f"rank-{stop['rank']:05d}.json"]["source_pos"] == 64  # the first chunk, checkpointed
    assert states[f"rank-{1 - stop['rank']:05d}.json"]["done"] == 150  # the other rank finished its part

    results = run_ranks(_convert_rank, ds, str(dst), {**kwargs, "resume": True}, {}, tmp_path=tmp_path)
    assert [r.get("count") for r in results] == [N, N], results
    assert f"resuming the distributed conversion kept in {work}" in results[0]["messages"]
    messages = results[stop["rank"]]["messages"]
    if fmt == "hdf5" and stop.get("how") == "kill":  # HDF5 refuses a file its killed writer left open:
        assert any(m.startswith(f"rank {stop['rank']}: its part cannot be resumed (") and  # that part only
                   m.endswith("; converting it again") for m in messages), messages       # starts over
    else:
        assert f"rank {stop['rank']}: resuming after 64 of the 150 items of its part" in messages
    assert _leftovers(tmp_path, dst) == sorted([dst.name] + ([hdf5_parts_path(dst).name] if fmt == "hdf5" else []))
    _check_resumed(dst, fmt, reference)


def _interrupted(tmp_path: Path, fmt: str = "shards") -> tuple[Stopping, Path, dict]:
    """A conversion to ``r.*`` whose rank 1 was interrupted mid-part; (dataset, destination, options)."""
    ds, dst, kwargs = Stopping(), tmp_path / f"r{SUFFIX[fmt]}", {"static": STATIC, **OPTIONS[fmt]}
    results = run_ranks(_convert_rank, ds, str(dst), kwargs, {"rank": 1, "at": 250}, tmp_path=tmp_path)
    assert results[1]["error"] == "KeyboardInterrupt" and work_path(dst).is_dir()
    return ds, dst, kwargs


def test_resume_with_other_ranks_or_settings_is_refused_and_keeps_the_parts(tmp_path, reference):
    ds, dst, kwargs = _interrupted(tmp_path)
    work = work_path(dst)
    before = _files(work)
    results = run_ranks(_convert_rank, ds, str(dst), {**kwargs, "resume": True}, {}, tmp_path=tmp_path, world=3)
    assert results[0]["error"] == "ArgumentError"
    assert results[0]["message"] == (f"{work}: the interrupted conversion ran on 2 ranks, this one on 3; resume it "
                                     "on 2 ranks (torchrun --nproc-per-node 2), or rerun without --resume to "
                                     "start over")
    assert all(r["error"] == "DistributedError" and "ran on 2 ranks" in r["message"] for r in results[1:])
    changed = {**kwargs, "static": "resize=24,center_crop=16", "resume": True}
    results = run_ranks(_convert_rank, ds, str(dst), changed, {}, tmp_path=tmp_path)
    assert results[0]["error"] == "SourceError"
    assert results[0]["message"].startswith(f"{work}: the interrupted conversion used other settings or another "
                                            "source listing (static: ")
    assert "rerun with the original settings, or without --resume" in results[0]["message"]
    assert _files(work) == before  # refused: the interrupted run is intact, and still resumes
    results = run_ranks(_convert_rank, ds, str(dst), {**kwargs, "resume": True}, {}, tmp_path=tmp_path)
    assert [r.get("count") for r in results] == [N, N], results
    _check_resumed(dst, "shards", reference)


def test_resume_without_an_interrupted_run_converts_from_the_start(tmp_path, reference):
    dst = tmp_path / "r.lmdb"
    results = run_ranks(_convert_rank, Stopping(), str(dst), {"static": STATIC, **OPTIONS["lmdb"], "resume": True},
                        {}, tmp_path=tmp_path)
    assert [r.get("count") for r in results] == [N, N], results
    assert "nothing to resume (no interrupted distributed conversion found); starting over" in results[0]["messages"]
    _check_resumed(dst, "lmdb", reference)


def test_distributed_resume_of_a_single_process_conversion_is_refused(tmp_path):
    ds, dst = Stopping(), tmp_path / "r.h5"
    ds.stop_at = 250
    with pytest.raises(KeyboardInterrupt):
        convert(ds, dst, static=STATIC, progress=False, workers=0, **OPTIONS["hdf5"])
    staged = tmp_path / ".r.h5.dlstore-tmp"
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert staged.name in kept
    ds.stop_at = None
    results = run_ranks(_convert_rank, ds, str(dst), {"static": STATIC, **OPTIONS["hdf5"], "resume": True}, {},
                        tmp_path=tmp_path)
    assert results[0]["error"] == "ArgumentError"
    assert results[0]["message"] == (f"{staged}: the interrupted conversion ran in one process; resume it in one "
                                     "process (without torchrun, distributed=False), or rerun without --resume")
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("results-")) == kept


def test_a_rank_failing_on_its_input_leaves_nothing_to_resume(tmp_path):
    """A DecodeError is not an interruption: a resume would meet it again, so nothing is kept."""
    class Broken(Stopping):
        def __getitem__(self, i):
            if i == 250:
                raise OSError("record 250 is damaged")
            return super().__getitem__(i)

    dst = tmp_path / "r.shards"
    results = run_ranks(_convert_rank, Broken(), str(dst), {"static": STATIC, **OPTIONS["shards"]}, {},
                        tmp_path=tmp_path)
    assert results[1]["error"] == "DecodeError" and "250" in results[1]["message"]
    assert results[0]["error"] == "DistributedError"
    assert not any("kept in" in m for m in results[0]["messages"])
    assert _leftovers(tmp_path, dst) == []


# --- the parts folder of a distributed HDF5 store is the store's, and only the store's ------------------

def test_overwrite_never_replaces_a_parts_path_that_is_not_a_stores(tmp_path):
    dst = tmp_path / "r.h5"
    kwargs = {"static": STATIC, **OPTIONS["hdf5"]}
    parts = hdf5_parts_path(dst)
    parts.mkdir()
    (parts / "notes.txt").write_text("mine")
    for options in (kwargs, {**kwargs, "overwrite": True}):
        results = run_ranks(_convert_rank, Stopping(), str(dst), options, {}, tmp_path=tmp_path)
        assert results[0]["error"] == "StoreExistsError" and str(parts) in results[0]["message"]
        assert results[1]["error"] == "DistributedError"
        assert (parts / "notes.txt").read_text() == "mine" and not dst.exists()
    assert "is not the parts folder of a distributed HDF5 store (it holds notes.txt)" in results[0]["message"]
    assert _leftovers(tmp_path, dst) == [parts.name]
    (parts / "notes.txt").unlink()  # a store's own parts folder (even empty) is replaced by overwrite
    results = run_ranks(_convert_rank, Stopping(), str(dst), {**kwargs, "overwrite": True}, {}, tmp_path=tmp_path)
    assert [r.get("count") for r in results] == [N, N], results
    assert sorted(p.name for p in parts.iterdir()) == ["part-00000.h5", "part-00001.h5"]
    results = run_ranks(_convert_rank, Stopping(), str(dst), {**kwargs, "overwrite": True}, {}, tmp_path=tmp_path)
    assert [r.get("count") for r in results] == [N, N], results
    assert _leftovers(tmp_path, dst) == sorted([dst.name, parts.name]) and verify(dst, deep=True).ok


# --- a folder source: rank 0 scans it and sends each rank its file list ------------------------------

def _convert_folder_rank(rank: int, src: str, dst: str, kwargs: dict, stop_file: str | None) -> dict:
    """Convert the folder collectively; rank 1 is interrupted when it opens ``stop_file``."""
    if stop_file is not None and rank == 1:
        from PIL import Image

        opened = Image.open

        def stopping(fp, *args, **kw):
            if getattr(fp, "name", fp) == stop_file:
                raise KeyboardInterrupt
            return opened(fp, *args, **kw)

        Image.open = stopping
    return _converting(src, dst, kwargs)


@pytest.mark.parametrize("fmt", list(SUFFIX))
def test_interrupted_folder_conversion_resumes_to_the_uninterrupted_store(rgb_folder, tmp_path, fmt):
    files = sorted(str(p) for p in rgb_folder.rglob("*.jpg"))  # 24: rank 1 converts 12..23, 8 files a task
    kwargs = {"static": "center_crop=16", **OPTIONS[fmt], "shard_size": 2 * 16 * 16 * 3}
    if fmt != "shards":
        kwargs.pop("shard_size")
        kwargs["batch_bytes"] = 2 * 16 * 16 * 3
    dst = tmp_path / f"r{SUFFIX[fmt]}"
    results = run_ranks(_convert_folder_rank, str(rgb_folder), str(dst), kwargs, files[21], tmp_path=tmp_path)
    assert results[1]["error"] == "KeyboardInterrupt" and results[0]["error"] == "DistributedError", results
    assert json.loads((work_path(dst) / "rank-00001.json").read_text())["source_pos"] == 8
    results = run_ranks(_convert_folder_rank, str(rgb_folder), str(dst), {**kwargs, "resume": True}, None,
                        tmp_path=tmp_path)
    assert [r.get("count") for r in results] == [24, 24], results
    assert "rank 1: resuming after 8 of the 12 files of its part" in results[1]["messages"]
    (tmp_path / "clean").mkdir()
    clean = tmp_path / "clean" / dst.name
    results = run_ranks(_convert_folder_rank, str(rgb_folder), str(clean), kwargs, None, tmp_path=tmp_path)
    assert [r.get("count") for r in results] == [24, 24], results
    assert _store(dst) == _store(clean)
    if fmt == "shards":
        assert _files(dst) == _files(clean)
    convert(rgb_folder, tmp_path / f"single{SUFFIX[fmt]}", progress=False, workers=0, **kwargs)
    single = _store(tmp_path / f"single{SUFFIX[fmt]}")
    assert _store(dst)["samples"] == single["samples"] and _store(dst)["origins"] == single["origins"]
    assert verify(dst, deep=True).ok


def _convert_rank_merge_interrupted(rank: int, ds: Stopping, dst: str, kwargs: dict) -> dict:
    """Convert collectively; rank 0 is interrupted while it merges the LMDB parts (reading them back)."""
    if rank == 0:
        from dlstore.formats.lmdb import LmdbReader

        def interrupted(self, indices):
            raise KeyboardInterrupt

        LmdbReader.get_many = interrupted
    return _convert_rank(rank, ds, dst, kwargs, {})


@pytest.mark.slow
def test_lmdb_merge_interrupted_keeps_the_finished_parts(tmp_path, reference):
    """LMDB's merge copies the parts, so an interruption there keeps them: the resume only merges."""
    dst, kwargs = tmp_path / "r.lmdb", {"static": STATIC, **OPTIONS["lmdb"]}
    results = run_ranks(_convert_rank_merge_interrupted, Stopping(), str(dst), kwargs, tmp_path=tmp_path)
    assert results[0]["error"] == "KeyboardInterrupt" and results[1]["error"] == "DistributedError"
    assert any("partial conversion kept in" in m for m in results[0]["messages"])
    assert _leftovers(tmp_path, dst) == [work_path(dst).name]
    results = run_ranks(_convert_rank, Stopping(), str(dst), {**kwargs, "resume": True}, {}, tmp_path=tmp_path)
    assert [r.get("count") for r in results] == [N, N], results
    assert not any("resuming after" in m for r in results for m in r["messages"])  # both parts were done
    _check_resumed(dst, "lmdb", reference)


class StoppingVectors(Stopping):
    """The same items with a float32 target vector each (regression-style targets)."""

    def __getitem__(self, i):
        image, label = super().__getitem__(i)
        return image, np.array([label, i / 7.0, -1.0], dtype=np.float32)


@pytest.mark.parametrize("fmt", list(SUFFIX))
def test_interrupted_distributed_conversion_of_target_vectors_resumes(tmp_path, fmt):
    """Each rank keeps its target rows beside its checkpoint: the resumed store holds every row, in order."""
    dst = tmp_path / f"v{SUFFIX[fmt]}"
    kwargs = {"static": STATIC, **OPTIONS[fmt]}
    ds = StoppingVectors()
    results = run_ranks(_convert_rank, ds, str(dst), kwargs, {"rank": 1, "at": 250}, tmp_path=tmp_path)
    assert results[1]["error"] == "KeyboardInterrupt" and not dst.exists()
    assert (work_path(dst) / "rank-00001.targets").is_file()
    results = run_ranks(_convert_rank, ds, str(dst), {**kwargs, "resume": True}, {}, tmp_path=tmp_path)
    assert [r.get("count") for r in results] == [N, N], results
    assert "rank 1: resuming after 64 of the 150 items of its part" in results[1]["messages"]
    expected = np.stack([ds[i][1] for i in range(N)])
    one = convert(ds, tmp_path / f"one{SUFFIX[fmt]}", progress=False, workers=0, **kwargs)
    resumed, reference = open_dataset(dst), open_dataset(one.path)
    np.testing.assert_array_equal(resumed.targets, expected)
    assert resumed.targets.dtype == np.float32 and resumed.manifest["targets"] == reference.manifest["targets"]
    assert torch.equal(resumed.read_batch(range(N))[0], reference.read_batch(range(N))[0])
    assert verify(dst, deep=True).ok


# --- torchrun and the SIGTERM it forwards (SLURM's and Kubernetes' stop) -------------------------------

TORCHRUN_RANK = """
import os, sys, time
import PIL.Image
import dlstore.conversion

# Each rank holds at its first image after its first checkpoint until the gate file exists: the
# SIGTERM arrives mid-part on both ranks, not in a race with the end of the conversion.
work, gate, unit, size, *argv = sys.argv[1:]
state = os.path.join(work, f"rank-{int(os.environ['RANK']):05d}.json")
opened = PIL.Image.open
def gated(*args, **kwargs):
    while os.path.exists(state) and not os.path.exists(gate):
        time.sleep(0.01)
    return opened(*args, **kwargs)
PIL.Image.open = gated
convert = dlstore.conversion.convert      # the unit size the CLI has no option for (LMDB, HDF5)
dlstore.conversion.convert = lambda *args, **kwargs: convert(*args, **{**kwargs, unit: int(size)})
from dlstore.cli import main
main(argv, prog_name="dlstore")
"""


@pytest.fixture(scope="module")
def torchrun_folder(tmp_path_factory):
    from dlstore.sources.demo import make_image_folder

    return make_image_folder(tmp_path_factory.mktemp("torchrun") / "images", classes=3, per_class=40, size=(20, 20))


def _torchrun(script: Path, args: list[str], **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(script), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, **popen)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(SUFFIX))
def test_torchrun_cli_terminated_resumes_to_the_uninterrupted_store(torchrun_folder, tmp_path, fmt):
    """``torchrun ... dlstore convert``, SIGTERM to torchrun (which forwards it to the ranks), then
    ``--resume`` under torchrun: the store equals an uninterrupted distributed conversion."""
    dst, work, gate = tmp_path / f"r{SUFFIX[fmt]}", work_path(tmp_path / f"r{SUFFIX[fmt]}"), tmp_path / "gate"
    unit = "shard_size" if fmt == "shards" else "batch_bytes"
    script = tmp_path / "rank.py"
    script.write_text(TORCHRUN_RANK)
    args = [str(work), str(gate), unit, str(4 * 16 * 16 * 3), "convert", str(torchrun_folder), str(dst), "--static",
            "center_crop=16", "--workers", "1", "--quiet"]            # a checkpoint every 4 samples
    proc = _torchrun(script, args)
    end = time.monotonic() + 180
    while not all((work / f"rank-{r:05d}.json").exists() for r in range(2)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "the ranks did not reach their first checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, err
    assert err.count("interrupted: stopped the workers") == 2, err          # each rank unwound (the CLI's handler)
    assert f"partial conversion kept in {work}" in err, err
    assert not dst.exists()
    positions = [json.loads((work / f"rank-{r:05d}.json").read_text())["source_pos"] for r in range(2)]
    assert all(0 < p < 60 for p in positions), positions

    gate.touch()
    resumed = _torchrun(script, [*args, "--resume"])
    out, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err
    assert f"resuming the distributed conversion kept in {work}" in err, err
    for r, p in enumerate(positions):
        assert f"rank {r}: resuming after {p} of the 60 files of its part" in err, err
    assert out.count("wrote ") == 1

    (tmp_path / "clean").mkdir()
    clean = tmp_path / "clean" / dst.name
    kwargs = {"static": "center_crop=16", unit: 4 * 16 * 16 * 3}
    results = run_ranks(_convert_folder_rank, str(torchrun_folder), str(clean), kwargs, None, tmp_path=tmp_path)
    assert [r.get("count") for r in results] == [120, 120], results
    assert _store(dst) == _store(clean)
    if fmt == "shards":
        assert _files(dst) == _files(clean)
    assert verify(dst, deep=True).ok
