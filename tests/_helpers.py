"""Helpers shared by test modules in several folders (fixtures go in conftest.py).

Import with ``from _helpers import ...``: pytest puts ``tests/`` on ``sys.path`` when it
imports ``tests/conftest.py`` (the default "prepend" import mode), as it puts each test
module's own folder there (``from fidelity_harness import ...``).

* ``forked_helper`` / ``ask``: test cases run each in its own process, forked from one
  helper process. LMDB and HDF5 are C libraries: a damaged file may crash the process
  instead of raising, or hang it. The helper imports dlstore once (a fresh interpreter
  per case would spend seconds importing torch) and forks a process per case, so that a
  crash or a hang fails that case, not the test run.
* ``run_two_ranks``: a script run as the two ranks of a real gloo process group;
  ``split_store``: a small store over several shard files, for rank partitions.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

import dlstore
from dlstore.sources.demo import make_image_folder

TESTS = Path(__file__).resolve().parent


# --- one forked process per case -------------------------------------------------------------

def serve_forked(case: Callable[[dict], dict], timeout: float = 60) -> None:
    """The helper process's loop: a JSON job a line on stdin, one JSON answer a line on stdout.

    Each job runs as ``case(job)`` in a child forked for it. The answer is
    ``{"status": "exit", **case(job)}``, or ``{"status": "foreign", "error": ...}`` where
    ``case`` raised, ``"hang"`` (killed after ``timeout`` s), ``"crash: SIGSEGV"`` (or
    whichever signal ended it) or ``"exit without a result"``.
    """
    for line in sys.stdin:
        job = json.loads(line)
        out = tempfile.mktemp()
        pid = os.fork()
        if pid == 0:
            try:
                res = {"status": "exit", **case(job)}
            except BaseException:
                res = {"status": "foreign", "error": "helper: " + traceback.format_exc()[-800:]}
            try:
                with open(out, "w") as f:
                    json.dump(res, f)
            finally:
                os._exit(0)
        end = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > end:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = None
                break
            time.sleep(0.005)
        if status is None:
            answer = {"status": "hang"}
        elif os.WIFSIGNALED(status):
            answer = {"status": f"crash: {signal.Signals(os.WTERMSIG(status)).name}"}
        else:
            try:
                with open(out) as f:
                    answer = json.load(f)
                os.unlink(out)
            except (OSError, ValueError):
                answer = {"status": "exit without a result"}
        print(json.dumps(answer), flush=True)


@contextmanager
def forked_helper(setup: str) -> Iterator[subprocess.Popen]:
    """A helper process that runs ``setup`` (Python code defining ``case(job: dict) -> dict``,
    with its imports) and then ``serve_forked(case)``; ``ask`` sends it a job."""
    code = f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n{setup}\n" \
           "from _helpers import serve_forked\nserve_forked(case)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def ask(helper: subprocess.Popen, job: dict) -> dict:
    """Run one ``job`` in ``helper`` (``forked_helper``): its answer (see ``serve_forked``)."""
    helper.stdin.write(json.dumps(job) + "\n")
    helper.stdin.flush()
    line = helper.stdout.readline()
    assert line, "the helper process died"
    return json.loads(line)


# --- a two-process gloo group ----------------------------------------------------------------

def split_store(root: Path) -> Path:
    """``root/s.shards``: 23 samples of 3x12x10 (3 classes: 8 + 8 + 7, ordered by class as
    ImageFolder orders them) over 5 shard files of 5 samples; not a multiple of any chunk,
    batch or world size the tests use."""
    src = make_image_folder(root / "images", classes=3, per_class=8, size=(14, 12), ext=".png")
    (src / "class_02" / "img_0007.png").unlink()
    dst = root / "s.shards"
    dlstore.convert(src, dst, static="center_crop=12x10", workers=0, progress=False,
                    shard_size=3 * 12 * 10 * 5)  # 5 samples per shard file
    return dst


# Before the script: its arguments, and the process group joined (rank and world size are
# then torch.distributed's defaults). After it: ``result`` written as JSON, the group left.
_RANK_PROLOGUE = """
import json, sys
import torch
import torch.distributed as dist
import dlstore
store, rendezvous, rank, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank, world_size=2)
"""
_RANK_EPILOGUE = """
json.dump(result, open(out, "w"))
dist.barrier()   # both ranks leave together: gloo aborts ("terminate called without an active
dist.destroy_process_group()   # exception") when its peer tears the group down mid-exchange
"""


def run_two_ranks(script: str, store: str | os.PathLike, tmp_path: Path, *, timeout: float) -> list[dict]:
    """Run ``script`` as ranks 0 and 1 of a gloo group (file rendezvous in ``tmp_path``); each
    rank's ``result`` (JSON), rank 0's first.

    ``script`` sees ``store`` (a path), ``rank``, ``torch``, ``dist`` and ``dlstore``, and sets
    ``result``. Both processes must exit with 0 within ``timeout`` seconds.
    """
    path = tmp_path / "worker.py"
    path.write_text(_RANK_PROLOGUE + script + _RANK_EPILOGUE)
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, str(path), str(store), str(tmp_path / "rdv"), str(r),
                               str(outs[r])]) for r in range(2)]
    assert [p.wait(timeout=timeout) for p in procs] == [0, 0]
    return [json.loads(o.read_text()) for o in outs]


# --- gloo process groups in forked ranks (the distributed conversion tests) ---------------------

def free_port() -> int:
    """A TCP port free on this host now (the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, out: str, fn: Callable, args: tuple) -> None:
    """Rank ``rank`` of ``world``: joins the gloo group, runs ``fn(rank, *args)``, writes what it
    returned (or its error) to ``out/rank{rank}.json``, leaves the group.

    The ranks meet at a barrier before destroying the group: gloo aborts ("terminate called
    without an active exception") when its peer tears the group down first. A barrier that
    fails (some tests kill a rank on purpose) is ignored: the result is already written.
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        result = {"ok": fn(rank, *args)}
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result = {"error": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    try:
        dist.barrier()
    except RuntimeError:
        pass
    dist.destroy_process_group()


# --- the page cache, observed with mincore(2) through ctypes (not dlstore's own probe) ---

def resident_pages(path: Path) -> np.ndarray:
    """mincore(2) vector of a file: True for each page in the page cache."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vec = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
        assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        libc.munmap(addr, size)
    finally:
        os.close(fd)
    return (np.frombuffer(vec, dtype=np.uint8) & 1).astype(bool)


