"""Checkpoint rows (``PartialRows``) and writers resumed from them: same state, same store."""

from __future__ import annotations

import hashlib
import tempfile
from array import array
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlstore.errors import ArgumentError, StoreCorruptError
from dlstore.formats import get_format
from dlstore.formats.synced import PartialRows

int64s = st.integers(min_value=-(2 ** 63), max_value=2 ** 63 - 1)


def _on_disk(path: Path, width: int) -> np.ndarray:
    """The file as numpy reads it, independently of PartialRows."""
    return np.fromfile(path, dtype=np.int64).reshape(-1, width)


def _rows(values: array, rows: int, width: int) -> np.ndarray:
    return np.frombuffer(values, dtype=np.int64)[:rows * width].reshape(-1, width)


# --- PartialRows ------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(width=st.integers(1, 6), steps=st.lists(st.integers(0, 7), min_size=1, max_size=8),
       extra=st.integers(0, 5), back=st.integers(0, 8), data=st.data())
def test_checkpoints_append_exactly_the_new_rows_and_restore_cuts_the_rest(width, steps, extra, back, data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "labels.partial"
        rows = PartialRows(path, width)
        values = array("q")
        done = 0
        checkpoints = [0]
        for step in steps:  # rows added between two checkpoints (0: a checkpoint with nothing new)
            values.extend(data.draw(st.lists(int64s, min_size=step * width, max_size=step * width)))
            done += step
            rows.append(values, done)
            checkpoints.append(done)
            assert rows.saved == done
            np.testing.assert_array_equal(_on_disk(path, width), _rows(values, done, width))
        # rows written after the last checkpoint the resumed run must not see
        values.extend(data.draw(st.lists(int64s, min_size=extra * width, max_size=extra * width)))
        rows.append(values, done + extra)

        keep = checkpoints[max(0, len(checkpoints) - 1 - back)]
        again = PartialRows(path, width)
        restored = again.restore(keep)
        assert restored.typecode == "q" and restored.tolist() == values[:keep * width].tolist()
        assert again.saved == keep
        np.testing.assert_array_equal(_on_disk(path, width), _rows(values, keep, width))
        # and the resumed run appends after them
        restored.extend(values[keep * width:])
        again.append(restored, done + extra)
        np.testing.assert_array_equal(_on_disk(path, width), _rows(values, done + extra, width))


@settings(max_examples=40, deadline=None)
@given(width=st.integers(1, 6), saved=st.integers(1, 20), data=st.data())
def test_a_file_shorter_than_the_checkpoint_is_corrupt(width, saved, data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shapes.partial"
        PartialRows(path, width).append(array("q", range(saved * width)), saved)
        size = data.draw(st.integers(0, saved * width * 8 - 1))
        with open(path, "r+b") as f:
            f.truncate(size)
        with pytest.raises(StoreCorruptError) as caught:
            PartialRows(path, width).restore(saved)
        message = str(caught.value)
        assert str(path) in message
        assert f"holds {size // (width * 8)} rows" in message and f"counts {saved}" in message
        assert path.stat().st_size == size  # nothing cut from a file that is refused


def test_missing_file_is_empty_at_row_zero_and_corrupt_after(tmp_path):
    rows = PartialRows(tmp_path / "labels.partial", 1)
    assert rows.restore(0).tolist() == [] and (tmp_path / "labels.partial").stat().st_size == 0
    rows.remove()
    rows.remove()  # removing twice is fine
    with pytest.raises(StoreCorruptError, match="labels.partial: missing.*counts 3 rows"):
        rows.restore(3)


def test_append_refuses_rows_it_does_not_hold_or_already_saved(tmp_path):
    rows = PartialRows(tmp_path / "index.partial", 5)
    with pytest.raises(ArgumentError, match="index.partial"):
        rows.append(array("q", range(10)), 3)
    rows.append(array("q", range(10)), 2)
    with pytest.raises(ArgumentError):
        rows.append(array("q", range(10)), 1)


# --- writers resumed from a checkpoint ----------------------------------------------------------

FIXED = (3, 8, 8)


def _samples(shape: tuple[int, int, int] | None, n: int = 23) -> list[tuple[np.ndarray, int]]:
    out = []
    for i in range(n):
        s = shape or (3 if i % 3 else 1, 4 + i % 5, 5 + i % 3)
        out.append(((np.arange(int(np.prod(s))) * 7 + i * 31).astype(np.uint8).reshape(s), i % 4 - 1))
    return out


# small units so that a checkpoint comes every few samples
OPTIONS = {"shards": {"shard_size": 600}, "lmdb": {"batch_bytes": 500}, "hdf5": {"batch_bytes": 500}}
NAMES = {"shards": "s.shards", "lmdb": "s.lmdb", "hdf5": "s.h5"}
FORMATS = [(fmt, shape) for fmt in ("shards", "lmdb", "hdf5") for shape in (FIXED, None)]


def _writer(fmt: str, folder: Path, shape):
    folder.mkdir(exist_ok=True)
    return get_format(fmt).Writer(folder / NAMES[fmt], shape=shape, **OPTIONS[fmt])


def _comparable(value):
    """An attribute's value with what differs between two equal writers (folder, handles) taken out."""
    if isinstance(value, Path):
        return value.name
    if isinstance(value, PartialRows):
        return ("PartialRows", value.path.name, value.width, value.saved)
    if isinstance(value, type(hashlib.sha256())):
        return value.hexdigest()
    if isinstance(value, array):
        return value.tolist()
    if isinstance(value, np.ndarray):
        return (value.dtype, value.shape)  # a buffer whose bytes past the written count are garbage
    if isinstance(value, (list, tuple)):
        return [_comparable(v) for v in value]
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if value is None or isinstance(value, (int, str, float, bytes)):
        return value
    return type(value).__name__  # open handles: h5py datasets, lmdb environment


def _store_contents(fmt: str, path: Path) -> dict:
    """Every byte a store holds, as its own library reads it."""
    if fmt == "shards":
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    if fmt == "lmdb":
        import lmdb

        env = lmdb.open(str(path), readonly=True, lock=False)
        try:
            with env.begin() as txn:
                return dict(txn.cursor())
        finally:
            env.close()
    import h5py

    out = {}
    with h5py.File(path, "r") as f:
        out["attrs"] = dict(f.attrs)
        for name, ds in f.items():
            if name == "offsets":   # where the samples lie in this file, not what it holds
                assert (ds[()] == [f["images"].id.get_chunk_info(k).byte_offset for k in range(len(ds))]).all()
                continue
            data = ds[()]
            out[name] = (str(ds.dtype), ds.shape, ds.chunks, ds.compression,
                         [bytes(x) for x in data] if data.dtype == object else data.tobytes())
    return out


def _interrupt(fmt: str, folder: Path, shape, samples, *, units: int, lost: int):
    """Checkpoint at each completed unit (as a conversion does) until ``units`` of them, write
    ``lost`` samples more, and stop as a crash would; return the last checkpoint and its sample count."""
    writer = _writer(fmt, folder, shape)
    state, k, seen = None, 0, 0
    try:
        for i, (sample, label) in enumerate(samples):
            if seen == units and i >= k + lost:
                break
            if writer.add(sample, label) and seen < units:
                state, k, seen = writer.checkpoint(), i + 1, seen + 1
    finally:
        writer.close()
    assert seen == units, "too few samples for the checkpoints asked"
    return state, k


def _finish(writer) -> tuple[dict, dict]:
    try:
        layout = writer.finish()
        writer.write_manifest('{"test": "manifest"}')
    finally:
        writer.close()
    return layout, dict(writer.checksums)


@pytest.mark.parametrize("fmt, shape", FORMATS, ids=[f"{f}-{'fixed' if s else 'variable'}" for f, s in FORMATS])
@pytest.mark.parametrize("units, lost", [(1, 0), (2, 4), (3, 9)])
def test_resumed_writer_is_a_fresh_writer_and_finishes_the_same_store(tmp_path, fmt, shape, units, lost):
    samples = _samples(shape)
    state, k = _interrupt(fmt, tmp_path / "a", shape, samples, units=units, lost=lost)
    module = get_format(fmt)
    resumed = module.Writer.resume(tmp_path / "a" / NAMES[fmt], state, shape=shape, **OPTIONS[fmt])

    fresh = _writer(fmt, tmp_path / "b", shape)
    for sample, label in samples[:k]:
        if fresh.add(sample, label):
            fresh.checkpoint()
    # An LMDB writer keeps the samples committed past the checkpoint (``_committed`` counts them, and the
    # resumed run checks them rather than writing them again): otherwise a fresh writer at the checkpoint.
    kept = {"_committed"} if fmt == "lmdb" else set()
    try:
        assert set(vars(resumed)) == set(vars(fresh))
        assert {n: _comparable(v) for n, v in vars(resumed).items() if n not in kept} == \
               {n: _comparable(v) for n, v in vars(fresh).items() if n not in kept}
        if fmt == "lmdb":
            assert k <= resumed._committed <= k + lost
    finally:
        fresh.close()

    for sample, label in samples[k:]:
        resumed.add(sample, label)
    got = _finish(resumed)
    clean = _writer(fmt, tmp_path / "c", shape)
    for sample, label in samples:
        clean.add(sample, label)
    assert got == _finish(clean)
    assert _store_contents(fmt, tmp_path / "a" / NAMES[fmt]) == _store_contents(fmt, tmp_path / "c" / NAMES[fmt])
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [NAMES[fmt]]  # no .partial file left


@pytest.mark.parametrize("fmt, shape", FORMATS, ids=[f"{f}-{'fixed' if s else 'variable'}" for f, s in FORMATS])
def test_resume_with_a_truncated_labels_file_is_refused_and_releases_the_store(tmp_path, fmt, shape):
    state, k = _interrupt(fmt, tmp_path / "a", shape, _samples(shape), units=2, lost=0)
    store = tmp_path / "a" / NAMES[fmt]
    partial = store / "labels.partial" if fmt != "hdf5" else store.with_name(store.name + ".labels.partial")
    with open(partial, "r+b") as f:
        f.truncate(8 * k - 4)
    for _ in range(2):  # the store was closed on the way out: a second try meets the same error
        with pytest.raises(StoreCorruptError, match=f"{partial}: holds {k - 1} rows.*counts {k}"):
            get_format(fmt).Writer.resume(store, state, shape=shape, **OPTIONS[fmt])
