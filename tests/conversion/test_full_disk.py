"""A real full disk: conversions on a small tmpfs that fills mid-way.

Each case mounts its own tmpfs (root, as here and in CI; skipped with the
reason where mounting is refused), fills it with a filler file so that about
half of the store fits, converts through the command line, and checks: exit 2,
one line that says "disk full" and names the path, no traceback, no store at
DST (only a resumable staging path, or nothing). It then frees the space
(deletes the filler) and runs the same command with ``--resume``: the store
must equal one converted without interruption.

Small resumable units (shard size, LMDB/HDF5 write batches) make the disk fill
after some checkpoints, so the resume continues from one instead of starting
over (the writers' batch defaults are 64 MiB; the runner lowers them the way
a caller of ``convert(batch_bytes=)`` would).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dlstore
from dlstore.formats.space import SPACE_MARGIN
from dlstore.sources.demo import make_image_folder

FORMATS = {"shards": "s.shards", "lmdb": "s.lmdb", "hdf5": "s.h5"}
STATIC = "resize=40,center_crop=40"  # 4.8 kB per raw sample
UNIT = 8_000  # bytes per resumable unit: a shard, an LMDB transaction, an HDF5 block

# The command line, with the LMDB/HDF5 write batch lowered to UNIT (no CLI option sets it).
RUNNER = f"""
import sys
from dlstore.formats import hdf5, lmdb
lmdb.LmdbWriter.__init__.__kwdefaults__["batch_bytes"] = {UNIT}
hdf5.Hdf5Writer.__init__.__kwdefaults__["batch_bytes"] = {UNIT}
from dlstore.cli import main
sys.argv = ["dlstore", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("full") / "images", classes=2, per_class=20, size=(48, 60))


@pytest.fixture(scope="module")
def big_folder(tmp_path_factory):
    """For encoded stores (3-10x smaller): big enough that half of one spans several units."""
    return make_image_folder(tmp_path_factory.mktemp("full-big") / "images", classes=2, per_class=60,
                             size=(48, 60))


@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        proc = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
        pytest.skip(f"cannot mount a tmpfs here (needs root; {proc.stderr.strip() or 'mount refused'}); "
                    "the full-disk tests run where the tests run as root (CI)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(mnt: Path, leave: int) -> Path:
    """Write a filler file so that about ``leave`` bytes stay free on ``mnt``."""
    filler = mnt / "filler"
    st = os.statvfs(mnt)
    size = max(0, st.f_bavail * st.f_frsize - leave)
    with open(filler, "wb") as f:
        f.write(b"\xff" * size)  # real bytes: tmpfs does not count holes
    return filler


def _cli(*args):
    return subprocess.run([sys.executable, "-c", RUNNER, *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def _same_store(a: Path, b: Path) -> None:
    x, y = dlstore.open_dataset(a), dlstore.open_dataset(b)
    assert x.manifest["checksums"] == y.manifest["checksums"]
    assert x.targets == y.targets
    assert all(torch.equal(x[i][0], y[i][0]) for i in range(len(y)))
    assert dlstore.verify(a, deep=True).ok


# Every format raw with 0 and 2 decode workers; each encoded format once (the machine is
# shared and each case starts two command-line processes).
CASES = [(fmt, "raw", w) for fmt in FORMATS for w in (0, 2)] + \
        [("shards", "png", 0), ("lmdb", "jpeg", 0), ("hdf5", "jpeg", 2), ("hdf5", "png", 0)]


def _clean(folder, dst, fmt, **options):
    """The uninterrupted conversion, in this process, with the runner's unit sizes."""
    unit = {"shard_size": UNIT} if fmt == "shards" else {"batch_bytes": UNIT}
    dlstore.convert(folder, dst, static=STATIC, workers=0, progress=False, **unit, **options)
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("fmt, encoding, workers", CASES)
def test_full_disk_stops_cleanly_and_resume_gives_the_same_store(folder, big_folder, tmpfs, tmp_path, fmt, encoding,
                                                                  workers):
    name = FORMATS[fmt]
    folder = folder if encoding == "raw" else big_folder
    options = ["--static", STATIC, "--encoding", encoding, "--shard-size", str(UNIT), "--quiet"]
    clean = _clean(folder, tmp_path / name, fmt, encoding=encoding)
    size = sum(p.stat().st_blocks * 512 for p in ([clean] if clean.is_file() else clean.rglob("*")))
    # about half the store fits (HDF5 writes a block only with SPACE_MARGIN free beside it)
    filler = _fill(tmpfs, leave=size // 2 + (SPACE_MARGIN if fmt == "hdf5" else 0))

    dst = tmpfs / name
    failed = _cli("convert", folder, dst, *options, "--workers", workers)
    assert failed.returncode == 2, failed.stderr
    assert "Traceback" not in failed.stderr
    assert "disk full" in failed.stderr and str(tmpfs) in failed.stderr, failed.stderr
    assert not dst.exists()
    left = sorted(p.name for p in tmpfs.iterdir())
    staged = tmpfs / f".{name}.dlstore-tmp"
    kept = "partial conversion kept" in failed.stderr
    assert kept, failed.stderr  # the units are small: some were checkpointed before the disk filled
    assert staged.exists()
    assert all(n == "filler" or n.startswith(f".{name}.dlstore-tmp") for n in left), left

    filler.unlink()  # free the space
    resumed = _cli("convert", folder, dst, *options, "--workers", workers, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after" in resumed.stderr
    assert sorted(p.name for p in tmpfs.iterdir()) == [name]  # no staging, no lock, no filler
    _same_store(dst, clean)


@pytest.mark.slow
def test_remounting_bigger_lets_the_resume_finish(folder, tmpfs, tmp_path):
    """The other way to free space: the filesystem grows (here: tmpfs remounted bigger)."""
    options = ["--static", STATIC, "--quiet"]
    clean = _clean(folder, tmp_path / "s.lmdb", "lmdb")
    subprocess.run(["mount", "-o", "remount,size=100k", str(tmpfs)], check=True)
    dst = tmpfs / "s.lmdb"
    failed = _cli("convert", folder, dst, *options, "--workers", "0")
    assert failed.returncode == 2 and "disk full" in failed.stderr and "Traceback" not in failed.stderr, \
        failed.stderr
    subprocess.run(["mount", "-o", "remount,size=8m", str(tmpfs)], check=True)
    resumed = _cli("convert", folder, dst, *options, "--workers", "0", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    _same_store(dst, clean)
    shutil.rmtree(dst)
