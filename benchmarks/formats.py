"""Store formats side by side: conversion time, size on disk and read throughput.

Generates one folder of ImageNet-sized JPEGs (500x375), converts it with
``resize=256,center_crop=224`` to every format (shards, LMDB, HDF5, and HDF5
with lzf compression), then reads torchvision ``ImageFolder`` (same transforms)
and each store through a DataLoader (batch 64, random order, num_workers=0), all
in the same process, and prints samples/s with the ratio to ImageFolder.
Targets (issue 3): LMDB >= 50x, HDF5 >= 20x ImageFolder.

torch runs with one intra-op thread (``--threads``), as in DataLoader workers.
The stores are read right after being written, so their pages are in the OS
page cache (as they are from the second epoch on when the store fits in RAM);
ImageFolder's JPEGs are cached the same way. The ratios therefore compare CPU
work per sample, not disks (``dlstore bench`` measures a given disk).

    python benchmarks/formats.py [--images 300] [--repeats 5] [--out benchmarks/results/formats.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.transforms import v2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, write_json  # noqa: E402

import dlstore  # noqa: E402
from dlstore.sources.demo import make_image_folder  # noqa: E402

STATIC = "resize=256,center_crop=224"
TARGETS = {"lmdb": 50.0, "hdf5": 20.0}
# name -> (destination file name, convert options)
STORES = {
    "shards": ("s.shards", {}),
    "lmdb": ("s.lmdb", {}),
    "hdf5": ("s.h5", {}),
    "hdf5 lzf": ("lzf.h5", {"compression": "lzf"}),
}


def epoch(dataset) -> int:
    loader = DataLoader(dataset, batch_size=64, shuffle=True, num_workers=0)
    return sum(len(y) for _, y in loader)


def _fix_malloc() -> None:
    """Stop glibc from returning freed batch-sized blocks to the OS after every batch.

    By default glibc serves an allocation above a dynamic threshold with a fresh mmap
    and trims the heap on free, so a new 9.6 MB batch can page-fault on every page,
    every batch (measured: up to ~35 us of kernel time per sample, varying with the
    allocation history of the process). Fixing the thresholds removes that variance.
    """
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 256 << 20)):
        raise RuntimeError("mallopt failed: --fixed-malloc needs glibc")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=300, help="JPEGs to generate (10 classes)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (each loader once per round)")
    parser.add_argument("--store-epochs", type=int, default=10,
                        help="epochs per timed run of a store (ImageFolder: 1), so runs last long enough to time")
    parser.add_argument("--workers", type=int, default=None, help="conversion processes (default: usable CPUs)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1, what each DataLoader worker uses)")
    parser.add_argument("--fixed-malloc", action="store_true",
                        help="fix glibc's mmap/trim thresholds (32 MiB / 256 MiB) before measuring, "
                             "as MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ would")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "formats.json"))
    args = parser.parse_args()
    # The collate copy (torch.stack) is the largest cost of a store epoch; with several
    # intra-op threads on a small machine shared with other processes it slowed ~10x
    # (threads spin at barriers while descheduled). DataLoader workers run 1 thread each.
    torch.set_num_threads(args.threads)
    if args.fixed_malloc:
        _fix_malloc()

    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="dlstore-bench-") as tmp:
        folder = make_image_folder(Path(tmp) / "images", classes=10, per_class=max(1, args.images // 10))
        source_bytes = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        loaders = {"ImageFolder": datasets.ImageFolder(str(folder), transform=v2.Compose(
            [v2.Resize(256), v2.CenterCrop(224), v2.PILToTensor()]))}
        rows["ImageFolder"] = {"bytes": source_bytes, "convert_seconds": None, "epochs_per_run": 1}
        for name, (file_name, options) in STORES.items():
            t0 = time.perf_counter()
            result = dlstore.convert(folder, Path(tmp) / file_name, static=STATIC, workers=args.workers,
                                     progress=False, **options)
            rows[name] = {"bytes": result.nbytes, "convert_seconds": time.perf_counter() - t0,
                          "workers": result.workers, "epochs_per_run": args.store_epochs}
            loaders[name] = dlstore.open_dataset(result.path)
        # Rounds: every loader runs once per round, so load from other processes on a shared
        # machine hits all of them alike; the spread over rounds is reported.
        runs: dict[str, list[float]] = {name: [] for name in loaders}
        cpu_runs: dict[str, list[float]] = {name: [] for name in loaders}
        for name, ds in loaders.items():
            epoch(ds)  # warm-up: page cache, lazily opened handles, allocator
        for _ in range(args.repeats):
            for name, ds in loaders.items():
                epochs = rows[name]["epochs_per_run"]
                start, cpu_start = time.perf_counter(), time.process_time()
                seen = sum(epoch(ds) for _ in range(epochs))
                runs[name].append(seen / (time.perf_counter() - start))
                cpu_runs[name].append(seen / (time.process_time() - cpu_start))
        count = len(loaders["ImageFolder"])
        for name, rates in runs.items():
            rows[name]["read"] = {"median": statistics.median(rates), "min": min(rates), "max": max(rates),
                                  "runs": rates}
            # Ratio within each round (same machine load), then its spread over rounds.
            rows[name]["ratio_runs"] = [r / b for r, b in zip(rates, runs["ImageFolder"])]
            # Samples per CPU-second of this process: what other processes' load cannot inflate.
            cpu = cpu_runs[name]
            rows[name]["read_cpu"] = {"median": statistics.median(cpu), "min": min(cpu), "max": max(cpu),
                                      "runs": cpu}
        del loaders

    base = rows["ImageFolder"]["read"]["median"]
    print(f"{count} JPEGs 500x375 -> {STATIC}; read: DataLoader batch 64, shuffled, num_workers=0, "
          f"{args.threads} torch thread(s), {'fixed' if args.fixed_malloc else 'default'} malloc thresholds; "
          f"median, min, max over {args.repeats} rounds (a run: 1 epoch of ImageFolder, {args.store_epochs} of a store)")
    print(f"{'':14s} {'convert s':>9s} {'size MiB':>9s} {'samples/s':>10s} {'min':>9s} {'max':>9s} "
          f"{'vs ImageFolder':>15s} {'per round':>13s} {'per CPU-s':>10s} {'CPU ratio':>9s}")
    for name, row in rows.items():
        read = row["read"]
        row["ratio"] = read["median"] / base
        row["cpu_ratio"] = row["read_cpu"]["median"] / rows["ImageFolder"]["read_cpu"]["median"]
        conv = "-" if row["convert_seconds"] is None else f"{row['convert_seconds']:.1f}"
        target = TARGETS.get(name)
        verdict = "" if target is None else f"  (target >= {target:.0f}x: {'met' if row['ratio'] >= target else 'NOT met'})"
        spread = f"{min(row['ratio_runs']):.0f}-{max(row['ratio_runs']):.0f}x"
        print(f"{name:14s} {conv:>9s} {row['bytes'] / 2**20:9.1f} {read['median']:10,.0f} {read['min']:9,.0f} "
              f"{read['max']:9,.0f} {row['ratio']:14,.1f}x {spread:>13s} {row['read_cpu']['median']:10,.0f} "
              f"{row['cpu_ratio']:8,.1f}x{verdict}")
    path = write_json(args.out, {
        "benchmark": "formats", "machine": machine_info(),
        "data": {"images": count, "source_size": [375, 500], "static": STATIC, "sample_bytes": 3 * 224 * 224,
                 "loader": {"batch_size": 64, "shuffle": True, "num_workers": 0}, "repeats": args.repeats,
                 "store_epochs_per_run": args.store_epochs, "torch_threads": torch.get_num_threads(),
                 "fixed_malloc": args.fixed_malloc},
        "results": rows, "targets": TARGETS,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
