"""Target vectors (issue 15): (N, K) int64 / float32 targets, in every format, through every read path.

The reference is always the numpy array converted from; each store is read back
through dlstore and through the format's own library (numpy, h5py, lmdb).
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import h5py
import lmdb
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dlstore
from dlstore.cli import main
from dlstore.errors import SourceError, StoreCorruptError
from dlstore.tools.verification import verify

FORMATS = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}


def _images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 6, 5, 3), dtype=np.uint8)


def _native(path: Path, fmt: str) -> np.ndarray:
    """The targets as the format's own library reads them, without dlstore."""
    if fmt == "shards":
        return np.load(path / "targets.npy", allow_pickle=False)
    if fmt == "hdf5":
        with h5py.File(path, "r") as f:
            return f["targets"][()]
    env = lmdb.open(str(path), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return np.load(io.BytesIO(txn.get(b"__targets__")), allow_pickle=False)
    finally:
        env.close()


def _check_store(path: Path, fmt: str, expected: np.ndarray, images: np.ndarray | None = None) -> None:
    """Every way of reading the targets gives ``expected`` (dtype included)."""
    native = _native(path, fmt)
    assert native.dtype == expected.dtype and native.shape == expected.shape
    np.testing.assert_array_equal(native, expected)
    ds = dlstore.open_dataset(path)
    assert ds.classes == [] and ds.manifest["classes"] == []
    assert ds.manifest["targets"] == {"dtype": expected.dtype.name, "shape": [expected.shape[1]]}
    assert isinstance(ds.targets, np.ndarray) and ds.targets.dtype == expected.dtype
    np.testing.assert_array_equal(ds.targets, expected)
    for i in range(len(expected)):
        image, target = ds[i]
        assert isinstance(target, torch.Tensor) and target.shape == (expected.shape[1],)
        np.testing.assert_array_equal(target.numpy(), expected[i])
        if images is not None:
            np.testing.assert_array_equal(image.numpy(), images[i].transpose(2, 0, 1))
    order = list(range(len(expected)))[::-1]
    images_b, labels_b = ds.get_batch(order)
    assert labels_b.shape == (len(expected), expected.shape[1])
    assert labels_b.dtype == torch.from_numpy(expected).dtype
    np.testing.assert_array_equal(labels_b.numpy(), expected[order])
    _, labels_r = ds.read_batch(order)
    np.testing.assert_array_equal(labels_r.numpy(), expected[order])
    items = ds.__getitems__(order)
    np.testing.assert_array_equal(torch.stack([t for _, t in items]).numpy(), expected[order])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["bool", "int32", "int64", "float64", "float32"])
def test_array_targets_round_trip_in_every_format(tmp_path, fmt, dtype):
    rng = np.random.default_rng(1)
    images = _images(9)
    targets = (rng.integers(-50, 50, (9, 4)) if "int" in dtype else rng.random((9, 4)) * 10 - 5
               if "float" in dtype else rng.integers(0, 2, (9, 4))).astype(dtype)
    if "float" in dtype:
        targets[2, 1] = np.nan   # NaN is a value like any other in a float target
    dst = tmp_path / f"s{FORMATS[fmt]}"
    result = dlstore.convert((images, targets), dst, workers=0, progress=False)
    stored = targets.astype(np.float32 if "float" in dtype else np.int64)
    _check_store(dst, fmt, stored, images)
    assert result.classes == [] and "target vectors: 4 x" in str(result)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 12), k=st.integers(1, 6), fmt=st.sampled_from(list(FORMATS)),
       dtype=st.sampled_from(["bool", "uint8", "int16", "int64", "float16", "float32", "float64"]),
       seed=st.integers(0, 2**16))
def test_any_n_k_dtype_and_format_round_trips(n, k, fmt, dtype, seed):
    rng = np.random.default_rng(seed)
    if dtype.startswith("float"):
        targets = (rng.standard_normal((n, k)) * 1000).astype(dtype)
    else:
        info = np.iinfo(dtype) if dtype != "bool" else None
        targets = (rng.integers(0, 2, (n, k)).astype(bool) if info is None
                   else rng.integers(info.min, info.max, (n, k), endpoint=True, dtype=dtype))
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / f"s{FORMATS[fmt]}"
        dlstore.convert((_images(n, seed), targets), dst, workers=0, progress=False)
        _check_store(dst, fmt, targets.astype(np.float32 if dtype.startswith("float") else np.int64))


