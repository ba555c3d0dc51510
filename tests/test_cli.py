"""The command line: convert, info, demo, exit codes and messages."""

from __future__ import annotations

import subprocess
import sys

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
    assert "already exists" in again.output and "--overwrite" in again.output


def test_bad_static_spec_is_reported(src, tmp_path):
    result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "x.shards"),
                                       "--static", "random_crop=3", "--quiet"])
    assert result.exit_code == 2
    assert "unknown static op 'random_crop'" in result.output
    assert not (tmp_path / "x.shards").exists()


def test_unknown_suffix_asks_for_a_format(src, tmp_path):
    result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "x.store"), "--quiet"])
    assert result.exit_code == 2 and "--format" in result.output


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
