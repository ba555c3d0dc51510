"""benchmarks/_segdata.py: the segmentation set its benchmarks train and time on says what it holds.

The files are read back with PIL and paired by dlstore's own ``scan_pairs``; the masks must hold
the classes and ignore pixels the maker reports, keep every two classes apart with ignore pixels
(as VOC's outlines do), and each class must carry its colour cue in the JPEGs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import dlstore

pytest.importorskip("sklearn", reason="scikit-learn provides the background photos: pip install -e '.[examples]'")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SIZE = (48, 64)
SPLITS = {"train": 20, "val": 6}


@pytest.fixture(scope="module")
def segdata():
    """benchmarks/_segdata.py as a module (benchmarks/ is not a package; it imports _photos beside it)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import _segdata
        yield _segdata
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def written(segdata, tmp_path_factory):
    return segdata.make_segmentation_set(tmp_path_factory.mktemp("seg"), SPLITS, size=SIZE, seed=3)


def test_every_image_has_its_mask_and_scan_pairs_pairs_them(written):
    for split, count in SPLITS.items():
        source = dlstore.sources.scan_pairs(written.images(split), written.masks(split))
        assert len(source) == count and source.skipped == []
        for image_path, mask_path in source.item_keys():
            assert Path(image_path).stem == Path(mask_path).stem
            with Image.open(image_path) as image, Image.open(mask_path) as mask:
                assert (image.format, image.mode, image.size) == ("JPEG", "RGB", SIZE[::-1])
                assert (mask.format, mask.mode, mask.size) == ("PNG", "P", SIZE[::-1])


def test_masks_hold_the_classes_and_ignore_pixels_reported(segdata, written):
    assert len(written.samples) == sum(SPLITS.values())
    seen = set()
    for sample in written.samples:
        with Image.open(written.pair(sample)[1]) as mask:
            labels = np.asarray(mask)
        present = set(np.unique(labels).tolist())
        assert present - {segdata.IGNORE} == set(sample.classes), sample
        assert int((labels == segdata.IGNORE).sum()) == sample.ignore > 0, sample
        assert present <= {*range(len(segdata.CLASSES)), segdata.IGNORE}, sample
        seen |= present
    assert seen == {*range(len(segdata.CLASSES)), segdata.IGNORE}


def test_ignore_pixels_keep_every_two_classes_apart(written):
    """No pixel of one class touches (4-neighbourhood) a pixel of another: VOC's outlines."""
    for sample in written.samples:
        with Image.open(written.pair(sample)[1]) as mask:
            labels = np.asarray(mask).astype(int)
        for a, b in ((labels[1:], labels[:-1]), (labels[:, 1:], labels[:, :-1])):
            touching = (a != b) & (a != 255) & (b != 255)
            assert not touching.any(), (sample, np.argwhere(touching)[:3])


def test_border_zero_writes_no_ignore_pixels(segdata, tmp_path):
    plain = segdata.make_segmentation_set(tmp_path, {"train": 4}, size=SIZE, seed=3, border=0)
    for sample in plain.samples:
        with Image.open(plain.pair(sample)[1]) as mask:
            assert sample.ignore == 0 and 255 not in np.asarray(mask)


def test_each_class_carries_its_colour_cue(segdata, written):
    """The mean JPEG colour of each class's pixels is nearest to that class's colour (times its
    texture's mean shade), and the photo background is nearest to none of them in particular."""
    shade = {1: 1.0, 2: 0.8, 3: 0.775, 4: 0.833}
    reference = {c: np.asarray(colour) * shade[c] for c, colour in segdata.COLOURS.items()}
    sums = {c: np.zeros(3) for c in reference}
    counts = dict.fromkeys(reference, 0)
    for sample in written.samples:
        image_path, mask_path = written.pair(sample)
        with Image.open(image_path) as image, Image.open(mask_path) as mask:
            pixels, labels = np.asarray(image, dtype=float), np.asarray(mask)
        for c in reference:
            sums[c] += pixels[labels == c].sum(axis=0)
            counts[c] += int((labels == c).sum())
    for c in reference:
        mean = sums[c] / counts[c]
        nearest = min(reference, key=lambda k: np.linalg.norm(mean - reference[k]))
        assert nearest == c and np.linalg.norm(mean - reference[c]) < 30, (c, mean)


def test_same_seed_same_files_other_seed_others(segdata, written, tmp_path):
    again = segdata.make_segmentation_set(tmp_path / "a", SPLITS, size=SIZE, seed=3)
    other = segdata.make_segmentation_set(tmp_path / "b", {"train": 2}, size=SIZE, seed=4)
    for sample in again.samples:
        for mine, theirs in zip(again.pair(sample), written.pair(sample)):
            assert mine.read_bytes() == theirs.read_bytes()
    assert written.pair(written.samples[0])[0].read_bytes() != other.pair(other.samples[0])[0].read_bytes()


def test_pair_folder_reads_the_files_and_moves_both_together(segdata, written):
    """The benchmarks' baseline Dataset: the JPEG as PIL decodes it, the mask's indices as a
    tv_tensors.Mask, and a v2 flip applied to both."""
    import torch
    from torchvision import tv_tensors
    from torchvision.transforms import v2

    plain = segdata.PairFolder(written.images("val"), written.masks("val"), v2.ToImage())
    flipped = segdata.PairFolder(written.images("val"), written.masks("val"),
                                 v2.Compose([v2.ToImage(), v2.RandomHorizontalFlip(p=1.0)]))
    assert len(plain) == SPLITS["val"]
    for i, sample in enumerate(written.split("val")):
        image, mask = plain[i]
        image_path, mask_path = written.pair(sample)
        with Image.open(image_path) as jpeg, Image.open(mask_path) as png:
            expected_image, expected_mask = np.asarray(jpeg.convert("RGB")), np.asarray(png)
        assert isinstance(mask, tv_tensors.Mask) and mask.dtype == torch.uint8
        assert np.array_equal(image.permute(1, 2, 0).numpy(), expected_image)
        assert np.array_equal(mask.numpy(), expected_mask)
        image_f, mask_f = flipped[i]
        assert torch.equal(image_f, image.flip(-1)) and torch.equal(mask_f, mask.flip(-1))
