"""Per-sample CRC32 sums: ``open_dataset(path, check="sample")`` against real damage.

Every store kind (shards fixed and variable shape, LMDB, HDF5 fixed and variable
shape, JPEG/PNG-encoded records) is converted once; a case copies one, flips bytes
inside the stored records of some samples (every copy of those bytes in the data
file, so a stale LMDB page cannot hide a change), and reads every sample, one by one
and in batches, with ``check="sample"``. It must hold that:

* each damaged sample read raises StoreCorruptError naming the data file and the
  sample index, and no damaged pixels are ever returned;
* every undamaged sample reads back equal to the pristine store's.

The random cases run each in a process forked from a helper (LMDB and HDF5 are C
libraries: a crash or a hang must fail one case, not the test run).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from _helpers import ask, forked_helper

import dlstore
from dlstore.errors import StoreCorruptError, UsageError
from dlstore.sources.demo import make_image_folder

# 3x32x32 = 3072-byte records: LMDB keeps them in overflow pages, written once
STATIC = "resize=36,center_crop=32"
KINDS = {
    "fixed.shards": {"static": STATIC},
    "var.shards": {"static": "resize=32"},
    "fixed.lmdb": {"static": STATIC},
    "var.lmdb": {"static": "resize=32"},
    "fixed.h5": {"static": STATIC},
    "var.h5": {"static": "resize=32"},
    "jpeg.lmdb": {"static": STATIC, "encoding": "jpeg"},
    "png.h5": {"static": STATIC, "encoding": "png"},
    "jpeg.shards": {"static": STATIC, "encoding": "jpeg"},
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("sums")
    src = make_image_folder(root / "images", classes=2, per_class=5, size=(40, 48))
    for name, options in KINDS.items():
        dlstore.convert(src, root / name, workers=0, progress=False, shard_size=4 * 3 * 32 * 32, **options)
    return root


def _records(path: Path) -> list[bytes]:
    """The stored bytes of every sample (encoded stores: the JPEG/PNG file)."""
    reader = dlstore.open_dataset(path).reader
    reader = getattr(reader, "raw", reader)
    return [np.ascontiguousarray(reader.get(i)).tobytes() for i in range(len(reader))]


def _data_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if (path / "data.mdb").is_file():
        return [path / "data.mdb"]
    return sorted(p for p in path.iterdir() if p.name.startswith(("shard-", "data-")))


def damage(path: Path, records: list[bytes], samples: list[int], where: float, xor: int) -> dict[int, str]:
    """Flip bytes at fraction ``where`` of each sample's record, in every copy of it; return
    {sample: name of the data file changed}."""
    changed = {}
    for i in samples:
        record = records[i]
        for f in _data_files(path):
            data = bytearray(f.read_bytes())
            at = data.find(record)
            while at >= 0:
                data[at + int(where * len(record))] ^= xor
                changed[i] = f.name
                at = data.find(record, at + 1)
            f.write_bytes(bytes(data))
        assert i in changed, f"sample {i}'s bytes not found in {path}"
    return changed


def read_all(path: Path, pristine: Path) -> dict:
    """Read every sample of ``path`` with check="sample", alone and in batches; compare with ``pristine``."""
    ref = dlstore.open_dataset(pristine)
    ds = dlstore.open_dataset(path, check="sample")
    out = {"good": [], "errors": {}, "wrong": [], "batch_errors": [], "batch_wrong": 0}
    for i in range(len(ds)):
        try:
            x = ds.read(i)
        except StoreCorruptError as exc:
            out["errors"][i] = str(exc)
            continue
        if x.shape == ref.read(i).shape and bool((x == ref.read(i)).all()):
            out["good"].append(i)
        else:
            out["wrong"].append(i)
    for batch in (list(range(len(ds))), list(range(len(ds)))[::-1]):
        try:
            images, _ = ds.read_batch(batch)
        except StoreCorruptError as exc:
            out["batch_errors"].append(str(exc))
            continue
        images = list(images)
        out["batch_wrong"] += sum(not bool((x == ref.read(i)).all()) for x, i in zip(images, batch))
    return out


def _check(res: dict, changed: dict[int, str], count: int) -> None:
    damaged = sorted(changed)
    assert res["wrong"] == [] and res["batch_wrong"] == 0, ("damaged pixels returned as good", res)
    assert sorted(int(i) for i in res["errors"]) == damaged, res
    assert res["good"] == [i for i in range(count) if i not in changed], res
    for i, message in res["errors"].items():
        assert changed[int(i)] in message and f"sample {i} " in message, message
    if damaged:
        assert len(res["batch_errors"]) == 2, res
        for message in res["batch_errors"]:   # names damaged samples (all of a batch read at once), no others
            named = re.search(r"samples? ([\d, .]+?) (\(|fails?)", message)
            assert named and "CRC32" in message, message
            listed = {int(v) for v in re.findall(r"\d+", named.group(1))}
            assert listed and listed <= set(damaged), message


@pytest.mark.parametrize("name", list(KINDS))
def test_one_flipped_byte_fails_only_its_sample(pristine, tmp_path, name):
    work = tmp_path / name
    (shutil.copytree if (pristine / name).is_dir() else shutil.copy2)(pristine / name, work)
    records = _records(work)
    changed = damage(work, records, [3], 0.5, 0x01)
    _check(read_all(work, pristine / name), changed, len(records))
    if "encoding" not in KINDS[name]:   # the default trusts the files: it returns the changed pixels
        unchecked = dlstore.open_dataset(work).read(3)
        assert not bool((unchecked == dlstore.open_dataset(pristine / name).read(3)).all())


@pytest.mark.parametrize("name", ["fixed.shards", "var.shards", "fixed.lmdb", "fixed.h5"])
def test_the_crc_error_names_the_verify_command_that_lists_the_damaged_samples(pristine, tmp_path, name):
    from click.testing import CliRunner

    from dlstore.cli import main

    work = tmp_path / name
    (shutil.copytree if (pristine / name).is_dir() else shutil.copy2)(pristine / name, work)
    damage(work, _records(work), [2, 7], 0.5, 0x10)
    with pytest.raises(StoreCorruptError, match="sample 7 ") as caught:
        dlstore.open_dataset(work, check="sample").read(7)
    assert "dlstore verify --deep on the store lists every damaged sample" in str(caught.value)

    def listed(*options: str) -> set[int]:
        result = CliRunner().invoke(main, ["verify", str(work), *options])
        assert result.exit_code == 1, result.output
        return {int(i) for i in re.findall(r"PROBLEM  sample (\d+): .*CRC32", result.output)}

    if name.endswith(".shards"):   # without --deep only the changed data file is named
        assert listed("--deep") == {2, 7} and listed() == set()
        return
    # LMDB, HDF5: the data file no longer matches its seal: not opened without --deep; --deep reads it
    # in a separate process (the library may crash on damaged pages) and lists every damaged sample
    assert listed("--deep") == {2, 7} and listed() == set()
    assert "differs from its seal" in CliRunner().invoke(main, ["verify", str(work)]).output
    if name.endswith(".lmdb"):   # a store without a seal is read: every damaged sample listed
        (work / "data.mdb.sha256").unlink()
        assert listed("--deep") == {2, 7}


@pytest.mark.parametrize("name", ["fixed.shards", "var.lmdb", "fixed.h5"])
def test_the_check_survives_pickling_into_a_worker(pristine, tmp_path, name):
    """DataLoader workers under spawn get the dataset pickled: the check and its messages go along."""
    import pickle

    work = tmp_path / name
    (shutil.copytree if (pristine / name).is_dir() else shutil.copy2)(pristine / name, work)
    ds = dlstore.open_dataset(work, check="sample")
    changed = damage(work, _records(work), [5], 0.25, 0x80)
    copy = pickle.loads(pickle.dumps(ds))
    with pytest.raises(StoreCorruptError, match=f"{changed[5]}: sample 5 fails its CRC32 check"):
        copy.read(5)
    assert copy.read(4).equal(dlstore.open_dataset(pristine / name).read(4))


@pytest.mark.parametrize("name", ["fixed.shards", "fixed.lmdb", "var.h5"])
def test_store_without_sums_says_which_check_works(pristine, tmp_path, name):
    work = tmp_path / name
    (shutil.copytree if (pristine / name).is_dir() else shutil.copy2)(pristine / name, work)
    manifest = dict(dlstore.open_dataset(work).manifest)
    del manifest["layout"]["sample_sums"]       # as a store converted before the sums existed
    if name.endswith(".shards"):                # ... and before its manifest had a seal
        del manifest["checksums"]["files"]["crc32.npy"]
        (work / "crc32.npy").unlink()
        (work / "manifest.json.sha256").unlink()
    text = json.dumps(manifest)
    if name.endswith(".shards"):
        (work / "manifest.json").write_text(text)
    elif name.endswith(".lmdb"):
        import lmdb
        with lmdb.open(str(work)) as env, env.begin(write=True) as txn:
            txn.put(b"__dlstore__", text.encode())
    else:
        import h5py
        with h5py.File(work, "r+") as f:
            f.attrs["dlstore"] = text
    with pytest.raises(UsageError, match="no(ne)? .*per-sample|per-sample CRC32 sums, and this store has none") as err:
        dlstore.open_dataset(work, check="sample")
    assert "check='open'" in str(err.value) and str(work) in str(err.value)
    assert len(dlstore.open_dataset(work)) == 10   # the default still opens it
    if name.endswith(".shards"):                   # and verify passes it, saying what it could not check
        report = dlstore.verify(work, deep=True)
        assert report.ok, str(report)
        assert "per-sample CRC32: none" in str(report) and "seal: none (manifest.json" in str(report)


def test_sums_are_recorded_in_the_manifest_and_cover_the_stored_bytes(pristine):
    import zlib
    for name in KINDS:
        ds = dlstore.open_dataset(pristine / name, check="sample")
        spec = ds.manifest["layout"]["sample_sums"]
        assert spec["algorithm"] == "crc32"
        sums = ds.reader.sums.sums if not hasattr(ds.reader, "raw") else ds.reader.raw.sums.sums
        assert sums.dtype == np.uint32 and sums.shape == (len(ds),)
        assert [zlib.crc32(r) for r in _records(pristine / name)] == sums.tolist()
        assert dlstore.verify(pristine / name, deep=True).ok


# --- random damage, one forked process per case -----------------------------------------------

# Run in the helper process (``_helpers.forked_helper``), one forked process per case.
HELPER = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from pathlib import Path
from test_sample_sums import read_all

def case(job):
    return read_all(Path(job["path"]), Path(job["pristine"]))
"""


@pytest.fixture(scope="module")
def helper():
    with forked_helper(HELPER) as proc:
        yield proc


@pytest.mark.slow
@pytest.mark.parametrize("name", list(KINDS))
def test_random_flips_in_records_are_caught_by_check_sample(pristine, helper, tmp_path_factory, name):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    records = _records(pristine / name)
    outcomes = []

    @settings(max_examples=12, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(samples=st.sets(st.integers(0, len(records) - 1), min_size=0, max_size=4),
           where=st.floats(0, 1, exclude_max=True), xor=st.integers(1, 255))
    def case(samples, where, xor):
        work = tmp_path_factory.mktemp("flipped") / name
        (shutil.copytree if (pristine / name).is_dir() else shutil.copy2)(pristine / name, work)
        changed = damage(work, records, sorted(samples), where, xor)
        res = ask(helper, {"path": str(work), "pristine": str(pristine / name)})
        assert res["status"] == "exit", res
        _check(res, changed, len(records))
        outcomes.append(len(changed))
        shutil.rmtree(work.parent)

    case()
    print(f"\n{name}: {len(outcomes)} cases, {sum(outcomes)} damaged samples, all raised StoreCorruptError")
