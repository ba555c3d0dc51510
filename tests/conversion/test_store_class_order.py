"""A store's class order: recorded by convert, shown by info, checked against a caller's class_to_idx.

Differential: a store converted in the default order holds ``ImageFolder``'s classes, labels and
pixels, sample for sample; one converted with ``class_order="natural"`` gives every file the
label timm's folder reader gives it (skipped where timm does not import). The folder has class
names whose two orders differ: c1, c2, c10, C3, b.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as tmp
from _helpers import free_port, rank_main
from click.testing import CliRunner
from PIL import Image
from torchvision import datasets

import dlstore
from dlstore.cli import main
from dlstore.errors import ArgumentError, ArgumentTypeError, StoreCorruptError
from dlstore.sources.demo import synthetic_image

SUFFIX = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}
CLASS_OF_FORMAT = {"shards": dlstore.ShardsDataset, "lmdb": dlstore.LMDBDataset, "hdf5": dlstore.HDF5Dataset}
NAMES = ["c1", "c2", "c10", "C3", "b"]
IMAGEFOLDER = ["C3", "b", "c1", "c10", "c2"]
NATURAL = ["b", "c1", "c2", "C3", "c10"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """5 classes x 2 PNGs (lossless, and among timm's extensions), pixels a function of (class, index)."""
    root = tmp_path_factory.mktemp("order") / "images"
    for c, name in enumerate(NAMES):
        (root / name).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(synthetic_image(c, i, (10, 12))).save(root / name / f"img{i}.png")
    return root


@pytest.fixture(scope="module")
def stores(folder, tmp_path_factory) -> dict[tuple[str, str], Path]:
    out = tmp_path_factory.mktemp("order-stores")
    return {(fmt, order): dlstore.convert(folder, out / f"{order}{suffix}", class_order=order, workers=0,
                                          progress=False).path
            for fmt, suffix in SUFFIX.items() for order in ("imagefolder", "natural")}


def _timm_reference(folder: Path) -> tuple[dict[str, int], dict[str, int]]:
    """timm's class_to_idx of ``folder`` and its label of every file (path -> label)."""
    reader = pytest.importorskip("timm.data.readers.reader_image_folder")
    pairs, class_to_idx = reader.find_images_and_targets(str(folder))
    return class_to_idx, dict(pairs)


def _pixels(path: str) -> torch.Tensor:
    return torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)


@pytest.mark.parametrize("fmt", SUFFIX)
def test_the_default_order_is_imagefolders_sample_for_sample(stores, folder, fmt):
    ds = dlstore.open_dataset(stores[fmt, "imagefolder"])
    reference = datasets.ImageFolder(str(folder))
    assert ds.manifest["class_order"] == "imagefolder"
    assert ds.classes == reference.classes == IMAGEFOLDER
    assert ds.class_to_idx == reference.class_to_idx
    assert ds.targets == reference.targets
    for i, (path, label) in enumerate(reference.samples):
        assert torch.equal(ds[i][0], _pixels(path)) and ds[i][1] == label


@pytest.mark.parametrize("fmt", SUFFIX)
def test_natural_order_is_recorded_and_every_sample_keeps_its_file(stores, folder, fmt):
    ds = dlstore.open_dataset(stores[fmt, "natural"])
    assert ds.manifest["class_order"] == "natural"
    assert ds.classes == NATURAL
    for i, (path, label) in enumerate(ds.samples):
        assert ds.classes[label] == os.path.basename(os.path.dirname(path))
        assert torch.equal(ds[i][0], _pixels(path))


@pytest.mark.parametrize("fmt", SUFFIX)
def test_natural_order_gives_every_file_timms_label(stores, folder, fmt):
    timm_class_to_idx, timm_labels = _timm_reference(folder)
    ds = dlstore.open_dataset(stores[fmt, "natural"])
    assert ds.class_to_idx == timm_class_to_idx
    assert dict(ds.samples) == timm_labels


