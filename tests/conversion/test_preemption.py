"""A conversion killed at a random point leaves nothing running, holding or locked, and resumes exactly.

Real processes, real signals. A harness process makes itself the child subreaper
(``PR_SET_CHILD_SUBREAPER``) and starts a conversion (``dlstore convert`` or a script calling
``dlstore.convert``) with two decode workers and its stdout/stderr on pipes, as a caller
waiting for its output would. Once the workers run, it waits a seeded random delay, then sends
SIGKILL (``kill -9``, the OOM killer) or SIGTERM (to a script: Python's default, no cleanup).
The workers, orphaned, are re-parented to the harness, which reaps them and so learns how each
one ended. It then reads the conversion's pipes to their end (a process still holding one
would make the caller hang) and looks in ``/proc`` for any process holding the lock file.
Then ``--resume`` (``resume=True``) must give a store byte-identical to an uninterrupted run,
every file of it (an LMDB store's ``data.mdb`` included, but for the unused space inside its pages,
``test_lmdb_resume_layout``; its ``lock.mdb`` holds the readers' table, not data), and for LMDB every
key's value read with lmdb too. A kill between a
transaction's commit and its checkpoint leaves samples past the checkpoint: the resume keeps and
checks them rather than deleting them, so the file is laid out as the uninterrupted run's.

Decoding is slowed (each image open sleeps ``SLOW_S`` in the workers) so that the run lasts a
few seconds whatever the machine, and the random delay lands inside it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import lmdb
import pytest

import dlstore
from test_lmdb_resume_layout import lmdb_pages
from dlstore.sources.demo import make_image_folder

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"),
                                                   reason="the harness needs Linux's PR_SET_CHILD_SUBREAPER")]

SUFFIX = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}
STATIC = "resize=48,center_crop=40"
UNIT = {"shards": "shard_size", "lmdb": "batch_bytes", "hdf5": "batch_bytes"}
UNIT_BYTES = 30_000   # a checkpoint every ~6 samples
SLOW_S = 0.02         # per image, in each worker: 160 images take >= 1.6 s on 2 workers

# The conversion: image opens slowed; the same call through the CLI (the unit size it has no option
# for passed through) or the API.
CONVERSION = textwrap.dedent("""
    import sys, time
    import PIL.Image
    opened = PIL.Image.open
    def slow(*args, **kwargs):
        time.sleep({slow})
        return opened(*args, **kwargs)
    PIL.Image.open = slow
    import dlstore
    src, dst, unit, via = {src!r}, {dst!r}, {unit!r}, {via!r}
    options = {{unit: {unit_bytes}}}
    if via == "cli":
        convert = dlstore.conversion.convert
        dlstore.conversion.convert = lambda *a, **k: convert(*a, **{{**k, **options}})
        from dlstore.cli import main
        main(["convert", src, dst, "--workers", "2", "--static", {static!r}, "--quiet"] + sys.argv[1:],
             prog_name="dlstore")
    else:
        print(dlstore.convert(src, dst, workers=2, static={static!r}, progress=False,
                              resume="--resume" in sys.argv, **options))
