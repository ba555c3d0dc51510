"""The command line: convert, info, demo, exit codes and messages."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dlstore.cli import main, parse_bytes
from dlstore.sources.demo import make_image_folder


@pytest.fixture
def src(tmp_path):
    return make_image_folder(tmp_path / "images", classes=2, per_class=4, size=(24, 20))


def test_convert_then_info(src, tmp_path):
    runner = CliRunner()
    dst = tmp_path / "out.shards"
    result = runner.invoke(main, ["convert", str(src), str(dst), "--static", "resize=16,center_crop=12",
                                  "--workers", "2", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "samples  8 in 2 classes" in result.output
    assert "3x12x12 uint8" in result.output
    info = runner.invoke(main, ["info", str(dst)])
    assert info.exit_code == 0, info.output
    assert "samples   8" in info.output
    assert "class_00 (4), class_01 (4)" in info.output
    assert "resize=16,center_crop=12x12" in info.output
    again = runner.invoke(main, ["convert", str(src), str(dst), "--quiet"])
    assert again.exit_code == 2
    assert "already exists; pass --overwrite to replace it" in again.output
    assert "overwrite=True" not in again.output   # the command line names its flags, not Python keywords


def test_bad_static_spec_is_reported(src, tmp_path):
    result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "x.shards"),
                                       "--static", "random_crop=3", "--quiet"])
    assert result.exit_code == 2
    assert "unknown static op 'random_crop'" in result.output
    assert not (tmp_path / "x.shards").exists()


def test_unknown_suffix_asks_for_a_format(src, tmp_path):
    result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "x.store"), "--quiet"])
    assert result.exit_code == 2 and "--format" in result.output


def test_convert_mode_converts_every_image_and_a_grayscale_list_keeps_one_channel(src, tmp_path):
    import torch
    from PIL import Image
    from torchvision.transforms import v2

    import dlstore

    files = sorted(p.relative_to(src) for p in src.rglob("*.jpg"))
    (src / "l.csv").write_text("".join(f"{p},0\n" for p in files))
    runner = CliRunner()
    result = runner.invoke(main, ["convert", str(src), str(tmp_path / "f.shards"), "--mode", "L", "--quiet"])
    assert result.exit_code == 0, result.output
    store = dlstore.open_dataset(tmp_path / "f.shards")
    assert store.manifest["source"]["mode"] == "L" and store.manifest["source"]["mode_given"] is True
    assert torch.equal(store[0][0], v2.PILToTensor()(Image.open(src / files[0]).convert("L")))
    for name in files:
        Image.open(src / name).convert("L").save(src / name)
    result = runner.invoke(main, ["convert", str(src / "l.csv"), str(tmp_path / "l.h5"), "--static", "center_crop=16", "--quiet"])
    assert result.exit_code == 0 and "1x16x16 uint8" in result.output, result.output
    bad = runner.invoke(main, ["convert", str(src), str(tmp_path / "x.shards"), "--mode", "RGBA", "--quiet"])
    assert bad.exit_code == 2 and "'RGBA' is not one of 'RGB', 'L'" in bad.output


def test_parse_bytes():
    assert parse_bytes("1GiB") == 1 << 30
    assert parse_bytes("256MB") == 256_000_000
    assert parse_bytes("4096") == 4096


@pytest.mark.slow
def test_console_script_demo(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dlstore.cli", "demo", "--images", "40", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "identical to ImageFolder on checked samples: yes" in out.stdout
    assert (tmp_path / "demo.shards" / "manifest.json").is_file()
    lines = out.stdout.splitlines()
    assert "first epoch" in out.stdout and "median" in out.stdout and "speed-up: " in out.stdout
    assert lines[-1] == f"next: dlstore info {tmp_path / 'demo.shards'}"   # kept: the hint names it


@pytest.mark.slow
def test_demo_without_dir_names_no_folder_it_removed():
    out = subprocess.run([sys.executable, "-m", "dlstore.cli", "demo", "--images", "10"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    folder = out.stdout.splitlines()[0].rsplit(" to ", 1)[1]            # "1. writing ... to FOLDER/images"
    hint = out.stdout.splitlines()[-1]
    assert not Path(folder).exists() and str(Path(folder).parent) not in hint
    assert hint.startswith("next: dlstore demo --dir DIR") and "removed" in hint


def test_info_json_and_show_with_provenance(src, tmp_path):
    import json

    from PIL import Image

    runner = CliRunner()
    dst = tmp_path / "out.h5"
    assert runner.invoke(main, ["convert", str(src), str(dst), "--static", "resize=16,center_crop=12",
                                "--quiet"]).exit_code == 0
    info = runner.invoke(main, ["info", str(dst), "--json"])
    assert info.exit_code == 0, info.output
    doc = json.loads(info.output)
    assert doc["summary"]["samples"] == 8 and doc["summary"]["per_class"] == {"class_00": 4, "class_01": 4}
    assert doc["summary"]["provenance"] == "path" and doc["manifest"]["format"] == "hdf5"
    shown = runner.invoke(main, ["show", str(dst), "5", "--out", str(tmp_path / "s.png")])
    assert shown.exit_code == 0, shown.output
    assert "label     1 (class_01)" in shown.output
    assert f"source    {src / 'class_01' / 'img_0001.jpg'}" in shown.output
    import dlstore

    stored = dlstore.open_dataset(dst).read(5).permute(1, 2, 0).numpy()
    assert (np.asarray(Image.open(tmp_path / "s.png")) == stored).all()
    bad = runner.invoke(main, ["show", str(dst), "99"])
    assert bad.exit_code != 0 and "99" in bad.output
    last = runner.invoke(main, ["show", str(dst), "-1", "--out", str(tmp_path / "last.png")])   # as the range says
    assert last.exit_code == 0, last.output
    assert "sample    7 of 8" in last.output and f"source    {src / 'class_01' / 'img_0003.jpg'}" in last.output
    stored = dlstore.open_dataset(dst).read(7).permute(1, 2, 0).numpy()
    assert (np.asarray(Image.open(tmp_path / "last.png")) == stored).all()


def test_convert_a_csv_list_with_root(src, tmp_path):
    listing = tmp_path / "l.csv"
    listing.write_text("class_01/img_0002.jpg,1\nclass_00/img_0000.jpg,0\n")
    runner = CliRunner()
    result = runner.invoke(main, ["convert", str(listing), str(tmp_path / "l.shards"), "--root", str(src),
                                  "--quiet"])
    assert result.exit_code == 0, result.output
    assert "samples  2 in 2 classes" in result.output
    shown = runner.invoke(main, ["show", str(tmp_path / "l.shards"), "0"])
    assert "source    " + str(src / "class_01" / "img_0002.jpg") in shown.output


def test_help_imports_no_torch():
    """``dlstore --help`` and every subcommand's answer at once: no torch, numpy or image library."""
    script = textwrap.dedent("""
        import sys
        from dlstore.cli import main
        for command in [[], *[[name] for name in main.commands]]:
            try:
                main([*command, "--help"])
            except SystemExit as stop:
                assert stop.code == 0, command
        print(sorted(m for m in ("torch", "torchvision", "numpy", "PIL", "h5py", "lmdb") if m in sys.modules))
        print(len(main.commands))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-2:] == ["[]", "8"]


@pytest.mark.parametrize("command, new", [(["profile", "STORE", "-b", "2"], "--num-workers"),
                                          (["bench"], "--num-workers")])
def test_workers_means_decode_processes_only_and_the_old_use_names_the_new_flag(src, command, new):
    """--workers is convert's and demo's decode processes; profile and bench take --num-workers."""
    args = [str(src) if a == "STORE" else a for a in command]
    result = CliRunner().invoke(main, [*args, "--workers", "2"])
    assert result.exit_code == 2 and new in result.output and "decode processes" in result.output
    assert "--workers" not in CliRunner().invoke(main, [command[0], "--help"]).output