@pytest.mark.parametrize("fmt", SUFFIX)
def test_a_mapping_equal_to_the_stores_opens_as_before(stores, folder, fmt):
    cls = CLASS_OF_FORMAT[fmt]
    ds = cls(stores[fmt, "imagefolder"], class_to_idx=datasets.ImageFolder(str(folder)).class_to_idx)
    assert ds.classes == IMAGEFOLDER and ds.targets == datasets.ImageFolder(str(folder)).targets
    natural = {name: i for i, name in enumerate(NATURAL)}
    assert dlstore.open_dataset(stores[fmt, "natural"], class_to_idx=natural).class_to_idx == natural


def test_a_store_in_imagefolder_order_refuses_timms_mapping_naming_the_fix(stores):
    timm_class_to_idx = {name: i for i, name in enumerate(NATURAL)}   # timm's (test above)
    for fmt in SUFFIX:
        with pytest.raises(ArgumentError, match=(
                r"class 'C3' is label 0 in the store but 3 in the class_to_idx given; the store was converted in "
                r"imagefolder order.*Convert .*images again with class_order=\"natural\" \(--class-order natural\)")):
            CLASS_OF_FORMAT[fmt](stores[fmt, "imagefolder"], class_to_idx=timm_class_to_idx)


@pytest.mark.parametrize("fmt", SUFFIX)
def test_a_store_in_natural_order_refuses_imagefolders_mapping_naming_the_fix(stores, folder, fmt):
    with pytest.raises(ArgumentError, match=(
            r"class 'b' is label 0 in the store but 1 in the class_to_idx given; the store was converted in "
            r"natural order.*class_order=\"imagefolder\" \(--class-order imagefolder\)")):
        dlstore.open_dataset(stores[fmt, "natural"], class_to_idx=datasets.ImageFolder(str(folder)).class_to_idx)


def test_a_mapping_no_order_gives_is_refused_naming_the_first_difference(stores):
    path = stores["shards", "imagefolder"]
    ours = {name: i for i, name in enumerate(IMAGEFOLDER)}
    with pytest.raises(ArgumentError, match="class 'c10' is label 3 in the store but absent.*target_transform"):
        dlstore.open_dataset(path, class_to_idx={k: v for k, v in ours.items() if k != "c10"})
    with pytest.raises(ArgumentError, match=r"class 'zz' \(label 5 in the class_to_idx given\) is not a class"):
        dlstore.open_dataset(path, class_to_idx={**ours, "zz": 5})
    with pytest.raises(ArgumentError, match="class 'c1' is label 2 in the store but 4"):
        dlstore.open_dataset(path, class_to_idx={**ours, "c1": 4, "c2": 2})
    for wrong in (IMAGEFOLDER, {**ours, "b": True}, {1: 0}):
        with pytest.raises(ArgumentTypeError, match="class_to_idx must map class names"):
            dlstore.open_dataset(path, class_to_idx=wrong)


