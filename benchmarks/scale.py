"""Memory and time of a conversion as the number of samples grows (10k, 50k, 200k tiny images).

    python benchmarks/scale.py [--sizes 10000 50000 200000] [--format shards] [--out benchmarks/results/scale.json]

A folder of tiny PNGs (8x8 RGB, 100 class folders) is written once for the
largest size (the file bytes come from a pool of 256 distinct encoded images,
so generating 200k files takes seconds); each smaller folder holds hard links
to a prefix of the same files. Each size is converted in a fresh subprocess
(decoding inline, ``workers=0``, so every byte the conversion holds lives in
that one process) which reports:

* ``peak_rss``: VmHWM of the process (peak resident memory, imports included);
* ``base_rss``: resident memory after the imports, before converting;
* ``scan_bytes``: memory growth from scanning the folder (the file list);
* the conversion time, per 1k samples; then the store is opened and every
  label read (the index a reader holds), and the peak is read again.

It prints the table and checks the targets: time and peak-RSS growth per
sample at most linear (the per-1k time at the largest size within 1.5x of the
smallest's; the RSS growth per sample from the middle size to the largest no
larger than 1.5x of that from the smallest to the middle), peak RSS under 1 GiB.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLASSES = 100


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def make_folder(root: Path, n: int) -> None:
    """``n`` tiny PNGs in CLASSES class folders."""
    import numpy as np
    from PIL import Image

    from dlstore.sources.demo import synthetic_image

    pool = []
    for k in range(256):
        buf = io.BytesIO()
        Image.fromarray(synthetic_image(k % CLASSES, k, (8, 8))).save(buf, format="PNG")
        pool.append(buf.getvalue())
    per_class = -(-n // CLASSES)
    written = 0
    for c in range(CLASSES):
        folder = root / f"c{c:03d}"
        folder.mkdir(parents=True)
        for i in range(min(per_class, n - written)):
            (folder / f"{i:07d}.png").write_bytes(pool[(c * 31 + i) % len(pool)])
            written += 1
    del np


def link_prefix(full: Path, root: Path, n: int, n_full: int) -> None:
    """A folder of ``n`` samples made of hard links to the first files of each class of ``full``."""
    per_class, per_full = -(-n // CLASSES), -(-n_full // CLASSES)
    written = 0
    for c in range(CLASSES):
        folder = root / f"c{c:03d}"
        folder.mkdir(parents=True)
        for i in range(min(per_class, n - written, per_full)):
            os.link(full / f"c{c:03d}" / f"{i:07d}.png", folder / f"{i:07d}.png")
            written += 1


def child(src: str, dst: str, fmt: str, static: str) -> None:
    import dlstore
    from dlstore.sources import scan

    base = _rss("VmRSS")
    before = _rss("VmRSS")
    source = scan(src)
    scan_bytes = _rss("VmRSS") - before
    del source
    start = time.perf_counter()
    result = dlstore.convert(src, dst, store_format=fmt, static=static, workers=0, progress=False)
    seconds = time.perf_counter() - start
    peak_convert = _rss("VmHWM")
    ds = dlstore.open_dataset(dst)
    labels = sum(int(x) for x in ds.targets[:10]) + len(ds.targets)
    json.dump({"count": result.count, "seconds": seconds, "base_rss": base, "scan_bytes": scan_bytes,
               "peak_rss_convert": peak_convert, "peak_rss": _rss("VmHWM"), "labels": labels,
               "store_bytes": result.nbytes}, sys.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 50_000, 200_000])
    parser.add_argument("--format", default="shards", choices=["shards", "lmdb", "hdf5"])
    parser.add_argument("--static", default="center_crop=8",
                        help="static spec; '' keeps each image's own size (a variable-shape store with an index)")
    parser.add_argument("--out", default="benchmarks/results/scale.json")
    parser.add_argument("--child", nargs=4, metavar=("SRC", "DST", "FORMAT", "STATIC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import machine_info

    sizes = sorted(args.sizes)
    suffix = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}[args.format]
    rows = []
    with tempfile.TemporaryDirectory(prefix="dlstore-scale-") as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        full = tmp / f"src{sizes[-1]}"
        make_folder(full, sizes[-1])
        print(f"wrote {sizes[-1]} tiny PNGs in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        for n in sizes:
            src = full if n == sizes[-1] else tmp / f"src{n}"
            if n != sizes[-1]:
                link_prefix(full, src, n, sizes[-1])
            dst = tmp / f"store{n}{suffix}"
            proc = subprocess.run([sys.executable, __file__, "--child", str(src), str(dst), args.format,
                                   args.static], capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise SystemExit(f"conversion of {n} samples failed:\n{proc.stderr}")
            row = {"samples": n, **json.loads(proc.stdout)}
            row["ms_per_1k"] = 1000 * row["seconds"] / n * 1000
            rows.append(row)
            print(f"{n:>8} samples: {row['ms_per_1k']:.0f} ms/1k, peak RSS {row['peak_rss'] / 2**20:.0f} MiB",
                  file=sys.stderr)
            shutil.rmtree(dst, ignore_errors=True)
            if n != sizes[-1]:
                shutil.rmtree(src)

    print(f"\nformat {args.format}, static {args.static!r}, decoding inline (workers=0)")
    print(f"{'samples':>8} {'ms/1k':>7} {'peak RSS':>9} {'base RSS':>9} {'peak-base':>10} {'B/sample':>9} "
          f"{'scan B/sample':>14}")
    for r in rows:
        grown = r["peak_rss"] - r["base_rss"]
        print(f"{r['samples']:>8} {r['ms_per_1k']:>7.0f} {r['peak_rss'] / 2**20:>7.0f}Mi {r['base_rss'] / 2**20:>7.0f}Mi "
              f"{grown / 2**20:>8.1f}Mi {grown / r['samples']:>9.0f} {r['scan_bytes'] / r['samples']:>14.0f}")
    lo, mid, hi = rows[0], rows[len(rows) // 2], rows[-1]
    time_ratio = hi["ms_per_1k"] / lo["ms_per_1k"]
    slope_lo = (mid["peak_rss"] - lo["peak_rss"]) / max(1, mid["samples"] - lo["samples"])
    slope_hi = (hi["peak_rss"] - mid["peak_rss"]) / max(1, hi["samples"] - mid["samples"])
    checks = {
        "time_per_1k_ratio_largest_vs_smallest": round(time_ratio, 3),
        "time_at_most_linear": time_ratio <= 1.5,
        "rss_bytes_per_sample_small_to_mid": round(slope_lo, 1),
        "rss_bytes_per_sample_mid_to_large": round(slope_hi, 1),
        "rss_at_most_linear": slope_hi <= 1.5 * max(slope_lo, 1.0) + 64,
        "peak_rss_under_1GiB": hi["peak_rss"] < 2**30,
    }
    print("\n" + "\n".join(f"  {k}: {v}" for k, v in checks.items()))
    report = {"benchmark": "scale", "machine": machine_info(), "format": args.format, "static": args.static,
              "workers": 0, "rows": rows, "checks": checks}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
