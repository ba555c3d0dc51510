"""A CSV / JSON-lines list: every path inside the root, one kind of label; refusals name the line."""

from __future__ import annotations

import os

import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from torchvision.transforms import v2

import dlstore
from dlstore.cli import main
from dlstore.errors import SourceError
from dlstore.sources import read_list
from dlstore.sources.demo import make_image_folder


@pytest.fixture
def tree(tmp_path):
    """tmp/root/class_0X/img_000Y.png (2 x 2) and tmp/outside/secret.png beside the root."""
    root = make_image_folder(tmp_path / "root", classes=2, per_class=2, size=(12, 10), ext=".png")
    make_image_folder(tmp_path / "outside", classes=1, per_class=1, size=(12, 10), ext=".png")
    return root


@pytest.mark.parametrize("listed", ["../outside/class_00/img_0000.png", "class_00/../../outside/class_00/img_0000.png",
                                    "ABS_OUTSIDE", "..", "/"])
def test_a_path_leading_outside_the_root_is_refused_naming_its_line(tree, tmp_path, listed):
    outside = tmp_path / "outside" / "class_00" / "img_0000.png"
    assert outside.is_file()
    listed = str(outside) if listed == "ABS_OUTSIDE" else listed
    listing = tmp_path / "l.csv"
    listing.write_text(f"path,label\nclass_00/img_0000.png,0\n{listed},1\n")
    with pytest.raises(SourceError, match=f"l.csv:3: path '{listed}' leads outside the root {tree}"):
        read_list(listing, tree)
    result = CliRunner().invoke(main, ["convert", str(listing), str(tmp_path / "o.shards"), "--root", str(tree),
                                       "--quiet"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].startswith(f"error: {listing}:3: path '{listed}' leads outside")
    assert not (tmp_path / "o.shards").exists()


def test_paths_inside_the_root_relative_or_absolute_give_the_files_pixels(tree, tmp_path, monkeypatch):
    """An absolute path under the root, and a relative one through `..` that stays inside, are the files
    the filesystem names: the store holds their pixels (PIL's) in list order. The root is given relative
    to the working directory, as on a command line."""
    monkeypatch.chdir(tmp_path)
    listed = [str(tree / "class_01" / "img_0001.png"), "class_01/../class_00/img_0000.png", "class_00/img_0001.png"]
    files = [tree / "class_01" / "img_0001.png", tree / "class_00" / "img_0000.png", tree / "class_00" / "img_0001.png"]
    listing = tmp_path / "l.csv"
    listing.write_text("".join(f"{p},{k % 2}\n" for k, p in enumerate(listed)))
    store = dlstore.convert(listing, tmp_path / "l.shards", root="root", workers=0, progress=False).path
    ds = dlstore.open_dataset(store)
    for i, file in enumerate(files):
        assert torch.equal(ds[i][0], v2.PILToTensor()(Image.open(file).convert("RGB")))
        assert os.path.samefile(ds.samples[i][0], file)


@pytest.mark.parametrize("suffix, rows, first_int, first_name", [
    (".csv", ["a.png,0", "b.png,1", "c.png,cat", "d.png,2", "e.png,dog"], "line 1: '0'", "line 3: 'cat'"),
    (".csv", ["path,label", "a.png,cat", "b.png,7"], "line 3: '7'", "line 2: 'cat'"),
    (".jsonl", ['{"path": "a.png", "label": "dog"}', '{"path": "b.png", "label": 3}'], "line 2: '3'",
     "line 1: 'dog'"),
])
def test_mixed_index_and_name_labels_are_refused_naming_the_first_line_of_each(tmp_path, suffix, rows, first_int,
                                                                                first_name):
    listing = tmp_path / f"l{suffix}"
    listing.write_text("\n".join(rows) + "\n")
    with pytest.raises(SourceError) as caught:
        read_list(listing, tmp_path)
    message = str(caught.value)
    assert message.startswith(f"{listing}: labels mix class indices ({first_int}) and class names ({first_name})")
    assert "use one kind" in message


def test_one_kind_of_label_is_still_read(tmp_path):
    (tmp_path / "i.csv").write_text("a.png,2\nb.png,0\n")
    (tmp_path / "n.csv").write_text("a.png,dog\nb.png,cat\n")
    assert read_list(tmp_path / "i.csv", tmp_path).classes == ["0", "1", "2"]
    assert read_list(tmp_path / "n.csv", tmp_path).classes == ["cat", "dog"]