def _edit_manifest(src: Path, dst: Path, **changes) -> Path:
    """A copy of shards store ``src`` whose manifest has ``changes`` (None: the key removed)."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    for key, value in changes.items():
        if value is None:
            manifest.pop(key)
        else:
            manifest[key] = value
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_a_store_without_a_recorded_order_opens_and_is_still_checked(stores, tmp_path):
    old = _edit_manifest(stores["shards", "imagefolder"], tmp_path / "old.shards", class_order=None)
    ds = dlstore.open_dataset(old, class_to_idx={name: i for i, name in enumerate(IMAGEFOLDER)})
    assert ds.classes == IMAGEFOLDER and "class_order" not in ds.manifest
    result = CliRunner().invoke(main, ["info", str(old)])
    assert result.exit_code == 0 and "order     not recorded" in result.output
    with pytest.raises(ArgumentError, match="without a recorded class order.*class_order=\"natural\""):
        dlstore.open_dataset(old, class_to_idx={name: i for i, name in enumerate(NATURAL)})


def test_a_class_order_that_is_not_a_name_is_a_damaged_manifest_and_an_unknown_one_opens(stores, tmp_path):
    bad = _edit_manifest(stores["shards", "natural"], tmp_path / "bad.shards", class_order=5)
    with pytest.raises(StoreCorruptError, match="'class_order' must be a string"):
        dlstore.open_dataset(bad)
    newer = _edit_manifest(stores["shards", "natural"], tmp_path / "newer.shards", class_order="by-size")
    assert dlstore.open_dataset(newer).classes == NATURAL   # reading needs only 'classes'
    assert "order     by-size (a rule this dlstore does not know)" in CliRunner().invoke(main, ["info", str(newer)]).output


def test_the_command_line_converts_in_natural_order_and_info_shows_the_order(folder, tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["convert", str(folder), str(tmp_path / "n.lmdb"), "--class-order", "natural",
                                  "--workers", "0", "--quiet"])
    assert result.exit_code == 0, result.output
    info = runner.invoke(main, ["info", str(tmp_path / "n.lmdb")])
    assert "classes   5: b (2), c1 (2), c2 (2), C3 (2), c10 (2)" in info.output
    assert "order     natural (as timm's folder reader" in info.output
    summary = json.loads(runner.invoke(main, ["info", "--json", str(tmp_path / "n.lmdb")]).output)["summary"]
    assert summary["class_order"] == "natural"
    runner.invoke(main, ["convert", str(folder), str(tmp_path / "d.h5"), "--workers", "0", "--quiet"])
    assert "order     imagefolder (sorted names" in runner.invoke(main, ["info", str(tmp_path / "d.h5")]).output
    wrong = runner.invoke(main, ["convert", str(folder), str(tmp_path / "x.h5"), "--class-order", "timm"])
    assert wrong.exit_code == 2 and "'timm' is not one of 'imagefolder', 'natural'" in wrong.output


def test_sources_without_class_folders_record_no_order(folder, tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    shutil.copy(folder / "b" / "img0.png", flat / "a.png")
    store = dlstore.convert(flat, tmp_path / "flat.shards", class_order="natural", workers=0, progress=False).path
    assert "class_order" not in dlstore.open_dataset(store).manifest
    listing = tmp_path / "list.csv"
    listing.write_text(f"{folder}/b/img0.png,b\n{folder}/c1/img0.png,c1\n")
    with pytest.raises(ArgumentError, match="list file keeps its own order"):
        dlstore.convert(listing, tmp_path / "list.shards", root="/", class_order="natural", progress=False)
    assert not (tmp_path / "list.shards").exists()
    with pytest.raises(ArgumentError, match="class_order must be one of"):   # before the destination is looked at
        dlstore.convert(folder, tmp_path / "flat.shards", class_order="Natural", progress=False)
    converted = dlstore.convert(listing, tmp_path / "list.shards", root="/", workers=0, progress=False).path
    assert "class_order" not in dlstore.open_dataset(converted).manifest


def _convert_natural(rank: int, src: str, dst: str) -> dict:
    result = dlstore.convert(src, dst, class_order="natural", workers=0, progress=False, distributed=True)
    return {"count": result.count}


def test_a_distributed_conversion_records_the_order_of_its_scan(folder, stores, tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    tmp.start_processes(rank_main, args=(2, free_port(), str(out), _convert_natural,
                                         (str(folder), str(tmp_path / "dist.shards"))),
                        nprocs=2, join=True, start_method="fork")
    assert [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)] == [{"ok": {"count": 10}}] * 2
    ds = dlstore.open_dataset(tmp_path / "dist.shards")
    single = dlstore.open_dataset(stores["shards", "natural"])
    assert ds.manifest["class_order"] == "natural"
    assert ds.classes == NATURAL and ds.targets == single.targets and list(ds.samples) == list(single.samples)
