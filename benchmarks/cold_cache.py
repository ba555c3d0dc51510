"""Cold page cache, random order: how much of the disk's sequential rate each format and read path gets.

For each format (shards, LMDB, HDF5), interleaved in a shuffled order within each round:

* sequential: the store's data files read front to back in 8 MiB reads, 4 in flight (the disk's rate);
* a cold random epoch (every sample once, shuffled) through each read path, with the
  readers' ``willneed`` off (before) and on (after):
    threads  ``dlstore.loader(ds, batch_size, shuffle=True, backend="threads", num_threads=2)``
    ring     ``dlstore.loader(ds, batch_size, shuffle=True, num_workers=2, backend="ring")``
    dl0/dl2  ``torch.utils.data.DataLoader(ds, batch_size, shuffle=True, num_workers=0/2)``
             over ``open_dataset(path)`` (its ``__getitems__`` and the default collate)

Each measurement runs in a fresh process after ``sync; echo 1 > /proc/sys/vm/drop_caches``
(root), and the store's residency is checked (mincore) before it starts. The epoch is timed
from the first ``iter()`` to the last batch (worker start-up included). Children run with
``torch.set_num_threads(1)``, as torchrun sets it: the intra-op pool's collapse on a busy
machine is another benchmark's subject (``contention.py``). Samples/s; the ratio is to the
disk's sequential rate in the same round: the best of the round's three sequential reads
(the stores hold the same bytes; this VM's disk reads same-size files 1-3x apart, and its
rate drifts between rounds), the median over the rounds of those per-round ratios. The
machine is shared: the load average is recorded beside every measurement, and the rounds
are interleaved.

A warm section times, per format, random epochs with ``willneed`` off and on in turn in
one process once the store is cached: what the advice costs where it is not needed.

Epochs are long enough that worker start-up is a small part of them: a DataLoader or ring with
2 workers takes ~0.15 s to its first batch here, half of a warm 2,000-sample epoch (the default
was 2,000 until that showed).

    python benchmarks/cold_cache.py [--images 8000] [--rounds 5] [--dir /var/tmp]
        [--formats shards,lmdb --paths dl0 --warm-epochs 0]   # a few cells, more rounds
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from _common import machine_info, uptime, write_json

FORMATS = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}
PATHS = ("threads", "ring", "dl0", "dl2")


def data_files(store: Path) -> list[Path]:
    if store.suffix == ".shards":
        return sorted(store.glob("shard-*.npy"))
    return [store / "data.mdb"] if store.suffix == ".lmdb" else [store]


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


# --- what a child process measures -------------------------------------------------------

def child_sequential(store: Path, count: int, in_flight: int = 4) -> float:
    """The store's files read front to back in 8 MiB pieces, ``in_flight`` of them at a time (one
    stream of reads left this VM's disk idle between them: random epochs with many reads in flight
    beat it by 2x)."""
    from concurrent.futures import ThreadPoolExecutor

    piece = 8 << 20
    jobs = [(f, offset) for f in data_files(store) for offset in range(0, f.stat().st_size, piece)]
    fds = {f: os.open(f, os.O_RDONLY) for f in data_files(store)}
    local = threading.local()

    def read(k: int) -> None:
        if not hasattr(local, "buffer"):
            local.buffer = bytearray(piece)       # one per thread
        f, offset = jobs[k]
        os.preadv(fds[f], [local.buffer], offset)

    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(in_flight) as pool:
            list(pool.map(read, range(len(jobs))))
        return count / (time.perf_counter() - start)
    finally:
        for fd in fds.values():
            os.close(fd)


def make_loader(ds, path: str, batch_size: int, seed: int):
    import torch

    import dlstore

    g = torch.Generator().manual_seed(seed)
    if path == "threads":
        return dlstore.loader(ds, batch_size=batch_size, shuffle=True, backend="threads", num_threads=2, generator=g)
    if path == "ring":
        return dlstore.loader(ds, batch_size=batch_size, shuffle=True, num_workers=2, backend="ring", generator=g)
    workers = {"dl0": 0, "dl2": 2}[path]
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers, generator=g)


def epoch_rate(loader) -> float:
    n, start = 0, time.perf_counter()
    for images, _labels in loader:
        n += len(images)
    return n / (time.perf_counter() - start)


def child_random(store: Path, path: str, willneed: bool, batch_size: int, seed: int) -> float:
    import dlstore

    ds = dlstore.open_dataset(store, reader_options={"willneed": willneed})
    return epoch_rate(make_loader(ds, path, batch_size, seed))


def child_warm(store: Path, batch_size: int, epochs: int) -> dict[str, float]:
    import dlstore

    sets = {w: dlstore.open_dataset(store, reader_options={"willneed": w}) for w in (False, True)}
    epoch_rate(make_loader(sets[False], "threads", batch_size, 0))    # warms the page cache
    rates: dict[bool, list[float]] = {False: [], True: []}
    for e in range(epochs):
        for w in ((False, True) if e % 2 == 0 else (True, False)):
            rates[w].append(epoch_rate(make_loader(sets[w], "threads", batch_size, e)))
    return {"off": statistics.median(rates[False]), "on": statistics.median(rates[True])}


def child(argv: list[str]) -> None:
    """Import everything first, say "ready", wait for "go" (the parent drops the cache in between)."""
    import torch
    import torch.utils.data

    import dlstore
    import dlstore.data.loaders.shm_ring  # noqa: F401 - imported before the cache is dropped
    import dlstore.data.loaders.threads  # noqa: F401
    import dlstore.formats.hdf5  # noqa: F401
    import dlstore.formats.lmdb  # noqa: F401
    import dlstore.formats.shards  # noqa: F401

    torch.set_num_threads(1)
    dlstore.open_dataset   # (resolves the lazy attribute)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    kind, store = argv[0], Path(argv[1])
    if kind == "sequential":
        result = child_sequential(store, int(argv[2]))
    elif kind == "warm":
        result = child_warm(store, int(argv[2]), int(argv[3]))
    else:
        result = child_random(store, kind, argv[2] == "1", int(argv[3]), int(argv[4]))
    print(json.dumps(result))


# --- the parent: stores, rounds, report --------------------------------------------------

def run_child(args: list[str], before=None) -> tuple[object, object]:
    """Start a fresh process for one measurement; once it has imported what it needs, run ``before``
    (drop the cache), then let it measure. (its result, what ``before`` returned)"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, __file__, "--child", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ready = proc.stdout.readline().strip()
    got = before() if before is not None and ready == "ready" else None
    out, err = proc.communicate("go\n")
    if proc.returncode != 0 or ready != "ready":
        raise RuntimeError(f"child {args} failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1]), got


def cells(formats=tuple(FORMATS), paths=PATHS) -> list[tuple[str, str, bool]]:
    """(format, path, willneed); path "sequential" has no willneed."""
    out = [(fmt, "sequential", False) for fmt in formats]
    out += [(fmt, path, w) for fmt in formats for path in paths for w in (False, True)]
    return out


def cell_name(fmt: str, path: str, willneed: bool) -> str:
    return f"{fmt} {path}" + ("" if path == "sequential" else f" willneed={'on' if willneed else 'off'}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8000)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warm-epochs", type=int, default=4)
    parser.add_argument("--dir", default="/var/tmp", help="where the stores go (a disk, not tmpfs)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="a subset, to measure a few cells more often")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--out", default=None, help="default: results/cold_cache.json, or for a subset of "
                        "formats or paths results/cold_cache_<paths>_<formats>.json (the full table stays)")
    args = parser.parse_args(argv)
    args.formats, args.paths = args.formats.split(","), args.paths.split(",")
    if not set(args.formats) <= set(FORMATS) or not set(args.paths) <= set(PATHS) \
            or len(set(args.formats)) < len(args.formats) or len(set(args.paths)) < len(args.paths):
        parser.error(f"--formats takes {', '.join(FORMATS)}; --paths takes {', '.join(PATHS)} (each once)")
    if args.out is None:
        subset = args.formats != list(FORMATS) or args.paths != list(PATHS)
        name = f"cold_cache_{'-'.join(args.paths)}_{'-'.join(args.formats)}" if subset else "cold_cache"
        args.out = str(Path(__file__).parent / "results" / f"{name}.json")
    if os.geteuid() != 0:
        print("needs root (echo 1 > /proc/sys/vm/drop_caches before each cold read)", file=sys.stderr)
        return 2

    import dlstore
    from dlstore.tools.bench.probes import resident_fraction

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        images = np.random.default_rng(0).integers(0, 256, (args.images, args.size, args.size, 3), dtype=np.uint8)
        stores = {}
        for fmt in args.formats:
            stores[fmt] = Path(tmp) / f"cold{FORMATS[fmt]}"
            dlstore.convert((images, np.arange(args.images) % 10), stores[fmt], workers=0, progress=False)
        del images
        mb = {fmt: sum(f.stat().st_size for f in data_files(s)) / 1e6 for fmt, s in stores.items()}
        args.read_paths = {fmt: dlstore.open_dataset(s).reader.read_path for fmt, s in stores.items()}
        print(f"stores: {args.images} x 3x{args.size}x{args.size}, " +
              ", ".join(f"{fmt} {v:,.0f} MB ({args.read_paths[fmt]})" for fmt, v in mb.items()) + f"; {uptime()}",
              flush=True)
        runs: dict[str, list[dict]] = {cell_name(*c): [] for c in cells(args.formats, args.paths)}
        warm: dict[str, list[dict]] = {fmt: [] for fmt in args.formats if args.warm_epochs}
        for r in range(args.rounds):
            order = cells(args.formats, args.paths)
            random.Random(r).shuffle(order)
            for fmt, path, willneed in order:
                def cold(store=stores[fmt]):
                    drop_caches()
                    return resident_fraction(store), os.getloadavg()[0]
                child_args = ([path, str(stores[fmt]), str(args.images)] if path == "sequential" else
                              [path, str(stores[fmt]), "1" if willneed else "0", str(args.batch_size), str(r)])
                rate, (left, load) = run_child(child_args, before=cold)
                runs[cell_name(fmt, path, willneed)].append({"samples_per_s": rate, "load1": load,
                                                              "resident_before": left, "round": r})
            for fmt, measured in warm.items():
                measured.append(run_child(["warm", str(stores[fmt]), str(args.batch_size),
                                            str(args.warm_epochs)])[0])
            print(f"round {r + 1}/{args.rounds} done; {uptime()}", flush=True)
    report(args, runs, warm)
    return 0


def disk_rates(runs: dict[str, list[dict]], formats) -> dict[int, float]:
    """Per round, the disk's sequential rate: the best of that round's sequential reads."""
    best: dict[int, float] = {}
    for fmt in formats:
        for x in runs[cell_name(fmt, "sequential", False)]:
            best[x["round"]] = max(best.get(x["round"], 0.0), x["samples_per_s"])
    return best


def report(args: argparse.Namespace, runs: dict[str, list[dict]], warm: dict[str, list[dict]]) -> None:
    med = {name: statistics.median(x["samples_per_s"] for x in v) for name, v in runs.items()}
    disk = disk_rates(runs, args.formats)

    def ratio(name: str) -> float:   # the median over rounds of the cell's rate / the round's disk rate
        return statistics.median(x["samples_per_s"] / disk[x["round"]] for x in runs[name])

    rows, table = [], {}
    for fmt in args.formats:
        seq = med[cell_name(fmt, "sequential", False)]
        for path in args.paths:
            off, on = med[cell_name(fmt, path, False)], med[cell_name(fmt, path, True)]
            r_off, r_on = ratio(cell_name(fmt, path, False)), ratio(cell_name(fmt, path, True))
            table[f"{fmt} {path}"] = {"sequential": seq, "off": off, "on": on, "ratio_off": r_off,
                                      "ratio_on": r_on, "target": 0.6}
            rows.append(f"| {fmt} | {path} | {seq:,.0f} | {off:,.0f} | {on:,.0f} | {r_off:.2f} | {r_on:.2f} |")
    paired = []     # each format against shards in the same round: the disk's drift between rounds cancels
    for fmt in [f for f in args.formats if f != "shards" and "shards" in args.formats]:
        for path in args.paths:
            for w in (False, True):
                mine, theirs = runs[cell_name(fmt, path, w)], runs[cell_name("shards", path, w)]
                r = [x["samples_per_s"] / y["samples_per_s"] for x, y in zip(mine, theirs)]
                table.setdefault(f"{fmt} {path}", {})[f"over_shards_{'on' if w else 'off'}"] = statistics.median(r)
                paired.append(f"- {fmt} / shards, {path}, willneed {'on' if w else 'off'}: "
                              f"{statistics.median(r):.2f} (rounds {min(r):.2f}-{max(r):.2f})")
    warm_med = {fmt: {k: statistics.median(w[k] for w in v) for k in ("off", "on")} for fmt, v in warm.items()}
    loads = [x["load1"] for v in runs.values() for x in v]
    resident = max(x["resident_before"] for v in runs.values() for x in v)
    lines = [
        f"# Cold random epochs vs the disk's sequential rate ({args.images} samples 3x{args.size}x{args.size}, "
        f"batch {args.batch_size}, {args.rounds} rounds, medians)",
        "",
        f"Load average (1 min) at the measurements: median {statistics.median(loads):.2f}, "
        f"min {min(loads):.2f}, max {max(loads):.2f} (a shared machine: other jobs ran throughout). "
        f"Most of a store resident after dropping the cache: {resident:.3f}. {uptime()}",
        "",
        "The disk's sequential rate, per round (the best of the round's sequential reads, one per format): "
        + ", ".join(f"{v:,.0f}" for _, v in sorted(disk.items())) + " samples/s. The ratios are to it, "
        "round by round (medians); the format's own sequential median is shown beside them.",
        "",
        "| format | path | format's sequential/s | random/s willneed off | random/s willneed on | ratio off "
        "| ratio on |",
        "|---|---|---:|---:|---:|---:|---:|",
        *rows,
        *(["", "The same round's rates over shards' (medians over rounds):", "", *paired] if paired else []),
        *(["", "Warm (store cached), loader threads=2, random epochs, willneed on / off in one process:", "",
           *[f"- {fmt}: {w['on'] / w['off']:.2f}x ({w['off']:,.0f} -> {w['on']:,.0f} samples/s)"
             for fmt, w in warm_med.items()]] if warm_med else []),
    ]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    out = Path(args.out)
    write_json(out, {"machine": machine_info(), "uptime": uptime(), "config": vars(args), "runs": runs,
                     "median_samples_per_s": med, "disk_per_round": disk, "table": table, "warm": warm,
                     "warm_median": warm_med})
    out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    raise SystemExit(main())
