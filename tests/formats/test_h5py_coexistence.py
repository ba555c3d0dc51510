"""Plain h5py beside an open dlstore HDF5 dataset in the same process, and beside other processes.

HDF5 keeps one handle per file within a process and refuses a second open of the same file with
other locking flags (``file locking flag values don't match``). dlstore opens with h5py's default
locking, so a default ``h5py.File(path, "r")`` shares the file with a dataset in either order;
where a filesystem refuses locks, dlstore reads without them (checked here with flock(2) made to
fail in a child process, the way such a filesystem answers).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest
import torch

import dlstore
from dlstore.errors import StoreBusyError
from dlstore.sources.demo import make_image_folder


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("coexist")
    src = make_image_folder(root / "images", classes=2, per_class=3, size=(16, 16))
    path = root / "s.h5"
    dlstore.convert(src, path, static="center_crop=12", workers=0, progress=False)
    return path


def test_default_h5py_reads_beside_an_open_dataset_in_both_orders(store):
    ds = dlstore.open_dataset(store)
    first = ds[0][0].numpy()                      # the dataset holds the file open from here
    with h5py.File(store, "r") as f:
        np.testing.assert_array_equal(f["images"][0], first)
        assert list(f["labels"][()]) == ds.targets
    np.testing.assert_array_equal(ds[1][0].numpy(), dlstore.open_dataset(store)[1][0].numpy())

    with h5py.File(store, "r") as f:              # the other order: h5py first, then a dataset
        again = dlstore.open_dataset(store)
        np.testing.assert_array_equal(again[1][0].numpy(), f["images"][1])
        # DataLoader workers forked while both handles are open read the same samples
        loader = torch.utils.data.DataLoader(again, batch_size=3, num_workers=2,
                                             multiprocessing_context="fork")
        images = torch.cat([x for x, _ in loader])
        np.testing.assert_array_equal(images.numpy(), f["images"][()])


def test_h5py_with_explicit_locking_flags_opened_first_is_matched(store):
    for locking in (False, True):
        with h5py.File(store, "r", locking=locking) as f:
            ds = dlstore.open_dataset(store)
            np.testing.assert_array_equal(ds[2][0].numpy(), f["images"][2])
            del ds


def test_h5py_locking_false_after_a_dataset_is_refused_by_hdf5(store):
    """The documented limit (docs/robustness.md): the second open's flags are the user's, not dlstore's."""
    ds = dlstore.open_dataset(store)
    ds[0]
    with pytest.raises(OSError, match="file locking flag values don't match"):
        h5py.File(store, "r", locking=False)


def test_a_file_held_open_for_writing_by_another_process_is_busy(tmp_path, store):
    path = tmp_path / "s.h5"
    shutil.copyfile(store, path)
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import h5py, sys, time
        f = h5py.File({str(path)!r}, "r+")
        print("open", flush=True)
        sys.stdin.readline()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "open\n"
        with pytest.raises(StoreBusyError, match="open for writing"):
            dlstore.open_dataset(path)
    finally:
        writer.communicate("\n", timeout=60)
    assert len(dlstore.open_dataset(path)) == 6   # the writer is gone: the lock went with it


_FAILING_FLOCK = r"""
#include <errno.h>
#include <stdlib.h>
int flock(int fd, int operation) { (void)fd; (void)operation; errno = atoi(getenv("FLOCK_ERRNO")); return -1; }
"""

_CHILD = """
import errno, sys, h5py, dlstore
path = sys.argv[1]
def opens(**kw):
    try:
        h5py.File(path, "r", **kw).close()
        return "opens"
    except OSError as exc:
        return errno.errorcode.get(exc.errno) or "flags differ"
print("h5py default:", opens())
try:
    ds = dlstore.open_dataset(path)
    print("dlstore:", ds[1][0].numpy().tobytes().hex())
    print("beside it: default", opens(), "locking=False", opens(locking=False))
except Exception as exc:
    print("dlstore:", type(exc).__name__, exc)
"""


def _without_locks(store, tmp_path, flock_errno: int, **env: str) -> list[str]:
    """Run _CHILD on ``store`` in a process whose every flock(2) fails with ``flock_errno``."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the flock(2) shim that stands in for a lock-less filesystem")
    shim = tmp_path / "flock_fails.so"
    (tmp_path / "flock_fails.c").write_text(_FAILING_FLOCK)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "flock_fails.c")], check=True)
    run = subprocess.run([sys.executable, "-c", _CHILD, str(store)], check=False, capture_output=True, text=True,
                         timeout=300,
                         env={**os.environ, "LD_PRELOAD": str(shim), "FLOCK_ERRNO": str(flock_errno),
                              **env})
    assert run.returncode == 0, run.stderr
    with h5py.File(store, "r") as f:   # (here, locks work)
        read = f"dlstore: {f['images'][1].tobytes().hex()}"
    return [line.replace(read, "dlstore: read") for line in run.stdout.splitlines()]


@pytest.mark.slow
def test_a_filesystem_without_locks_is_read_without_them(store, tmp_path):
    # ENOLCK (NFS without a lock daemon): HDF5 refuses a default open; dlstore reads unlocked, and
    # h5py opens beside it as it must open there anyway, with locking=False
    assert _without_locks(store, tmp_path, errno.ENOLCK) == [
        "h5py default: ENOLCK", "dlstore: read", "beside it: default flags differ locking=False opens"]
    # ENOSYS: HDF5's default skips the lock itself, and so does dlstore's
    assert _without_locks(store, tmp_path, errno.ENOSYS) == [
        "h5py default: opens", "dlstore: read", "beside it: default opens locking=False flags differ"]
    # HDF5_USE_FILE_LOCKING=TRUE asks for locks anyway: the error names the variable
    out = _without_locks(store, tmp_path, errno.ENOSYS, HDF5_USE_FILE_LOCKING="TRUE")
    assert out[0] == "h5py default: ENOSYS" and out[1].startswith("dlstore: ArgumentError")
    assert "HDF5_USE_FILE_LOCKING=TRUE" in out[1] and "=FALSE" in out[1]
    # =FALSE: no locks anywhere in the process, every open matches
    assert _without_locks(store, tmp_path, errno.ENOLCK, HDF5_USE_FILE_LOCKING="FALSE") == [
        "h5py default: opens", "dlstore: read", "beside it: default opens locking=False opens"]
