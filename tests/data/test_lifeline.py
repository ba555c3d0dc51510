"""Loader workers die with their main process, and leave no shared memory, however it ends.

Real processes, real signals. A harness process makes itself the child subreaper
(``PR_SET_CHILD_SUBREAPER``) and runs a script that starts ``dlstore.loader(ds,
num_workers=2)`` (the shared-memory ring), takes a batch, and reports its worker pids
and the ``/dev/shm`` files the three processes map. The harness signals the script;
the workers, orphaned, are re-parented to the harness, which reaps them and so learns
when and how each one ended (killed by the kernel's parent-death signal, or exited on
its own once it saw its parent gone).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

import dlstore

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"),
                                                   reason="the harness needs Linux's PR_SET_CHILD_SUBREAPER")]

CHILD = textwrap.dedent("""
    import json, os, sys, threading, time
    import torch
    from torchvision.transforms import v2
    import dlstore

    def descendants(pid):
        out = {}
        for task in os.listdir(f"/proc/{pid}/task"):
            for child in map(int, open(f"/proc/{pid}/task/{task}/children").read().split()):
                out[child] = open(f"/proc/{child}/comm").read().strip()
                out.update(descendants(child))
        return out

    def run(path, mode):
        ds = dlstore.open_dataset(path, transform=v2.RandomHorizontalFlip(p=1.0))   # per sample: the ring
        context = "forkserver" if mode == "forkserver" else None
        dl = dlstore.loader(ds, 4, num_workers=2, multiprocessing_context=context)
        assert dl.backend == "ring", dl
        it = iter(dl)
        next(it)
        children = descendants(os.getpid())
        shm = sorted({line.split(None, 5)[5].strip() for pid in [os.getpid(), *children]
                      for line in open(f"/proc/{pid}/maps") if "/dev/shm/" in line})
        print(json.dumps({"children": children, "shm": shm}), flush=True)
        time.sleep(600)

    if __name__ == "__main__":
        path, mode = sys.argv[1], sys.argv[2]
        if mode == "file_system":
            torch.multiprocessing.set_sharing_strategy("file_system")   # named segments, torch_shm_manager's
        if mode == "thread":      # iterated in a thread: no parent-death signal, the workers poll
            threading.Thread(target=run, args=(path, mode), daemon=True).start()
            time.sleep(600)
        else:
            run(path, mode)
""")

HARNESS = textwrap.dedent("""
    import ctypes, json, os, signal, subprocess, sys, time
    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:      # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    sig, cmd = int(sys.argv[1]), sys.argv[2:]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    ready = json.loads(child.stdout.readline())
    children = [int(pid) for pid in ready["children"]]
    os.kill(child.pid, sig)
    child.wait()
    start, ended = time.monotonic(), {}
    while len(ended) < len(children) and time.monotonic() - start < 5:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            for other in set(children) - set(ended):    # a forkserver's child, reaped by the forkserver
                try:
                    state, ppid = open(f"/proc/{other}/stat").read().rsplit(")", 1)[1].split()[:2]
                except FileNotFoundError:
                    state, ppid = "gone", 0
                if state in ("gone", "Z") and int(ppid) != os.getpid():     # (ours: waitpid says how)
                    ended[other] = ["gone", round(time.monotonic() - start, 2)]
            time.sleep(0.01)
        elif pid in children:
            how = (f"signal {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status)
                   else f"exit {os.WEXITSTATUS(status)}")
            ended[pid] = [how, round(time.monotonic() - start, 2)]
    names = [n for n in ready["shm"] if not n.endswith(" (deleted)")]
    while any(os.path.exists(n) for n in names) and time.monotonic() - start < 5:
        time.sleep(0.01)
    left = [n for n in names if os.path.exists(n)]
    for pid in set(children) - set(ended):
        os.kill(pid, signal.SIGKILL)       # a failed case leaves nothing running either
    print(json.dumps({"ready": ready, "ended": {str(k): v for k, v in ended.items()}, "left": left}))
""")


@pytest.fixture(scope="module")
def store(rgb_folder, tmp_path_factory):
    return dlstore.convert(rgb_folder, tmp_path_factory.mktemp("lifeline") / "s.shards",
                           static="resize=36,center_crop=32", workers=0, progress=False).path


def _kill_the_main_process(store, tmp_path, sig: signal.Signals, mode: str) -> dict:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.run([sys.executable, "-c", HARNESS, str(int(sig)), sys.executable, str(script), str(store),
                           mode], check=False, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("sig, mode, how", [
    (signal.SIGTERM, "main", "signal SIGKILL"),     # the kernel's parent-death signal
    (signal.SIGKILL, "main", "signal SIGKILL"),
    (signal.SIGKILL, "file_system", "signal SIGKILL"),
    (signal.SIGKILL, "thread", "exit 0"),           # the worker saw its parent gone and returned
    (signal.SIGKILL, "forkserver", None),           # the same, the forkserver reaps them
])
def test_workers_and_shared_memory_go_with_the_main_process(store, tmp_path, sig, mode, how):
    got = _kill_the_main_process(store, tmp_path, sig, mode)
    children = got["ready"]["children"]              # the workers (and torch_shm_manager, file_system's)
    workers = [pid for pid, name in children.items() if name.startswith("python")]
    assert len(workers) == (4 if mode == "forkserver" else 2), got     # (+ the forkserver, its resource tracker)
    assert sorted(got["ended"]) == sorted(children), f"processes still alive 5 s after the main process: {got}"
    if how is not None:
        assert {got["ended"][pid][0] for pid in workers} == {how}, got
    assert got["ready"]["shm"], got               # the ring was mapped: there was something to free
    if mode == "file_system":                     # named until torch_shm_manager unlinks them
        assert any(not n.endswith(" (deleted)") for n in got["ready"]["shm"]), got
    assert got["left"] == [], f"/dev/shm files left after the processes: {got}"
