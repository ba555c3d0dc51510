"""Source scanning: same classes, order and labels as torchvision's ImageFolder."""

from __future__ import annotations

import os

import pytest
from PIL import Image
from torchvision import datasets
from torchvision.datasets.folder import IMG_EXTENSIONS as TV_EXTENSIONS

from dlstore.errors import DecodeError, SourceError
from dlstore.sources import IMG_EXTENSIONS, UNLABELLED, pil_loader, scan
from dlstore.sources.demo import synthetic_image


def _img(path, cls=0, index=0, size=(12, 10)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(synthetic_image(cls, index, size)).save(path)


@pytest.fixture
def messy_folder(tmp_path):
    """Nested folders, mixed-case extensions, non-images: ordering corner cases."""
    root = tmp_path / "messy"
    _img(root / "zebra" / "b.JPG")
    _img(root / "zebra" / "a.png")
    _img(root / "zebra" / "sub" / "c.jpeg")
    _img(root / "zebra" / "Sub2" / "d.bmp")
    _img(root / "apple" / "10.png")
    _img(root / "apple" / "9.png")
    _img(root / "Mango" / "x.webp")
    (root / "apple" / "notes.txt").write_text("not an image")
    (root / "apple" / "labels.csv").write_text("a,b")
    return root


def test_extensions_match_torchvision():
    assert IMG_EXTENSIONS == TV_EXTENSIONS


def test_scan_matches_imagefolder(messy_folder):
    source = scan(messy_folder)
    reference = datasets.ImageFolder(str(messy_folder))
    assert source.classes == reference.classes
    assert source.class_to_idx == reference.class_to_idx
    assert [(os.path.normpath(p), y) for p, y in source.samples] == \
        [(os.path.normpath(p), y) for p, y in reference.samples]
    assert len(source) == 7


def test_hidden_files_and_folders_are_ignored(messy_folder):
    _img(messy_folder / ".ipynb_checkpoints" / "x.png")       # hidden class folder
    _img(messy_folder / "apple" / ".hidden" / "y.png")        # hidden subfolder
    _img(messy_folder / "apple" / "._resource_fork.png")      # hidden file
    (messy_folder / ".DS_Store").write_bytes(b"\x00\x01")
    source = scan(messy_folder)
    assert ".ipynb_checkpoints" not in source.classes
    assert all("/." not in p for p, _ in source.samples)
    assert len(source) == 7


def test_flat_folder_is_unlabelled(tmp_path):
    for i in range(3):
        _img(tmp_path / f"{i}.png", index=i)
    source = scan(tmp_path)
    assert source.classes == [] and not source.labelled
    assert [y for _, y in source.samples] == [UNLABELLED] * 3
    assert [os.path.basename(p) for p, _ in source.samples] == ["0.png", "1.png", "2.png"]


def test_empty_class_keeps_its_index(tmp_path):
    _img(tmp_path / "a" / "1.png")
    (tmp_path / "b").mkdir()
    _img(tmp_path / "c" / "1.png")
    source = scan(tmp_path)
    assert source.classes == ["a", "b", "c"]
    assert [y for _, y in source.samples] == [0, 2]
    assert source.empty_classes == ["b"]


def test_no_images_is_an_error(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "readme.txt").write_text("x")
    with pytest.raises(SourceError, match="none of the 1 class folders"):
        scan(tmp_path)
    with pytest.raises(SourceError, match="not a folder"):
        scan(tmp_path / "missing")


def test_symlink_loop_terminates(tmp_path):
    _img(tmp_path / "a" / "1.png")
    os.symlink(tmp_path / "a", tmp_path / "a" / "loop")
    source = scan(tmp_path)
    assert [os.path.basename(p) for p, _ in source.samples] == ["1.png"]


def test_pil_loader_names_the_file(tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"this is not a jpeg")
    with pytest.raises(DecodeError) as info:
        pil_loader(bad)
    assert str(bad) in str(info.value)
    truncated = tmp_path / "trunc.jpg"
    Image.fromarray(synthetic_image(0, 0, (64, 64))).save(tmp_path / "full.jpg")
    truncated.write_bytes((tmp_path / "full.jpg").read_bytes()[:300])
    with pytest.raises(DecodeError, match="trunc.jpg"):
        pil_loader(truncated)
