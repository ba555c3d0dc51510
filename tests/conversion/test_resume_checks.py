"""A resumed conversion trusts nothing it did not check: the files an interrupted run already converted
must be the ones it converted (size, mtime, a hash of their first and last 64 KiB), or it refuses,
listing them.

The interruption is a real KeyboardInterrupt (Ctrl-C) raised while a file is opened, after some
checkpoints; the changes are real file edits. The reference for a resume that goes on is a
conversion of the folder as it is at the resume, from scratch.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

import dlstore
import dlstore.sources.folder as folder_source
from dlstore.cli import main
from dlstore.errors import SourceChangedError
from dlstore.sources.demo import make_image_folder, synthetic_image

SUFFIX = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}
UNIT = {"shards": "shard_size", "lmdb": "batch_bytes", "hdf5": "batch_bytes"}
STATIC = "resize=20,center_crop=16"
OPTIONS = {"static": STATIC, "workers": 0, "progress": False}
STOP_AT = 30          # the file whose opening is interrupted (in sorted order): 24 converted before it


@pytest.fixture
def src(tmp_path):
    return make_image_folder(tmp_path / "images", classes=2, per_class=24, size=(24, 30))


def files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.jpg"))


def interrupted(src: Path, dst: Path, fmt: str, monkeypatch, at: int = STOP_AT) -> None:
    """Convert ``src`` to ``dst`` and press Ctrl-C while file ``at`` is loaded: a partial kept (files are
    decoded 8 at a time, so 24 are converted, up to the last checkpoint, every 4 samples)."""
    stop = str(files(src)[at])
    loader = folder_source.pil_loader

    def load_or_stop(path, *args, **kwargs):
        if str(path) == stop:
            raise KeyboardInterrupt
        return loader(path, *args, **kwargs)

    monkeypatch.setattr(folder_source, "pil_loader", load_or_stop)
    with pytest.raises(KeyboardInterrupt):
        dlstore.convert(src, dst, **{UNIT[fmt]: 4 * 16 * 16 * 3}, **OPTIONS)
    monkeypatch.setattr(folder_source, "pil_loader", loader)
    assert not dst.exists()


def replace_image(path: Path, seed: int, *, keep_size: bool = False, keep_mtime: bool = False) -> None:
    """Write another picture at ``path`` (a real JPEG), optionally of the same byte size and mtime."""
    st = path.stat()
    image = Image.fromarray(synthetic_image(1, seed, (24, 30)))
    image.save(path, quality=90)
    if keep_size:   # another picture, padded or cut to the old size (JPEG readers stop at the end marker)
        data = path.read_bytes()
        path.write_bytes(data[:st.st_size] if len(data) >= st.st_size else data + b"\0" * (st.st_size - len(data)))
        assert path.stat().st_size == st.st_size
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def store_bytes(path: Path) -> list[bytes]:
    ds = dlstore.open_dataset(path)
    return [np.ascontiguousarray(ds.reader.get(i)).tobytes() for i in range(len(ds))]


@pytest.mark.parametrize("fmt", list(SUFFIX))
def test_a_converted_file_that_changed_is_refused_by_name(src, tmp_path, monkeypatch, fmt):
    dst = tmp_path / f"s{SUFFIX[fmt]}"
    interrupted(src, dst, fmt, monkeypatch)
    first = files(src)[0]
    replace_image(first, seed=77)                        # size, mtime and content change
    kept = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SourceChangedError) as err:
        dlstore.convert(src, dst, resume=True, **{UNIT[fmt]: 4 * 16 * 16 * 3}, **OPTIONS)
    origin = str(first.relative_to(src))
    assert err.value.changed == [origin]
    message = str(err.value)
    assert message.splitlines()[0].startswith(f"{tmp_path / ('.s' + SUFFIX[fmt] + '.dlstore-tmp')}: 1 of the 24 ")
    assert f"  {origin}: size " in message and "content" in message and "rerun without --resume" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == kept      # the interrupted run's work is kept
    # without --resume: a fresh conversion of the folder as it is now
    dlstore.convert(src, dst, **{UNIT[fmt]: 4 * 16 * 16 * 3}, **OPTIONS)
    dlstore.convert(src, tmp_path / f"ref{SUFFIX[fmt]}", **{UNIT[fmt]: 4 * 16 * 16 * 3}, **OPTIONS)
    assert store_bytes(dst) == store_bytes(tmp_path / f"ref{SUFFIX[fmt]}")


@pytest.mark.parametrize("change, words", [
    ({"keep_size": True, "keep_mtime": True}, "content changed"),      # only the bytes: the hash
    ({"keep_size": True}, "content, modification time changed"),
])
def test_an_edit_that_keeps_the_size_is_seen(src, tmp_path, monkeypatch, change, words):
    dst = tmp_path / "s.shards"
    interrupted(src, dst, "shards", monkeypatch)
    edited = files(src)[5]
    replace_image(edited, seed=78, **change)
    with pytest.raises(SourceChangedError, match=f"{edited.relative_to(src)}: {words}"):
        dlstore.convert(src, dst, resume=True, shard_size=4 * 16 * 16 * 3, **OPTIONS)


def test_a_touched_file_is_refused_and_putting_the_original_back_resumes(src, tmp_path, monkeypatch):
    dst = tmp_path / "s.shards"
    interrupted(src, dst, "shards", monkeypatch)
    touched = files(src)[3]
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    with pytest.raises(SourceChangedError, match=f"{touched.relative_to(src)}: modification time changed"):
        dlstore.convert(src, dst, resume=True, shard_size=4 * 16 * 16 * 3, **OPTIONS)
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns))
    messages: list[str] = []
    dlstore.convert(src, dst, resume=True, shard_size=4 * 16 * 16 * 3, log=messages.append, **OPTIONS)
    assert any("resuming after 24 of 48 files" in m for m in messages), messages
    dlstore.convert(src, tmp_path / "ref.shards", shard_size=4 * 16 * 16 * 3, **OPTIONS)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == \
        {p.name: p.read_bytes() for p in (tmp_path / "ref.shards").iterdir()}


def test_a_file_not_converted_yet_may_change(src, tmp_path, monkeypatch):
    """Only what was converted is checked: a later file is converted as it is at the resume."""
    dst = tmp_path / "s.lmdb"
    interrupted(src, dst, "lmdb", monkeypatch)
    replace_image(files(src)[40], seed=79)
    dlstore.convert(src, dst, resume=True, batch_bytes=4 * 16 * 16 * 3, **OPTIONS)
    dlstore.convert(src, tmp_path / "ref.lmdb", batch_bytes=4 * 16 * 16 * 3, **OPTIONS)
    assert store_bytes(dst) == store_bytes(tmp_path / "ref.lmdb")


def test_a_missing_journal_starts_over(src, tmp_path, monkeypatch):
    dst = tmp_path / "s.shards"
    interrupted(src, dst, "shards", monkeypatch)
    journal = tmp_path / ".s.shards.dlstore-tmp" / "progress.json.sources"
    assert len(journal.read_text().splitlines()) == 24
    assert json.loads(journal.read_text().splitlines()[0])[0] == str(files(src)[0].relative_to(src))
    journal.unlink()
    replace_image(files(src)[0], seed=80)             # unseen without the journal: so the run starts over
    messages: list[str] = []
    dlstore.convert(src, dst, resume=True, shard_size=4 * 16 * 16 * 3, log=messages.append, **OPTIONS)
    assert any("cannot be checked; starting over" in m for m in messages), messages
    dlstore.convert(src, tmp_path / "ref.shards", shard_size=4 * 16 * 16 * 3, **OPTIONS)
    assert store_bytes(dst) == store_bytes(tmp_path / "ref.shards")


def test_the_command_line_prints_one_line_and_the_list(src, tmp_path, monkeypatch):
    dst = tmp_path / "s.shards"
    interrupted(src, dst, "shards", monkeypatch)
    changed = files(src)[:3]
    for k, path in enumerate(changed):
        replace_image(path, seed=90 + k)
    result = CliRunner().invoke(main, ["convert", str(src), str(dst), "--resume", "--workers", "0", "--quiet",
                                       "--static", STATIC, "--shard-size", str(4 * 16 * 16 * 3)])
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("error: ") and "3 of the 24 source file(s)" in lines[0]
    assert [line.split(":")[0].strip() for line in lines[1:]] == [str(p.relative_to(src)) for p in changed]
    assert "Traceback" not in result.output


# --- distributed: each rank checks the files of its part ------------------------------------

def _rank_convert(rank: int, src: str, dst: str, stop: str | None) -> dict:
    if stop is not None and rank == 1:
        loader = folder_source.pil_loader

        def stopping(path, *args, **kwargs):
            if str(path) == stop:
                raise KeyboardInterrupt
            return loader(path, *args, **kwargs)

        folder_source.pil_loader = stopping
    messages: list[str] = []
    try:
        dlstore.convert(src, dst, distributed=True, resume=stop is None, log=messages.append,
                        shard_size=4 * 16 * 16 * 3, **OPTIONS)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        return {"error": type(exc).__name__, "message": str(exc), "messages": messages}
    return {"messages": messages}


@pytest.mark.slow
def test_distributed_resume_refuses_a_changed_file_of_any_rank(src, tmp_path):
    from test_distributed_resume import run_ranks

    dst = tmp_path / "s.shards"
    all_files = files(src)
    results = run_ranks(_rank_convert, str(src), str(dst), str(all_files[24 + 10]), tmp_path=tmp_path)
    assert results[1]["error"] == "KeyboardInterrupt", results
    changed = all_files[24 + 2]        # converted by rank 1 before it stopped
    replace_image(changed, seed=81)
    work = tmp_path / ".s.shards.dlstore-dist"
    before = sorted(p.name for p in work.iterdir() if not p.name.startswith("FAILED"))
    results = run_ranks(_rank_convert, str(src), str(dst), None, tmp_path=tmp_path)
    assert results[1]["error"] == "SourceChangedError", results
    assert f"  {changed.relative_to(src)}: size" in results[1]["message"]
    assert results[0]["error"] == "DistributedError" and str(changed.relative_to(src)) in results[0]["message"]
    assert sorted(p.name for p in work.iterdir() if not p.name.startswith("FAILED")) == before   # kept
    shutil.rmtree(work)


def test_fileprint_covers_both_ends_of_a_large_file(tmp_path):
    from dlstore.conversion.journal import EDGE, fileprint

    path = tmp_path / "big.bin"
    data = bytearray(np.random.default_rng(0).integers(0, 256, 5 * EDGE, dtype=np.uint8).tobytes())
    path.write_bytes(bytes(data))
    st = path.stat()
    first = fileprint(path)
    assert first[:2] == [st.st_size, st.st_mtime_ns]
    for where, seen in [(10, True), (len(data) - 10, True), (2 * EDGE, False)]:   # the middle: only mtime shows
        changed = bytearray(data)
        changed[where] ^= 0xFF
        path.write_bytes(bytes(changed))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (fileprint(path) != first) is seen, where
    assert fileprint(tmp_path / "missing.jpg") is None


def test_resume_of_a_segmentation_store_checks_the_masks_too(tmp_path, monkeypatch):
    """Image and mask pairs: each converted pair's print covers both files, so a mask edited after it
    was converted is refused at the resume, and an unchanged folder resumes to the uninterrupted store."""
    import dlstore.sources.pairs as pair_source
    from dlstore.sources.demo import make_segmentation_folder

    seg = make_segmentation_folder(tmp_path / "seg", count=40, size=(24, 30), vary_size=False)
    masks = sorted((seg / "masks").glob("*.png"))
    stop, loader = str(masks[STOP_AT]), pair_source.load_mask

    def load_or_stop(path, *args, **kwargs):
        if str(path) == stop:
            raise KeyboardInterrupt
        return loader(path, *args, **kwargs)

    options = {**OPTIONS, "masks": seg / "masks", "shard_size": 4 * 16 * 16 * 4}
    dst = tmp_path / "seg.shards"
    monkeypatch.setattr(pair_source, "load_mask", load_or_stop)
    with pytest.raises(KeyboardInterrupt):
        dlstore.convert(seg / "images", dst, **options)
    monkeypatch.setattr(pair_source, "load_mask", loader)
    edited = masks[3]
    saved, stat = edited.read_bytes(), edited.stat()
    mask = np.array(Image.open(edited))
    mask[0, 0] = (int(mask[0, 0]) + 1) % 3
    Image.fromarray(mask, "P").save(edited)
    with pytest.raises(SourceChangedError, match="img_0003.jpg"):
        dlstore.convert(seg / "images", dst, resume=True, **options)
    edited.write_bytes(saved)   # the original back, its time too
    os.utime(edited, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    result = dlstore.convert(seg / "images", dst, resume=True, **options)
    assert result.resumed > 0
    whole = dlstore.convert(seg / "images", tmp_path / "whole.shards", **options)
    a, b = dlstore.open_dataset(dst), dlstore.open_dataset(whole.path)
    for i in range(len(a)):
        assert all(torch.equal(x, y) for x, y in zip(a.read(i), b.read(i)))