""")

HARNESS = textwrap.dedent("""
    import ctypes, json, os, random, select, signal, subprocess, sys, time
    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:      # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    sig, delay, lock, cmd = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4:]

    def descendants(pid):
        out = []
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                for child in map(int, open(f"/proc/{pid}/task/{task}/children").read().split()):
                    out += [child, *descendants(child)]
        except FileNotFoundError:
            pass
        return out

    def holding(path):
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if any(os.readlink(f"/proc/{pid}/fd/{fd}") == path for fd in os.listdir(f"/proc/{pid}/fd")):
                    found.append(int(pid))
            except OSError:
                pass
        return found

    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    start = time.monotonic()
    while len(descendants(child.pid)) < 2 and child.poll() is None and time.monotonic() - start < 120:
        time.sleep(0.01)
    time.sleep(delay)
    workers = descendants(child.pid)
    running = child.poll() is None
    holders_before = holding(lock)
    os.kill(child.pid, sig)
    child.wait()
    ended, t0 = {}, time.monotonic()
    while len(ended) < len(workers) and time.monotonic() - t0 < 5:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.01)
        elif pid in workers:
            ended[pid] = (f"signal {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status)
                          else f"exit {os.WEXITSTATUS(status)}")
    pipes, eof = [child.stdout, child.stderr], []
    while pipes and time.monotonic() - t0 < 10:     # a pipe still held by a process never ends
        ready, _, _ = select.select(pipes, [], [], 0.2)
        for pipe in ready:
            if not os.read(pipe.fileno(), 65536):
                pipes.remove(pipe)
                eof.append(pipe is child.stdout and "stdout" or "stderr")
    holders_after = holding(lock)
    for pid in set(workers) - set(ended):
        os.kill(pid, signal.SIGKILL)       # a failed case leaves nothing running either
    print(json.dumps({"pid": child.pid, "running": running, "workers": workers,
                      "ended": {str(k): v for k, v in ended.items()}, "eof": sorted(eof),
                      "holders_before": holders_before, "holders_after": holders_after}))
""")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("preempt") / "images", classes=4, per_class=40,
                             size=(60, 80))


@pytest.fixture(scope="module")
def clean(folder, tmp_path_factory):
    """An uninterrupted conversion per format, the reference for the resumed ones."""
    root = tmp_path_factory.mktemp("clean")
    return {fmt: dlstore.convert(folder, root / f"clean{SUFFIX[fmt]}", static=STATIC, workers=2, progress=False,
                                 **{UNIT[fmt]: UNIT_BYTES}).path for fmt in SUFFIX}


def contents(store: Path) -> dict[str, str]:
    """sha256 of every file of a store (a folder's files by name, or the one file); of an LMDB
    store, of every key's value, read with lmdb, and of its data file."""
    if store.is_file():
        return {store.suffix: hashlib.sha256(store.read_bytes()).hexdigest()}
    if store.suffix == ".lmdb":
        env = lmdb.open(str(store), readonly=True, lock=False)
        try:
            with env.begin() as txn:
                values = {key.decode(): hashlib.sha256(value).hexdigest() for key, value in txn.cursor()}
        finally:
            env.close()
        return {**values, "file data.mdb": hashlib.sha256(b"".join(lmdb_pages(store))).hexdigest()}
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(store.iterdir())}


