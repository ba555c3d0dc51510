"""A store bigger than the memory it is read in: sequential, full random and block shuffle epochs.

Each store (shards, LMDB, HDF5) is written once, in class order as a converted ImageFolder is. Then,
interleaved per round, every (format, order) epoch runs in a FRESH process inside its own
memory cgroup (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``), with the page cache dropped
first. The limit is a quarter of the store's bytes plus the reader process's own peak memory
(torch, dlstore, one batch: measured first, in a process of its own); the page cache the epoch
fills is charged to that cgroup, so only a quarter of the store can stay cached.

    sequential   dlstore.loader(ds, B, backend="threads")                 the reader's defaults
    sequential-ra  the same, reader_options={"readahead": True}           the kernel's own readahead
    random       dlstore.loader(ds, B, shuffle=True, backend="threads")   a full shuffle
    block        dlstore.loader(ds, B, sampler=BlockShuffleSampler(ds, seed=r), backend="threads")
                 (default block_size and window, sized inside the cgroup from what it leaves; a
                 window read is let go as the one after the next begins: ``release``, on here)
    block-keep   the same with release=False: read windows stay cached until evicted

Each process runs ``--epochs`` epochs (3): the first from a cold page cache, the later ones
with what the cgroup kept. An epoch stops after ``--max-seconds`` (45 s): a full random epoch can take many minutes here.
That stop favours sequential and block (the cache holds nothing useful to a random order at
the start), so the random rows are a lower bound of a full epoch's rate: 'epoch %' says how
much was read. Reported per epoch: samples/s, bytes the process read from the disk during the epoch
(``/proc/self/io``) per store byte, major faults. Ratios are to sequential of the same format, median over rounds.
Targets: block >= 0.8x the better of the two sequential epochs (the disk's best case), reading
<= 1.3x the store's bytes per epoch; the first epoch within 1.5x of the later ones. Then the randomness of block shuffle against a full shuffle,
for this store's layout and for an ImageNet-like one (1,281,167 samples in 1,000 class runs,
110 KB each, 8 ranks on a node with 64 GiB available).

Needs root (a writable cgroup, /proc/sys/vm/drop_caches); skips, saying why, elsewhere.

    python benchmarks/bigger_than_ram.py [--store-mb 1024] [--size 32] [--formats shards,lmdb] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, uptime, write_json  # noqa: E402

ORDERS = ("sequential", "sequential-ra", "random", "block", "block-keep")
CGROUP = Path("/sys/fs/cgroup")
TARGET = 0.8


# --- the memory cgroup ---------------------------------------------------------------------

def cgroup_kind(root: Path = CGROUP) -> tuple[str | None, str]:
    """("v2" | "v1" | None, why): which memory cgroup this process can create, or why none."""
    if (root / "cgroup.controllers").exists():
        if "memory" not in (root / "cgroup.controllers").read_text().split():
            return None, f"cgroup v2 at {root} has no memory controller"
        return ("v2", "") if os.access(root, os.W_OK) else (None, f"{root} is not writable (run as root)")
    if (root / "memory").is_dir():
        return ("v1", "") if os.access(root / "memory", os.W_OK) else (
            None, f"{root / 'memory'} is not writable (run as root)")
    return None, f"no memory cgroup under {root}"


class MemoryCgroup:
    """A fresh memory cgroup with a limit; ``join`` is a ``preexec_fn`` that moves the child into it."""

    def __init__(self, kind: str, name: str, limit: int, root: Path = CGROUP):
        self.kind = kind
        self.path = root / name if kind == "v2" else root / "memory" / name
        self.path.mkdir()
        limit_file = "memory.max" if kind == "v2" else "memory.limit_in_bytes"
        (self.path / limit_file).write_text(str(limit))
        if kind == "v2" and (self.path / "memory.swap.max").exists():
            (self.path / "memory.swap.max").write_text("0")
        self.limit = limit

    def join(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int | None:
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            try:
                return int((self.path / name).read_text())
            except (OSError, ValueError):
                continue
        return None

    def remove(self) -> None:
        for _ in range(50):   # the exited child's charge is moved to the parent asynchronously
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1")


# --- the child: one epoch in a fresh process -----------------------------------------------

def child(args: argparse.Namespace) -> None:
    import torch

    import dlstore

    torch.set_num_threads(1)
    ds = dlstore.open_dataset(args.store, reader_options={"readahead": True} if args.order == "sequential-ra" else None)
    sampler, info = None, {}
    if args.order in ("block", "block-keep"):
        sampler = dlstore.BlockShuffleSampler(ds, seed=args.seed, release=False if args.order == "block-keep" else None)
        info = {"block_size": sampler.block_size, "window": sampler.window, "release": sampler.release}
    dl = dlstore.loader(ds, args.batch_size, shuffle=args.order == "random", sampler=sampler, backend="threads",
                        num_threads=args.threads, generator=torch.Generator().manual_seed(args.seed))
    import resource

    def counters() -> tuple[int, int]:   # bytes this process had read from the disk, major faults
        io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        return int(io["read_bytes"]), resource.getrusage(resource.RUSAGE_SELF).ru_majflt

    epochs = []
    for epoch in range(1 if args.baseline else args.epochs):
        dl.set_epoch(epoch)
        before = counters()
        start, samples = time.perf_counter(), 0
        for k, (images, _) in enumerate(dl):
            samples += len(images)
            if args.baseline and k == 2 or time.perf_counter() - start > args.max_seconds:
                break
        seconds = time.perf_counter() - start
        after = counters()
        epochs.append({"samples": samples, "epoch_fraction": samples / len(ds), "seconds": seconds,
                       "rate": samples / seconds, "read_bytes": after[0] - before[0], "majflt": after[1] - before[1]})
    status = dict(line.split(":\t") for line in Path("/proc/self/status").read_text().splitlines() if ":\t" in line)
    print(json.dumps({"epochs": epochs, "hwm": int(status["VmHWM"].split()[0]) * 1024,
                      "read_path": ds.reader.read_path, **info}))


def run_child(store: Path, order: str, seed: int, args: argparse.Namespace, cgroup: MemoryCgroup | None,
              baseline: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--child", "--store", str(store), "--order", order, "--seed", str(seed),
           "--batch-size", str(args.batch_size), "--threads", str(args.threads), "--max-seconds", str(args.max_seconds),
           "--epochs", str(args.epochs)] + (["--baseline"] if baseline else [])
    load = os.getloadavg()[0]
    done = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=cgroup.join if cgroup else None)
    if done.returncode:
        raise RuntimeError(f"{order} epoch over {store} failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    first = result["epochs"][0]   # the fields of the first epoch at the top; every epoch in "epochs"
    return {**result, **first, "load1": load, "cgroup_peak": cgroup.peak() if cgroup else None}


# --- randomness of the order ---------------------------------------------------------------

def randomness(order: np.ndarray, labels: np.ndarray, batch: int, block_size: int) -> dict:
    """How far an epoch order is from the store's: displacement, lag-1 correlation of the
    indices, distinct classes and same-block pairs per batch."""
    n = len(order)
    batches = order[: n // batch * batch].reshape(-1, batch)
    blocks = batches // block_size
    same_block = np.mean([(np.unique(b, return_counts=True)[1] ** 2).sum() - batch for b in blocks[:2000]])
    return {"mean_displacement": float(np.abs(order - np.arange(n)).mean() / n),
            "lag1_corr": float(np.corrcoef(order[:-1], order[1:])[0, 1]),
            "classes_per_batch": float(np.mean([len(np.unique(labels[b])) for b in batches[:2000]])),
            "same_block_pairs_per_batch": float(same_block / 2)}


def randomness_table(layouts: dict[str, dict]) -> dict:
    from dlstore.data.order import block_shuffle

    out = {}
    for name, lay in layouts.items():
        n, batch = lay["n"], lay["batch"]
        labels = np.arange(n) * lay["classes"] // n
        full = np.random.default_rng(0).permutation(n)
        blocked = block_shuffle(n, lay["block_size"], lay["window"], seed=0)
        out[name] = {**lay, "full": randomness(full, labels, batch, lay["block_size"]),
                     "block": randomness(blocked, labels, batch, lay["block_size"])}
        for kind in ("full", "block"):
            r = out[name][kind]
            print(f"  {name:10s} {kind:6s} displacement {r['mean_displacement']:.3f} n, lag-1 corr "
                  f"{r['lag1_corr']:+.4f}, {r['classes_per_batch']:6.1f} classes / batch of {batch}, "
                  f"{r['same_block_pairs_per_batch']:7.2f} same-block pairs / batch")
    return out


# --- the parent ----------------------------------------------------------------------------

def build(root: Path, fmt: str, args: argparse.Namespace) -> tuple[Path, int]:
    import dlstore
    from dlstore.data.order import store_bytes

    sample = 3 * args.size * args.size
    n = args.store_mb * (1 << 20) // sample
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, args.size, args.size, 3), dtype=np.uint8)
    labels = np.arange(n) * args.classes // n          # class runs, as a converted ImageFolder
    store = root / f"big.{fmt}"
    t0 = time.perf_counter()
    dlstore.convert((images, labels), store, workers=0, progress=False)
    print(f"{fmt}: {n:,} samples of 3x{args.size}x{args.size}, {store_bytes(store) / 1e6:,.0f} MB, "
          f"written in {time.perf_counter() - t0:.0f} s", flush=True)
    return store, n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store-mb", type=int, default=1024)
    parser.add_argument("--size", type=int, default=32, help="samples are 3 x size x size uint8")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--formats", default="shards,lmdb,hdf5")
    parser.add_argument("--orders", default=",".join(ORDERS), help="the orders measured (sequential ones needed)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per process (the first is cold)")
    parser.add_argument("--limit-mb", type=int, default=None,
                        help="the cgroup's limit (default: a quarter of the store plus the reader's own peak); "
                             "0: no cgroup (the page cache dropped all the same)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-seconds", type=float, default=45.0,
                        help="an epoch stops after this long (the rate is of the part read)")
    parser.add_argument("--dir", default="/var/tmp", help="where the stores go (a disk, not tmpfs)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bigger_than_ram.json"))
    for name in ("--child", "--baseline"):
        parser.add_argument(name, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--order", choices=ORDERS, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    kind, why = cgroup_kind()
    if kind is None or not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        print(f"skipped: {why or '/proc/sys/vm/drop_caches is not writable (run as root)'}")
        return 0
    from dlstore.data.order import store_bytes

    started, load_before = time.perf_counter(), os.getloadavg()
    results: dict = {"benchmark": "bigger_than_ram", "machine": machine_info(), "args": vars(args),
                     "cgroup": kind, "load_before": load_before, "formats": {}}
    with tempfile.TemporaryDirectory(prefix="dlstore-btr-", dir=args.dir) as tmp:
        stores = {fmt: build(Path(tmp), fmt, args) for fmt in args.formats.split(",")}
        orders = tuple(o for o in ORDERS if o in args.orders.split(","))
        runs: dict = {fmt: {o: [] for o in orders} for fmt in stores}
        limits = {}
        for fmt, (store, n) in stores.items():
            size = store_bytes(store)
            base = run_child(store, "sequential", 0, args, None, baseline=True)
            limits[fmt] = size // 4 + base["hwm"] if args.limit_mb is None else args.limit_mb << 20
            results["formats"][fmt] = {"samples": n, "store_bytes": size, "baseline_hwm": base["hwm"],
                                       "limit": limits[fmt]}
            print(f"{fmt}: reader process peak {base['hwm'] / 1e6:.0f} MB; cgroup limit {limits[fmt] / 1e6:.0f} MB "
                  f"({size / limits[fmt]:.1f}x smaller than the store; {kind})", flush=True)
        for r in range(args.rounds):
            for fmt, (store, n) in stores.items():
                for order in orders[r % len(orders):] + orders[:r % len(orders)]:   # rotated: none always first
                    drop_caches()
                    group = (MemoryCgroup(kind, f"dlstore-btr-{os.getpid()}-{r}-{fmt}-{order}", limits[fmt])
                             if limits[fmt] else None)
                    try:
                        res = run_child(store, order, r, args, group)
                    finally:
                        if group is not None:
                            group.remove()
                    for e in res["epochs"]:
                        e["read_per_store_byte"] = e["read_bytes"] / results["formats"][fmt]["store_bytes"]
                    res["read_per_store_byte"] = res["epochs"][0]["read_per_store_byte"]
                    later = res["epochs"][1:] or res["epochs"]
                    res["later_rate"] = statistics.median(e["rate"] for e in later)
                    res["later_read_per_store_byte"] = statistics.median(e["read_per_store_byte"] for e in later)
                    runs[fmt][order].append(res)
                    extra = (f", block {res['block_size']} x window {res['window']}, release {res['release']}"
                             if order.startswith("block") else "")
                    print(f"round {r + 1} {fmt:6s} {order:13s} " + "; ".join(
                          f"{e['rate']:9,.0f}/s {e['read_per_store_byte']:5.2f}x read {e['majflt']:7,} majflt "
                          f"{100 * e['epoch_fraction']:3.0f}%" for e in res["epochs"]) +
                          f"; peak {(res['cgroup_peak'] or 0) / 1e6:5.0f} MB, load {res['load1']:.2f}{extra}", flush=True)
    print(f"\nfirst epoch (cold, fresh process) | later epochs (median of epochs 2..{args.epochs}), medians over rounds")
    print(f"{'':8s}{'order':14s}{'first/s':>10s}{'/ best seq':>11s}{'read/store':>11s}{'later/s':>10s}"
          f"{'/ best seq':>11s}{'read/store':>11s}{'first/later':>12s}")
    for fmt, by_order in runs.items():
        summary = {}
        best = {key: max(statistics.median(x[key] for x in by_order[o]) for o in ("sequential", "sequential-ra"))
                for key in ("rate", "later_rate")}
        for order, rs in by_order.items():
            rate, later = statistics.median(x["rate"] for x in rs), statistics.median(x["later_rate"] for x in rs)
            summary[order] = {"rate": rate, "ratio_to_best_sequential": rate / best["rate"],
                              "read_per_store_byte": statistics.median(x["read_per_store_byte"] for x in rs),
                              "later_rate": later, "later_ratio_to_best_sequential": later / best["later_rate"],
                              "later_read_per_store_byte": statistics.median(x["later_read_per_store_byte"] for x in rs),
                              "first_over_later": statistics.median(x["rate"] / x["later_rate"] for x in rs),
                              "load1": [min(x["load1"] for x in rs), max(x["load1"] for x in rs)], "runs": rs}
            row = summary[order]
            print(f"{fmt:8s}{order:14s}{rate:10,.0f}{row['ratio_to_best_sequential']:11.2f}"
                  f"{row['read_per_store_byte']:11.2f}{later:10,.0f}{row['later_ratio_to_best_sequential']:11.2f}"
                  f"{row['later_read_per_store_byte']:11.2f}{row['first_over_later']:12.2f}")
        if "block" in summary:
            summary["block"]["target"] = TARGET
            summary["block"]["meets_target"] = summary["block"]["ratio_to_best_sequential"] >= TARGET
            summary["block"]["later_meets_target"] = summary["block"]["later_ratio_to_best_sequential"] >= TARGET
        results["formats"][fmt]["orders"] = summary
    first = next(iter(runs.values())).get("block", [{"block_size": 1, "window": 1}])[0]
    fmt0, (_, n0) = next(iter(stores.items()))
    print("\nrandomness, block shuffle against a full shuffle (0.333 n displacement and 0 correlation: uniform):")
    results["randomness"] = randomness_table({
        "this store": {"n": n0, "classes": args.classes, "batch": args.batch_size,
                       "block_size": first["block_size"], "window": first["window"]},
        "imagenet": {"n": 1_281_167, "classes": 1000, "batch": 256, "block_size": round((4 << 20) / 110_000),
                     "window": int((64 << 30) * 0.25 / 8 // ((4 << 20)))},
    })
    results.update(total_s=time.perf_counter() - started, load_after=os.getloadavg(), uptime=uptime())
    print(f"\ntotal {results['total_s']:.0f} s; load before {load_before}, after {results['load_after']}")
    print(f"wrote {write_json(args.out, results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
