"""The price of the integrity check on read: ``open_dataset(check=...)`` against no check.

Converts one folder of small images (``--images`` of 160x120, ``center_crop=112``) to
every format, then, for each format and mode, times what a training process pays:
opening the dataset and reading one epoch of every sample in random order, two ways:
one sample at a time (``ds.reader.get``) and in batches of 64 (``ds.read_batch``, the
gather into one array that ``dlstore.loader`` does). ``check="open"`` hashes each data
file once per process (LMDB, HDF5: the whole file against its seal, at open; shards:
each data file when first mapped), so the first epoch carries that cost and later ones
do not; ``check="sample"`` computes a CRC32 of every sample read, every epoch. The
script reports the first epoch (open included) and a second one.

Note on shards ``get``: with no check it returns a view of the memory map and touches no
pixel, so a per-sample check there is compared with doing nothing; the batch columns
(which copy every sample) are the fair comparison for a training loop.

All modes are measured in the same process, interleaved per repeat, and reported
as ratios to ``check="none"`` (this machine is shared and noisy). The stores were
just written, so they are in the page cache: the ratios compare CPU work (sha256
against copying samples out), not disks.

    python benchmarks/integrity.py [--images 600] [--repeats 5] [--out benchmarks/results/integrity.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, uptime, write_json  # noqa: E402

import dlstore  # noqa: E402
from dlstore.sources.demo import make_image_folder  # noqa: E402

FORMATS = {"shards": "s.shards", "lmdb": "s.lmdb", "hdf5": "s.h5"}
MODES = ("none", "open", "sample")
BATCH = 64


def _epoch(path: Path, check: str, order: np.ndarray, epochs: int, batched: bool) -> list[float]:
    """Seconds of [open + first epoch, second epoch, ...] for one fresh dataset."""
    start = time.perf_counter()
    ds = dlstore.open_dataset(path, check=check)
    times = []
    for _ in range(epochs):
        if batched:
            for k in range(0, len(order), BATCH):
                ds.read_batch(order[k:k + BATCH])
        else:
            for i in order.tolist():
                ds.reader.get(i)
        now = time.perf_counter()
        times.append(now - start)
        start = now
    del ds
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "integrity.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = make_image_folder(tmp / "images", classes=4, per_class=max(1, args.images // 4), size=(120, 160))
        stores = {}
        for fmt, name in FORMATS.items():
            stores[fmt] = tmp / name
            dlstore.convert(src, stores[fmt], static="center_crop=112", workers=0, progress=False,
                            **({"shard_size": 8 << 20} if fmt == "shards" else {}))
        n = len(dlstore.open_dataset(stores["shards"]))
        order = np.random.default_rng(0).permutation(n)
        ways = ("get", "batch")
        runs = {(fmt, way): {mode: {"first": [], "second": []} for mode in MODES} for fmt in FORMATS for way in ways}
        load_before = uptime()
        for _ in range(args.repeats):
            for fmt in FORMATS:
                for way in ways:
                    for mode in MODES:  # interleaved: drift in machine load hits every mode alike
                        first, second = _epoch(stores[fmt], mode, order, epochs=2, batched=way == "batch")
                        runs[fmt, way][mode]["first"].append(n / first)
                        runs[fmt, way][mode]["second"].append(n / second)
        load_after = uptime()
        sizes = {fmt: sum(p.stat().st_size for p in ([path] if path.is_file() else path.rglob("*")))
                 for fmt, path in stores.items()}

    results = {}
    print(f"uptime before: {load_before}")
    print(f"uptime after:  {load_after}")
    print(f"{n} samples of 3x112x112 uint8, random order, median of {args.repeats} (samples/s); "
          f"get = one sample at a time, batch = read_batch of {BATCH}")
    print(f"{'format':8} {'read':6} {'mode':6} {'open+epoch 1':>14} {'ratio':>7} {'epoch 2':>10} {'ratio':>7}")
    for fmt, way in runs:
        base_first = statistics.median(runs[fmt, way]["none"]["first"])
        base_second = statistics.median(runs[fmt, way]["none"]["second"])
        for mode in MODES:
            first = statistics.median(runs[fmt, way][mode]["first"])
            second = statistics.median(runs[fmt, way][mode]["second"])
            results[f"{fmt}/{way}/{mode}"] = {
                "first_epoch_samples_per_s": first, "first_epoch_ratio_to_none": first / base_first,
                "second_epoch_samples_per_s": second, "second_epoch_ratio_to_none": second / base_second,
                "runs": runs[fmt, way][mode],
            }
            print(f"{fmt:8} {way:6} {mode:6} {first:14,.0f} {first / base_first:7.2f} {second:10,.0f} "
                  f"{second / base_second:7.2f}")
    path = write_json(args.out, {"machine": machine_info(), "images": n, "store_bytes": sizes,
                                 "repeats": args.repeats, "batch": BATCH, "uptime_before": load_before,
                                 "uptime_after": load_after, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