def seen_resident(path: Path, pages: set[int] | None = None, seconds: float = 30) -> set[int]:
    """Which of ``pages`` (default: all of the file's) were in the page cache at some moment
    within ``seconds``, polled until all were: advised pages arrive over time, and this VM's
    proactive reclaim (DAMON, by physical region) may page some out again before the others
    arrive, so they need not all be resident at one instant."""
    wanted = set(range(len(resident_pages(path)))) if pages is None else set(pages)
    seen: set[int] = set()
    deadline = time.monotonic() + seconds   # a throttled VM disk (CI) can take seconds
    while True:
        seen |= set(np.flatnonzero(resident_pages(path)).tolist()) & wanted
        if seen == wanted or time.monotonic() > deadline:
            return seen
        time.sleep(0.005)


def pages_holding(path: Path, sample: np.ndarray) -> set[int]:
    """The pages of ``path`` holding ``sample``'s bytes, found by searching the file for them."""
    content = path.read_bytes()
    offset = content.find(sample.tobytes())
    assert offset >= 0 and content.find(sample.tobytes(), offset + 1) < 0
    return set(range(offset // mmap.PAGESIZE, (offset + sample.nbytes - 1) // mmap.PAGESIZE + 1))


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class LastItemDoes:
    """A real map-style dataset of 4 uint8 images whose last ``__getitem__`` first runs ``act()``:
    a user (or another program) acting on the destination while a conversion reads its source."""

    def __init__(self, act: Callable[[], object]):
        self.act = act

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        import torch

        if i == len(self) - 1:
            self.act()
        return torch.full((3, 8, 8), i, dtype=torch.uint8), i
