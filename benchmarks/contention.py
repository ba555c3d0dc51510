"""Every read path on a busy machine: samples/s quiet and under N CPU hogs, as ratios in one run.

A shared training node runs other work beside the loader (other ranks, other jobs, the
training loop itself). torch's intra-op pool collapses there: an op split over an
OpenMP team waits, at its barrier, for the team member the scheduler left off a core.
dlstore's read paths run their torch ops one thread per batch (``dlstore.data.intraop``);
this script measures what that buys, path by path:

    threads       dlstore.loader(ds, 64, shuffle=True): loader threads
    ring          ... num_workers=2: worker processes into the shared-memory ring
    dataloader    ... backend="dataloader", num_workers=0: batches in the main thread
    plain nw0     torch's DataLoader(ds, batch_size=64, shuffle=True) over open_dataset
                  (StoreDataset.__getitems__ + default_collate, in the main process)
    plain nw2     ... num_workers=2 (persistent)
    gpu-cpu       dlstore.loader(GPUDataset(path, device="cpu", dtype=uint8), 64, shuffle=True), no transform:
                  groups of batches gathered on the CPU; ``before`` as main built them (a GPU's 64 MiB, on
                  torch's intra-op pool), ``after`` as this branch does (8 MiB groups on one thread)

The store is raw 3x224x224 uint8 shards (page cache warm), read with
``RandomCrop(224, padding=4)`` + ``RandomHorizontalFlip()`` (fused into the gather)
and ``BatchCutout(32)`` after it (a torch op per batch): every path does the same work,
except ``plain``, which reads the samples as stored (no transform: its cost is the
collate). ``before`` runs each path as main does: the intra-op guard off
(``intraop.runtime`` patched to find no OpenMP runtime) and the batch transforms on their
torch kernels (``batch.numpy_view`` patched to refuse every batch), for ``plain nw0`` torch's
default thread count and for ``gpu-cpu`` main's group size; ``after`` is this branch, and
for ``plain nw0`` the one line docs/reading.md gives the user (``torch.set_num_threads(1)``),
which dlstore cannot set for a DataLoader it does not build.

Rounds interleave quiet and loaded (hogs started, measured, stopped), and every
configuration runs in each, in a shuffled order; the median of the rounds is printed, and
``loaded/quiet`` both as the ratio of the medians and as the median of per-round ratios
(``paired``: both sides seconds apart). A hog is a separate Python process spinning
(``while True: pass``, checking that this script runs) in this session, so the scheduler shares the cores between it and
this process's threads, as between the ranks of one job (``--apart``: in a session of its
own, as another job's, which Linux's autogroups give a share of its own). The machine may
be shared with other jobs as well: the load average is recorded before and after.

    python benchmarks/contention.py [--images 768] [--hogs 2] [--apart] [--rounds 5] [--seconds 1.5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader
from torchvision.transforms import v2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, uptime, write_json

import dlstore
from dlstore.data import intraop
from dlstore.data.loaders import resident as gpu_loader
from dlstore.transforms import batch, compiled
from dlstore.transforms.batch import BatchCutout

BATCH = 64
# A busy loop that ends with this script, however it ends (its parent checked every ~20 ms).
HOG = "import os, sys\nwhile os.getppid() == int(sys.argv[1]):\n    for _ in range(500_000): pass"
HERE = Path(__file__).resolve().parent


@contextmanager
def hogs(n: int, apart: bool = False):
    """``n`` busy-looping processes for the block (``apart``: in a session of their own)."""
    procs = [subprocess.Popen([sys.executable, "-c", HOG, str(os.getpid())], start_new_session=apart)
             for _ in range(n)]
    time.sleep(0.3)                           # let them reach the CPU
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


@contextmanager
def mode(before: bool, torch_threads: int | None = None):
    """``before``: the intra-op guard off (main's behaviour); ``torch_threads``: torch's count for the block."""
    saved_runtime, saved_view, saved_threads = intraop.runtime, batch.numpy_view, torch.get_num_threads()
    if before:
        intraop.runtime = lambda: None
        batch.numpy_view = lambda images: None
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    try:
        yield
    finally:
        intraop.runtime = saved_runtime
        batch.numpy_view = saved_view
        torch.set_num_threads(saved_threads)


def rate(loader: Iterable, seconds: float) -> float:
    """Samples/s of whole epochs over ``loader`` for at least ``seconds``."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for images, _ in loader:
            n += len(images)
    return n / (time.perf_counter() - t0)


def configs(store: Path) -> dict[str, tuple[Callable[[], Iterable], dict]]:
    """name -> (make the loader, mode()'s arguments)."""
    aug = v2.Compose([v2.RandomCrop(224, padding=4), v2.RandomHorizontalFlip()])
    ds = dlstore.open_dataset(store, transform=aug, batch_transform=BatchCutout(32))
    plain = dlstore.open_dataset(store)
    gen = torch.Generator().manual_seed(0)

    def threads():
        return dlstore.loader(ds, BATCH, shuffle=True)

    def ring():
        return dlstore.loader(ds, BATCH, shuffle=True, num_workers=2, persistent_workers=True)

    def dataloader():
        return dlstore.loader(ds, BATCH, shuffle=True, backend="dataloader")

    def plain_nw0():
        return DataLoader(plain, batch_size=BATCH, shuffle=True, generator=gen)

    def plain_nw2():
        return DataLoader(plain, batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True)

    out = {
        "threads before": (threads, {"before": True}),
        "threads after": (threads, {"before": False}),
        "ring after": (ring, {"before": False}),
        "dataloader before": (dataloader, {"before": True}),
        "dataloader after": (dataloader, {"before": False}),
        "plain nw0 before": (plain_nw0, {"before": True}),
        "plain nw0 after": (plain_nw0, {"before": False, "torch_threads": 1}),
        "plain nw2 after": (plain_nw2, {"before": False}),
    }
    gpu = dlstore.GPUDataset(store, device="cpu", dtype=torch.uint8)

    def gpu_cpu():
        return dlstore.loader(gpu, BATCH, shuffle=True)

    def gpu_cpu_main():   # main's groups on the CPU: a GPU's 64 MiB (mmap'd, faulted in afresh each time)
        loader = gpu_cpu()
        loader.strategy.group_batches = max(1, gpu_loader.GROUP_BYTES // (int(np.prod(gpu.shape)) * BATCH))
        return loader

    out["gpu-cpu before"] = (gpu_cpu_main, {"before": True})
    out["gpu-cpu after"] = (gpu_cpu, {"before": False})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=768)
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--apart", action="store_true", help="hogs in a session of their own")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--only", default="", help="keep configurations whose name contains this")
    parser.add_argument("--out", default=str(HERE / "results" / "contention.json"))
    args = parser.parse_args()
    load_before = uptime()
    with tempfile.TemporaryDirectory(prefix="dlstore-contention-") as tmp:
        store = Path(tmp) / "s.shards"
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, (args.images, 3, 224, 224), dtype=np.uint8)
        dlstore.convert((images, np.arange(args.images) % 10), store, workers=0, progress=False)
        del images
        made = {name: (make(), kw) for name, (make, kw) in configs(store).items() if args.only in name}
        for loader, kw in made.values():          # warm: page cache, workers, numba's kernel
            with mode(**kw):
                rate(loader, 0.2)
        runs: dict[str, dict[str, list[float]]] = {name: {"quiet": [], "loaded": []} for name in made}
        order = random.Random(0)
        for r in range(args.rounds):
            for load in ("quiet", "loaded"):
                names = list(made)
                order.shuffle(names)
                with hogs(args.hogs if load == "loaded" else 0, args.apart):
                    for name in names:
                        loader, kw = made[name]
                        with mode(**kw):
                            runs[name][load].append(rate(loader, args.seconds))
            print(f"round {r + 1}/{args.rounds} done  {os.getloadavg()[0]:.2f}", flush=True)
        for loader, _ in made.values():
            close = getattr(loader, "close", None)
            if close is not None:
                close()
    results = {}
    print(f"\n{'path':<20} {'quiet':>9} {'loaded':>9} {'loaded/quiet':>13} {'paired':>7}")
    for name, r in runs.items():
        quiet, loaded = statistics.median(r["quiet"]), statistics.median(r["loaded"])
        paired = statistics.median(b / a for a, b in zip(r["quiet"], r["loaded"]))
        results[name] = {"quiet": quiet, "loaded": loaded, "ratio": loaded / quiet, "paired": paired, "runs": r}
        print(f"{name:<20} {quiet:>9.0f} {loaded:>9.0f} {loaded / quiet:>13.2f} {paired:>7.2f}")
    load_after = uptime()
    print(f"\nload before: {load_before}\nload after:  {load_after}")
    payload = {"args": vars(args), "machine": machine_info(), "load_before": load_before, "load_after": load_after,
               "compiled": compiled.available(), "torch_threads": torch.get_num_threads(),
               "omp_runtime": intraop.runtime() is not None, "results": results}
    print(f"wrote {write_json(args.out, payload)}")
    md = Path(args.out).with_suffix(".md")
    md.write_text(report(payload))
    print(f"wrote {md}")


