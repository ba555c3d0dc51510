"""``verify`` of an LMDB or HDF5 store whose data file differs from its seal.

Without ``deep`` the file is not handed to the library (damaged pages can crash or hang it):
the report says the store is damaged and why, not "0 samples". With ``deep`` it is read in a
child process and every sample that fails its CRC32 is named; which samples are damaged is
decided by the libraries themselves (h5py, lmdb) reading the damaged and the pristine file.
A child that crashes or hangs is reported as such, and none is left behind.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import re
import shutil
import signal
from pathlib import Path

import h5py
import lmdb
import numpy as np
import pytest
from click.testing import CliRunner

import dlstore
from dlstore.cli import main
from dlstore.sources.demo import make_image_folder
from dlstore.tools import verification

DAMAGED = [1, 4, 6]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    src = make_image_folder(root / "images", classes=2, per_class=4, size=(24, 30))
    for name in ("s.lmdb", "s.h5"):
        dlstore.convert(src, root / name, static="resize=20,center_crop=16", workers=0, progress=False)
    return root


def _library_samples(path: Path) -> list[bytes]:
    """Every sample's stored bytes as the format's own library reads them (no dlstore involved)."""
    if path.suffix == ".h5":
        with h5py.File(path, "r") as f:
            return [f["images"][i].tobytes() for i in range(len(f["images"]))]
    with lmdb.open(str(path), readonly=True, lock=False) as env, env.begin() as txn:
        return [txn.get(f"{i:010d}".encode()) for i in range(8)]


def _damaged_copy(pristine: Path, dst: Path) -> Path:
    """A copy with one byte flipped inside each sample of DAMAGED (every copy of its bytes in the file)."""
    (shutil.copytree if pristine.is_dir() else shutil.copy2)(pristine, dst)
    file = dst / "data.mdb" if dst.is_dir() else dst
    data = bytearray(file.read_bytes())
    for i in DAMAGED:
        record = np.ascontiguousarray(dlstore.open_dataset(pristine).reader.get(i)).tobytes()
        at = data.find(record)
        assert at >= 0
        while at >= 0:
            data[at + len(record) // 2] ^= 0x40
            at = data.find(record, at + 1)
    file.write_bytes(bytes(data))
    return dst


def _named(report) -> set[int]:
    return {int(m.group(1)) for where, message in report.problems
            if (m := re.fullmatch(r"sample (\d+)", where)) and "CRC32" in message}


@pytest.mark.parametrize("name", ["s.lmdb", "s.h5"])
def test_a_damaged_store_is_reported_damaged_and_deep_names_each_damaged_sample(pristine, tmp_path, name):
    work = _damaged_copy(pristine / name, tmp_path / name)
    before, after = _library_samples(pristine / name), _library_samples(work)
    differ = {i for i, (a, b) in enumerate(zip(before, after)) if a != b}
    assert differ == set(DAMAGED)

    shallow = dlstore.verify(work)
    assert not shallow.ok and shallow.count is None
    text = str(shallow)
    assert text.splitlines()[0] == f"{work}: {'hdf5' if name.endswith('h5') else 'lmdb'}, not opened"
    assert "0 samples" not in text and "differs from its seal" in text and "--deep" in text

    deep = dlstore.verify(work, deep=True)
    assert not deep.ok and deep.count == 8
    assert _named(deep) == differ
    assert str(deep).splitlines()[0].endswith(", 8 samples")
    assert multiprocessing.active_children() == []

    cli = CliRunner().invoke(main, ["verify", "--deep", str(work)])
    assert cli.exit_code == 1 and "Traceback" not in cli.output
    assert {int(i) for i in re.findall(r"PROBLEM  sample (\d+): .*CRC32", cli.output)} == differ
    assert dlstore.verify(pristine / name, deep=True).ok


# In the child verify starts: what it does first, set by the test below (inert otherwise).
_in_child = {"signal": None}


def _child_signal() -> None:
    if _in_child["signal"] is not None:
        faulthandler.disable()   # (pytest's would print the child's stack on SIGSEGV)
        os.kill(os.getpid(), _in_child["signal"])


os.register_at_fork(after_in_child=_child_signal)


@pytest.mark.parametrize("sig, said", [(signal.SIGSEGV, "crashed (SIGSEGV)"), (signal.SIGSTOP, "hung")])
def test_a_child_that_crashes_or_hangs_is_reported_and_gone(pristine, tmp_path, monkeypatch, sig, said):
    """A real signal to the real child: SIGSEGV as a crash of the library, SIGSTOP as a hang (silent)."""
    work = _damaged_copy(pristine / "s.h5", tmp_path / "s.h5")
    monkeypatch.setattr(verification, "STALL_S", 1.0)
    _in_child["signal"] = sig
    try:
        report = dlstore.verify(work, deep=True)
    finally:
        _in_child["signal"] = None
    assert not report.ok and report.count is None
    problem = dict(report.problems)["open"]
    assert f"HDF5 {said}" in problem and "cannot be named" in problem and str(work) in problem
    assert multiprocessing.active_children() == []
