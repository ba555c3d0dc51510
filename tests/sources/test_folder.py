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


def _loop_tree(root):
    """3 classes of 4, 5 and 4 images (13 files)."""
    for c, n in enumerate((4, 5, 4)):
        for i in range(n):
            _img(root / f"class_{c}" / f"{i}.png", c, i)
    return root


@pytest.mark.parametrize("target", ["root", "class", "nested-back-to-class", "above-root"])
def test_a_symlink_loop_is_refused_naming_the_link_where_imagefolder_repeats_images(tmp_path, target):
    """torchvision's ImageFolder (os.walk followlinks=True) walks a loop until the system's symlink
    limit, repeating images under the looping class; dlstore names the link instead. Without the
    link both give the same 13 samples."""
    root = _loop_tree(tmp_path / "data")
    link = named = root / "class_0" / "back"
    if target == "root":
        link.symlink_to(root)
    elif target == "class":
        link.symlink_to("..")
    elif target == "nested-back-to-class":   # a link out of the tree, whose folder links back in
        _img(tmp_path / "elsewhere" / "e.png")
        (tmp_path / "elsewhere" / "again").symlink_to(root / "class_0")
        link.symlink_to(tmp_path / "elsewhere")
        named = link / "again"
    else:
        link.symlink_to(tmp_path)
    reference = datasets.ImageFolder(str(root))
    files = sum(1 for _ in root.rglob("*.png"))                  # rglob does not follow links
    assert len(reference) > files + 13                           # the loop, many times over
    with pytest.raises(SourceError, match=f"{named}: a symlink loop") as caught:
        scan(root)
    assert "remove the link" in str(caught.value)
    link.unlink()
    reference = datasets.ImageFolder(str(root))
    assert len(reference) == 13
    assert list(scan(root).samples) == reference.samples


def test_a_symlink_to_another_folder_is_followed_as_imagefolder_follows_it(tmp_path):
    root = _loop_tree(tmp_path / "data")
    (root / "class_0" / "also_2").symlink_to(root / "class_2")   # no loop: class_2's images again, as torchvision
    _img(tmp_path / "shared" / "deep" / "s.png")
    (root / "class_1" / "shared").symlink_to(tmp_path / "shared")
    reference = datasets.ImageFolder(str(root))
    source = scan(root)
    assert len(reference) == 13 + 4 + 1
    assert list(source.samples) == reference.samples and source.class_to_idx == reference.class_to_idx


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