def report(payload: dict) -> str:
    """The run as a short markdown table (samples/s, medians of the rounds)."""
    a = payload["args"]
    lines = [f"# contention: {a['hogs']} CPU hogs ({'own session' if a['apart'] else 'same session'}), "
             f"{a['rounds']} rounds x {a['seconds']} s, {a['images']} samples 3x224x224 shards, batch {BATCH}", "",
             f"load before: {payload['load_before']}  ", f"load after: {payload['load_after']}  ",
             f"numba kernel: {payload['compiled']}; OpenMP runtime found: {payload['omp_runtime']}; "
             f"torch threads: {payload['torch_threads']}", "",
             "| path | quiet (samples/s) | loaded | loaded/quiet | paired |", "|---|---|---|---|---|"]
    for name, r in payload["results"].items():
        lines.append(f"| {name} | {r['quiet']:.0f} | {r['loaded']:.0f} | {r['ratio']:.2f} | {r['paired']:.2f} |")
    pairs = [(n[:-len(" before")], n) for n in payload["results"] if n.endswith(" before")]
    lines += ["", "| path | after/before quiet | after/before loaded |", "|---|---|---|"]
    for path, before in pairs:
        b, r = payload["results"][before], payload["results"].get(f"{path} after")
        if r is not None:
            lines.append(f"| {path} | {r['quiet'] / b['quiet']:.1f}x | {r['loaded'] / b['loaded']:.1f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