class VectorDataset(torch.utils.data.Dataset):
    """(image, target) pairs; ``kind`` says how the target vector is given."""

    def __init__(self, images, targets, kind="list", fail_at=None, bad=None):
        self.images, self.targets, self.kind, self.fail_at, self.bad = images, targets, kind, fail_at, bad or {}

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        if i == self.fail_at:
            raise KeyboardInterrupt("stop here")   # an interrupted conversion (not a bad item)
        target = self.bad.get(i, self.targets[i])
        if self.kind == "list" and isinstance(target, np.ndarray):
            target = target.tolist()
        elif self.kind == "tensor":
            target = torch.as_tensor(target)
        return self.images[i], target


@pytest.mark.parametrize("kind", ["list", "ndarray", "tensor"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dataset_targets_equal_array_targets_and_any_worker_count(tmp_path, kind, fmt):
    rng = np.random.default_rng(2)
    images = _images(40)
    for targets in (rng.integers(0, 2, (40, 5)), rng.random((40, 3)).astype(np.float32)):
        stored = targets.astype(np.int64 if targets.dtype.kind == "i" else np.float32)
        sums = []
        for workers in (0, 2):
            dst = tmp_path / f"w{workers}-{targets.dtype}{FORMATS[fmt]}"
            dlstore.convert(VectorDataset(images, targets, kind), dst, workers=workers, progress=False,
                            **({"shard_size": 600} if fmt == "shards" else {"batch_bytes": 600}))
            _check_store(dst, fmt, stored, images)
            sums.append(dlstore.open_dataset(dst).manifest["checksums"])
            if fmt == "shards":
                assert (dst / "targets.npy").read_bytes() == (tmp_path / f"w0-{targets.dtype}.shards"
                                                             / "targets.npy").read_bytes()
        assert sums[0] == sums[1]   # byte-identical whatever the number of workers


@pytest.mark.parametrize("bad, message", [
    ({3: [1, 0]}, "item 3"),                          # ragged: K=2 where item 0 has K=3
    ({5: [0.5, np.nan, 1.0]}, "item 5"),              # floats (NaN) among int vectors
    ({4: 7}, "item 4"),                               # an int label among vectors
])
def test_mixed_or_ragged_targets_are_a_source_error_naming_the_item(tmp_path, bad, message):
    targets = np.random.default_rng(3).integers(0, 2, (8, 3))
    ds = VectorDataset(_images(8), targets, "list", bad=bad)
    with pytest.raises(SourceError, match=message):
        dlstore.convert(ds, tmp_path / "s.shards", workers=0, progress=False)
    assert not (tmp_path / "s.shards").exists()


def test_a_vector_after_int_labels_is_a_source_error(tmp_path):
    ds = VectorDataset(_images(6), list(range(6)), "list", bad={2: [1, 2]})
    with pytest.raises(SourceError, match="item 2"):
        dlstore.convert(ds, tmp_path / "s.h5", workers=0, progress=False)


def test_array_targets_of_another_shape_are_refused(tmp_path):
    with pytest.raises(ValueError, match="target vectors"):
        dlstore.convert((_images(5), np.zeros((4, 2))), tmp_path / "s.shards", workers=0, progress=False)


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_gives_the_store_of_an_uninterrupted_run(tmp_path, fmt):
    rng = np.random.default_rng(4)
    images, targets = _images(200), rng.random((200, 3)).astype(np.float32)
    options = {"shard_size": 900} if fmt == "shards" else {"batch_bytes": 900}   # a unit per 10 samples
    dst = tmp_path / f"s{FORMATS[fmt]}"
    with pytest.raises(KeyboardInterrupt):
        dlstore.convert(VectorDataset(images, targets, "ndarray", fail_at=150), dst, workers=0, progress=False,
                        **options)
    assert not dst.exists()
    messages = []
    dlstore.convert(VectorDataset(images, targets, "ndarray"), dst, workers=0, progress=False, resume=True,
                    log=messages.append, **options)
    # items are decoded 64 at a time: the last unit written before item 150 ends at 120
    assert any("resuming after 120 of 200" in m for m in messages), messages
    clean = tmp_path / f"clean{FORMATS[fmt]}"
    dlstore.convert(VectorDataset(images, targets, "ndarray"), clean, workers=0, progress=False, **options)
    _check_store(dst, fmt, targets, images)
    assert dlstore.open_dataset(dst).manifest["checksums"] == dlstore.open_dataset(clean).manifest["checksums"]
    assert not any("progress" in p.name for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("header", [True, False])
def test_csv_list_of_several_numeric_columns(rgb_folder, tmp_path, header):
    files = sorted(p.relative_to(rgb_folder).as_posix() for p in rgb_folder.rglob("*.jpg"))[:7]
    rng = np.random.default_rng(5)
    for targets in (rng.integers(-3, 3, (7, 4)), np.round(rng.random((7, 2)) * 8, 3)):
        lines = (["path," + ",".join(f"t{k}" for k in range(targets.shape[1]))] if header else [])
        lines += [f"{f}," + ",".join(str(v) for v in row) for f, row in zip(files, targets.tolist())]
        listing = tmp_path / "list.csv"
        listing.write_text("\n".join(lines) + "\n")
        dst = tmp_path / f"s-{targets.dtype}.h5"
        dlstore.convert(listing, dst, root=rgb_folder, workers=0, progress=False, static="resize=8,center_crop=8")
        stored = targets.astype(np.int64 if targets.dtype.kind == "i" else np.float32)
        _check_store(dst, "hdf5", stored)
        ds = dlstore.open_dataset(dst)
        assert [p for p, _ in ds.samples] == [str(rgb_folder / f) for f in files]


def test_csv_list_with_a_ragged_or_non_numeric_row_names_the_line(rgb_folder, tmp_path):
    files = sorted(p.relative_to(rgb_folder).as_posix() for p in rgb_folder.rglob("*.jpg"))[:3]
    listing = tmp_path / "list.csv"
    listing.write_text(f"{files[0]},1,0,1\n{files[1]},1,0\n{files[2]},0,0,1\n")
    with pytest.raises(SourceError, match=r"list.csv:2: .* 2 target value"):
        dlstore.convert(listing, tmp_path / "s.shards", root=rgb_folder, workers=0, progress=False)
    listing.write_text(f"{files[0]},1,0,1\n{files[1]},1,x,0\n")
    with pytest.raises(SourceError, match=r"list.csv:2: .*'x', not a number"):
        dlstore.convert(listing, tmp_path / "s.shards", root=rgb_folder, workers=0, progress=False)


@pytest.mark.parametrize("fmt", FORMATS)
def test_changed_targets_are_caught_by_check_sample(tmp_path, fmt):
    targets = np.arange(24, dtype=np.int64).reshape(8, 3)
    dst = tmp_path / f"s{FORMATS[fmt]}"
    dlstore.convert((_images(8), targets), dst, workers=0, progress=False)
    dlstore.open_dataset(dst, check="sample")   # intact: opens
    changed = targets.copy()
    changed[5, 2] = 99
    if fmt == "shards":
        np.save(dst / "targets.npy", changed)
    elif fmt == "hdf5":
        with h5py.File(dst, "r+") as f:
            f["targets"][5, 2] = 99
    else:
        env = lmdb.open(str(dst), lock=False)
        with env.begin(write=True) as txn:
            buf = io.BytesIO()
            np.save(buf, changed)
            txn.put(b"__targets__", buf.getvalue())
        env.close()
    with pytest.raises(StoreCorruptError, match="targets"):
        dlstore.open_dataset(dst, check="sample")
    assert not verify(dst).ok


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_and_info_describe_a_store_of_targets(tmp_path, fmt):
    dst = tmp_path / f"s{FORMATS[fmt]}"
    dlstore.convert((_images(6), np.eye(6, 4, dtype=np.float32)), dst, workers=0, progress=False)
    report = verify(dst, deep=True)
    assert report.ok and any(line.startswith("targets: ") for line in report.checked), report.checked
    result = CliRunner().invoke(main, ["info", str(dst)])
    assert result.exit_code == 0, result.output
    assert "targets   6 x 4 float32" in result.output
    result = CliRunner().invoke(main, ["info", "--json", str(dst)])
    assert json.loads(result.output)["summary"]["targets"] == {"dtype": "float32", "shape": [4]}
    result = CliRunner().invoke(main, ["show", str(dst), "1"])
    assert result.exit_code == 0 and "[0.0, 1.0, 0.0, 0.0]" in result.output


@pytest.mark.parametrize("fmt", FORMATS)
def test_int_label_stores_keep_their_layout(tmp_path, fmt):
    dst = tmp_path / f"s{FORMATS[fmt]}"
    dlstore.convert((_images(6), np.arange(6) % 3), dst, workers=0, progress=False)
    ds = dlstore.open_dataset(dst)
    assert "targets" not in ds.manifest and not any("targets" in key for key in ds.manifest["layout"])
    assert "targets" not in ds.manifest["checksums"]["files"] and "targets.npy" not in ds.manifest["checksums"]["files"]
    assert ds.targets == [0, 1, 2, 0, 1, 2] and ds[4][1] == 1 and ds.classes == ["0", "1", "2"]
    assert ds.get_batch([0, 5])[1].tolist() == [0, 2]


@pytest.mark.parametrize("options", [{"backend": "threads", "num_threads": 2}, {"num_workers": 2}],
                         ids=["threads", "ring"])
def test_loaders_batch_target_vectors(tmp_path, options):
    targets = np.random.default_rng(6).random((20, 3)).astype(np.float32)
    dst = tmp_path / "s.shards"
    dlstore.convert((_images(20), targets), dst, workers=0, progress=False)
    ds = dlstore.open_dataset(dst)
    batches = list(dlstore.loader(ds, batch_size=8, **options))
    labels = torch.cat([labels for _, labels in batches])
    assert labels.dtype == torch.float32 and labels.shape == (20, 3)
    np.testing.assert_array_equal(labels.numpy(), targets)
    plain = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=options.get("num_workers", 0))
    np.testing.assert_array_equal(torch.cat([t for _, t in plain]).numpy(), targets)


def test_samples_slice_like_imagefolder(rgb_folder, tmp_path):
    from torchvision.datasets import ImageFolder

    dst = tmp_path / "s.shards"
    dlstore.convert(rgb_folder, dst, workers=0, progress=False)
    ds, reference = dlstore.open_dataset(dst), ImageFolder(str(rgb_folder)).samples
    n = len(reference)
    for key in (slice(2, 9), slice(None, 5), slice(-4, None), slice(1, n, 3), slice(20, 3, -2), slice(50, 60),
                slice(None)):
        assert ds.samples[key] == reference[key], key
        assert ds.imgs[key] == reference[key]
        assert ds.origins[key] == [str(Path(p).relative_to(rgb_folder)) for p, _ in reference[key]]
    for i in (0, 5, -1, -n):
        assert ds.samples[i] == reference[i]
    for i in (n, -n - 1):
        with pytest.raises(IndexError):
            ds.samples[i]
        with pytest.raises(IndexError):
            reference[i]
    with pytest.raises(TypeError):
        ds.samples["0"]


@pytest.mark.parametrize("hold", ["dtype", "uint8"])
def test_gpu_dataset_and_its_partitions_keep_float_target_vectors(tmp_path, hold):
    """GPUDataset and a rank's SubsetSource pass (N, K) float targets through, never cast to int64."""
    from dlstore.data.gpu.partition import SubsetSource

    targets = np.random.default_rng(3).normal(size=(12, 3)).astype(np.float32)
    dst = tmp_path / "s.shards"
    dlstore.convert((_images(12), targets), dst, workers=0, progress=False)
    ds = dlstore.open_dataset(dst)
    gpu = dlstore.GPUDataset(ds, device="cpu", hold=hold)
    assert gpu.labels.dtype == torch.float32 and gpu.labels.shape == (12, 3)
    np.testing.assert_array_equal(gpu[7][1].numpy(), targets[7])
    got = torch.cat([labels for _, labels in dlstore.loader(gpu, batch_size=5, shuffle=False)])
    np.testing.assert_array_equal(got.numpy(), targets)
    part = SubsetSource(ds, np.array([1, 4, 9]))
    assert part.targets.dtype == np.float32
    np.testing.assert_array_equal(part.targets, targets[[1, 4, 9]])


@pytest.mark.slow
def test_distributed_conversion_of_target_vectors_equals_one_process(tmp_path):
    """Two gloo ranks convert an array source with (N, K) float targets: each format's assembled store
    holds the same targets and samples as a single-process conversion, and verifies."""
    from _helpers import run_two_ranks

    images, targets = _images(13), np.random.default_rng(5).normal(size=(13, 3)).astype(np.float32)
    np.save(tmp_path / "images.npy", images)
    np.save(tmp_path / "targets.npy", targets)
    script = (
        "import numpy as np\n"
        "from pathlib import Path\n"
        "root = Path(store)\n"
        "images, targets = np.load(root / 'images.npy'), np.load(root / 'targets.npy')\n"
        "result = {s: dlstore.convert((images, targets), root / f'dist{s}', workers=0, progress=False,\n"
        "                             distributed=True).count for s in ('.shards', '.lmdb', '.h5')}\n")
    (tmp_path / "ranks").mkdir()
    results = run_two_ranks(script, tmp_path, tmp_path / "ranks", timeout=300)
    assert results[0] == {".shards": 13, ".lmdb": 13, ".h5": 13}
    for suffix in FORMATS.values():
        dlstore.convert((images, targets), tmp_path / f"one{suffix}", workers=0, progress=False)
        dist, one = dlstore.open_dataset(tmp_path / f"dist{suffix}"), dlstore.open_dataset(tmp_path / f"one{suffix}")
        np.testing.assert_array_equal(dist.targets, targets)
        assert dist.targets.dtype == np.float32 and dist.manifest["targets"] == one.manifest["targets"]
        assert torch.equal(dist.read_batch(range(13))[0], one.read_batch(range(13))[0])
        np.testing.assert_array_equal(dist.get_batch([12, 0])[1].numpy(), targets[[12, 0]])
        assert verify(tmp_path / f"dist{suffix}", deep=True).ok, suffix