def kill_mid_conversion(folder: Path, dst: Path, fmt: str, via: str, sig: signal.Signals, seed: str) -> dict:
    script = dst.parent / "conversion.py"
    script.write_text(CONVERSION.format(slow=SLOW_S, src=str(folder), dst=str(dst), unit=UNIT[fmt],
                                        unit_bytes=UNIT_BYTES, via=via, static=STATIC))
    delay = random.Random(seed).uniform(0.0, 1.2)
    lock = dst.with_name(f".{dst.name}.dlstore-lock")
    proc = subprocess.run([sys.executable, "-c", HARNESS, str(int(sig)), str(delay), str(lock), sys.executable,
                           str(script)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    got["delay"] = delay
    return got


@pytest.mark.parametrize("fmt", list(SUFFIX))
@pytest.mark.parametrize("via, sig", [("cli", signal.SIGKILL), ("api", signal.SIGKILL), ("api", signal.SIGTERM)],
                         ids=["cli-SIGKILL", "api-SIGKILL", "api-SIGTERM"])
def test_killed_conversion_leaves_nothing_behind_and_resumes_exactly(folder, clean, tmp_path, fmt, via, sig):
    dst = tmp_path / f"out{SUFFIX[fmt]}"
    got = kill_mid_conversion(folder, dst, fmt, via, sig, seed=f"{fmt}-{via}-{sig.name}")
    assert got["running"] and len(got["workers"]) == 2, got          # killed mid-run, the pool up
    assert got["holders_before"] == [got["pid"]], got                 # the workers never held the lock
    assert sorted(got["ended"]) == sorted(map(str, got["workers"])), f"workers alive 5 s after: {got}"
    assert set(got["ended"].values()) == {"signal SIGKILL"}, got      # the kernel's parent-death signal
    assert got["eof"] == ["stderr", "stdout"], f"a pipe of the killed process is still held: {got}"
    assert got["holders_after"] == [], got
    assert not dst.exists()

    messages: list[str] = []
    if via == "cli":
        proc = subprocess.run([sys.executable, str(tmp_path / "conversion.py"), "--resume"], capture_output=True,
                              text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr
        messages = proc.stderr.splitlines()
    else:
        dlstore.convert(folder, dst, static=STATIC, workers=2, progress=False, resume=True, log=messages.append,
                        **{UNIT[fmt]: UNIT_BYTES})
    assert any(f"taking over the lock" in m and f"pid {got['pid']} " in m for m in messages), messages
    assert contents(dst) == contents(clean[fmt]), (got, messages)
    assert dlstore.verify(dst, deep=True).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["conversion.py", dst.name])


# --- distributed: a rank killed with its decode workers running ------------------------------

def _slow_loads(seconds: float) -> None:
    import dlstore.sources.folder as folder_source

    loader = folder_source.pil_loader

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return loader(*args, **kwargs)

    folder_source.pil_loader = slow    # (in this rank; its forked decode workers inherit it)


def _rank(rank: int, src: str, dst: str, record: str | None) -> dict:
    """Convert collectively with 2 decode workers a rank; with ``record``, rank 0 kills itself (SIGKILL)
    once its workers run and its part has a checkpoint, after writing their pids to ``record``."""
    _slow_loads(SLOW_S)
    if record is not None and rank == 0:
        state = Path(dst).with_name(f".{Path(dst).name}.dlstore-dist") / "rank-00000.json"

        def kill_me() -> None:
            while True:
                workers = [int(pid) for task in os.listdir("/proc/self/task")
                           for pid in open(f"/proc/self/task/{task}/children").read().split()]
                if len(workers) >= 2 and state.exists():
                    break
                time.sleep(0.01)
            Path(record).write_text(json.dumps(workers))
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill_me, daemon=True).start()
    messages: list[str] = []
    try:
        dlstore.convert(src, dst, distributed=True, workers=2, static=STATIC, progress=False, resume=record is None,
                        shard_size=UNIT_BYTES, log=messages.append)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        return {"error": type(exc).__name__, "messages": messages}
    return {"messages": messages}


def _dead(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_killed_rank_takes_its_decode_workers_and_the_lock_with_it(folder, tmp_path):
    from test_distributed_resume import run_ranks

    dst, record = tmp_path / "d.shards", tmp_path / "workers.json"
    results = run_ranks(_rank, str(folder), str(dst), str(record), tmp_path=tmp_path)
    assert results[0] is None and results[1]["error"] == "DistributedError", results
    workers = json.loads(record.read_text())
    end = time.monotonic() + 5
    while not all(map(_dead, workers)) and time.monotonic() < end:
        time.sleep(0.01)
    alive = [pid for pid in workers if not _dead(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)       # a failed case leaves nothing running either
    assert not alive, f"rank 0's decode workers outlived it: {alive}"
    lock = dst.with_name(f".{dst.name}.dlstore-lock")
    assert lock.exists() and _holding(lock) == []

    results = run_ranks(_rank, str(folder), str(dst), None, tmp_path=tmp_path)
    assert all("error" not in r for r in results), results
    assert any("taking over the lock" in m for m in results[0]["messages"]), results[0]["messages"]
    shutil.move(dst, tmp_path / "resumed.shards")
    run_ranks(_rank, str(folder), str(dst), None, tmp_path=tmp_path)     # uninterrupted (nothing to resume)
    assert contents(tmp_path / "resumed.shards") == contents(dst)


def _holding(path: Path) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd")):
                found.append(int(pid))
        except OSError:
            pass
    return found
