"""Errors a user can cause on the command line: one line, ``error: ...``, naming the path and the fix.

``demo --dir`` writes only into a folder it made (new, empty, or an earlier demo's, which it
recognises by what it recorded there); ``bench`` given a store says what it takes instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import dlstore
from dlstore.cli import main
from dlstore.sources.demo import make_image_folder


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root``: a file's bytes, None for a folder."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), root)] = None
        for name in filenames:
            out[os.path.relpath(os.path.join(dirpath, name), root)] = Path(dirpath, name).read_bytes()
    return out


def _one_error_line(result, *fragments: str) -> str:
    """The command exited 2 with one line ``error: ...`` holding every fragment (no traceback)."""
    assert result.exit_code == 2, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def _users_images(folder: Path) -> None:
    make_image_folder(folder, classes=1, per_class=1, size=(20, 24))
    (folder / "class_00").rename(folder / "holidays")


@pytest.mark.parametrize("case, recorded", [
    *[(case, False) for case in ("store-is-a-user-folder", "images-is-a-file", "images-is-a-user-folder",
                                 "user-files-beside")],
    *[(case, True) for case in ("store-is-a-user-folder", "images-is-a-file", "images-is-a-user-folder")]])
def test_demo_refuses_a_folder_it_did_not_write_and_changes_nothing(tmp_path, case, recorded):
    """Without a record, any entry in --dir is refused; with an earlier demo's record (here one that
    wrote nothing that is still there), demo.shards or images that it did not write are refused (a
    file of the user's beside them is left alone)."""
    work = tmp_path / "work"
    work.mkdir()
    if recorded:
        (work / ".dlstore-demo.json").write_text("{}")
    if case == "store-is-a-user-folder":
        (work / "demo.shards").mkdir()
        (work / "demo.shards" / "notes.txt").write_text("mine")
        named = "demo.shards"
    elif case == "images-is-a-file":
        (work / "images").write_text("a file of mine")
        named = "images"
    elif case == "images-is-a-user-folder":
        _users_images(work / "images")
        named = "images"
    else:
        (work / "thesis.tex").write_text("mine")
        named = "thesis.tex"
    before = _tree(work)
    result = CliRunner().invoke(main, ["demo", "--dir", str(work), "--images", "5", "--workers", "0"])
    if recorded:
        _one_error_line(result, f"{work / named}: exists, and dlstore demo did not write it", "move")
    else:
        _one_error_line(result, str(work), named, "give a new or empty folder")
    assert _tree(work) == before


def test_demo_error_is_one_line_on_stderr_of_the_real_command(tmp_path):
    (tmp_path / "demo.shards").mkdir()
    (tmp_path / "demo.shards" / "notes.txt").write_text("mine")
    out = subprocess.run([sys.executable, "-m", "dlstore.cli", "demo", "--dir", str(tmp_path), "--images", "5"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(f"error: --dir {tmp_path}: holds demo.shards")


@pytest.mark.slow
def test_demo_reuses_only_what_it_wrote(tmp_path):
    """An empty --dir is used; a second run keeps the images it wrote; a file added to them, or a store
    replaced by the user's, makes the next run refuse and change nothing; a new --images count rewrites."""
    runner = CliRunner()
    work = tmp_path / "work"
    work.mkdir()

    def demo(images: int = 5):
        return runner.invoke(main, ["demo", "--dir", str(work), "--images", str(images), "--workers", "0"])

    first = demo()
    assert first.exit_code == 0, first.output
    assert f"writing 5 synthetic 500x375 JPEGs in 5 classes to {work / 'images'}" in first.output
    again = demo()
    assert again.exit_code == 0, again.output
    assert f"keeping the 5 synthetic JPEGs in {work / 'images'}" in again.output
    assert "samples  5 in 5 classes" in again.output

    added = work / "images" / "class_01" / "mine.jpg"
    added.write_bytes((work / "images" / "class_00" / "img_0000.jpg").read_bytes())
    before = _tree(work)
    _one_error_line(demo(), f"{work / 'images'}: not the image folder an earlier dlstore demo wrote",
                    "move")
    assert _tree(work) == before
    added.unlink()

    user_store = tmp_path / "mine.shards"
    dlstore.convert(work / "images", user_store, static="center_crop=16", workers=0, progress=False)
    os.rename(work / "demo.shards", tmp_path / "old.shards")
    os.rename(user_store, work / "demo.shards")
    before = _tree(work)
    _one_error_line(demo(), f"{work / 'demo.shards'}: exists, and dlstore demo did not write it")
    assert _tree(work) == before
    os.rename(work / "demo.shards", user_store)
    os.rename(tmp_path / "old.shards", work / "demo.shards")

    bigger = demo(10)
    assert bigger.exit_code == 0, bigger.output
    assert "writing 10 synthetic" in bigger.output and "samples  10 in 5 classes" in bigger.output
    assert sorted(p.name for p in work.iterdir()) == [".dlstore-demo.json", "demo.shards", "images"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-src")
    src = make_image_folder(root / "images", classes=2, per_class=2, size=(20, 24))
    for name in ("s.shards", "s.h5"):
        dlstore.convert(src, root / name, static="center_crop=16", workers=0, progress=False)
    return root


@pytest.mark.parametrize("name", ["s.shards", "s.h5"])
def test_bench_given_a_store_says_what_it_takes(stores, tmp_path, name):
    store = stores / name
    result = CliRunner().invoke(main, ["bench", str(store), "--dir", str(tmp_path / "disk"),
                                       "--out", str(tmp_path / "report"), "--quiet"])
    _one_error_line(result, f"{store} is a dlstore {'shards' if name.endswith('shards') else 'hdf5'} store",
                    "bench takes an image folder", f"the folder it was converted from ({stores / 'images'})",
                    f"dlstore profile {store} -b 64")
    assert not (tmp_path / "disk").exists() and not (tmp_path / "report").exists()


def test_bench_given_a_plain_file_says_it_is_not_a_folder(stores, tmp_path):
    plain = tmp_path / "notes.txt"
    plain.write_text("x")
    result = CliRunner().invoke(main, ["bench", str(plain), "--quiet"])
    _one_error_line(result, f"{plain}: a file, not a folder", "bench takes an image folder")


@pytest.mark.slow
def test_profile_trace_prints_no_profiler_error_on_a_machine_without_cuda(stores, tmp_path):
    """torch's profiler (kineto) logs ``ERROR: ... gpuGetDeviceCount failed`` when a CPU-only trace stops
    on a machine without CUDA; the command keeps it quiet (on a CUDA machine there is nothing to hide)."""
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    out = subprocess.run([sys.executable, "-m", "dlstore.cli", "profile", str(stores / "s.shards"), "-b", "2",
                          "--steps", "3", "--trace", str(tmp_path / "trace")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "gpuGetDeviceCount" not in out.stderr and not any(
        line.startswith("ERROR") for line in out.stderr.splitlines()), out.stderr
    assert list((tmp_path / "trace").glob("*.pt.trace.json"))
