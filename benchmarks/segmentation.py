"""Segmentation loading: dlstore's stores against the torchvision Dataset users run today, in one run.

Data: ``_segdata.make_segmentation_set`` (shapes of four classes on photo crops, an ignore band),
``--images`` pairs of ``--size`` (default 256x320): RGB JPEGs (quality 90) and palette PNG masks.

The baseline is a segmentation ``Dataset`` as people write it: per sample, PIL opens the JPEG
(``.convert("RGB")``) and the PNG (``tv_tensors.Mask(np.array(...))``, indices kept), and one
torchvision v2 pipeline moves both::

    static  v2.Resize(R), v2.CenterCrop(C)                       (the part dlstore runs once, at conversion)
    random  v2.RandomCrop(S, padding=P, fill={tv_tensors.Image: 0, tv_tensors.Mask: 255}),
            v2.RandomHorizontalFlip()

in two orders, both torchvision's: ``pil`` runs the static part on the PIL image, then
``v2.ToImage()`` (the default backend of torchvision's segmentation references, and the pixels
dlstore stores), ``tensor`` runs ``v2.ToImage()`` first (the references' tensor backend).
Read through ``torch.utils.data.DataLoader(batch_size=64, shuffle=True, num_workers=W)``
(``persistent_workers`` when W > 0, which spares the baseline a worker start per epoch).

Beside it, every format (shards, LMDB, HDF5) converted with
``dlstore.convert(images, dst, masks=masks, static="resize=R,center_crop=C")`` and read with
``dlstore.loader(open_dataset(dst, transform=v2.Compose(random)), batch_size=64, shuffle=True,
num_workers=W, persistent_workers=W > 0)`` (W = 0 reads on threads in this process, W > 0 through
worker processes writing a shared-memory ring), and each store with no transform at 0 workers (the
static-only rate). Every configuration runs whole epochs for at least
``--seconds`` per round, round-robin over ``--rounds`` rounds (the order rotated each round), so
load from other processes on this shared machine hits all of them alike.

Printed: the median samples/s of each configuration, its ratio to the faster torchvision baseline
at the same worker count (the target of issue 40: >= 10x at 0 and 2 workers, every format),
the per-round ratio's range, and the bytes on disk (the store against the JPEG + PNG folder).
torch runs one intra-op thread in this process, as in a DataLoader worker. Stores are read right
after being written (page cache warm) and so are the files: the ratios compare CPU work.

    python benchmarks/segmentation.py [--images 512] [--size 256x320] [--resize 224] [--center-crop 224]
        [--crop 224] [--padding 16] [--workers 0,2] [--formats shards,lmdb,hdf5] [--rounds 3]
        [--seconds 2] [--torchvision-only] [--out benchmarks/results/segmentation.json]
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
from torchvision import tv_tensors
from torchvision.transforms import v2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, uptime, write_json  # noqa: E402
from _segdata import CLASSES, IGNORE, PairFolder, make_segmentation_set  # noqa: E402

import dlstore  # noqa: E402

TARGET = 10.0
FORMATS = {"shards": "seg.shards", "lmdb": "seg.lmdb", "hdf5": "seg.h5"}
BACKENDS = ("pil", "tensor")


def random_ops(crop: int, padding: int) -> list[v2.Transform]:
    return [v2.RandomCrop(crop, padding=padding, fill={tv_tensors.Image: 0, tv_tensors.Mask: IGNORE}),
            v2.RandomHorizontalFlip()]


def baseline_pipeline(backend: str, args: argparse.Namespace, *, random: bool = True) -> v2.Compose:
    static = [v2.Resize(args.resize), v2.CenterCrop(args.center_crop)]
    ops = static + [v2.ToImage()] if backend == "pil" else [v2.ToImage()] + static
    return v2.Compose(ops + (random_ops(args.crop, args.padding) if random else []))


def static_spec(args: argparse.Namespace) -> str:
    return f"resize={args.resize},center_crop={args.center_crop}"


def epoch(loader) -> int:
    """One pass; the samples it gave."""
    seen = 0
    for images, masks in loader:
        seen += len(images)
    return seen


def check_batch(name: str, loader, size: int) -> None:
    """The first batch has the shapes and the values a segmentation loop expects (or SystemExit)."""
    images, masks = next(iter(loader))
    allowed = {*range(len(CLASSES)), IGNORE}
    values = set(torch.unique(torch.as_tensor(masks)).tolist())
    if (images.dtype != torch.uint8 or tuple(images.shape[1:]) != (3, size, size) or masks.dtype != torch.uint8
            or tuple(masks.shape[1:]) != (size, size) or not values <= allowed):
        raise SystemExit(f"{name}: a batch of images {tuple(images.shape)} {images.dtype}, masks "
                         f"{tuple(masks.shape)} {masks.dtype} holding {sorted(values)}: not a segmentation batch")


def make_loaders(args: argparse.Namespace, seg, tmp: Path) -> tuple[dict, dict]:
    """(name -> (loader, workers, baseline or None), name -> row) of every configuration."""
    images, masks = seg.images("train"), seg.masks("train")
    loaders: dict[str, tuple] = {}
    rows: dict[str, dict] = {"folder": {"bytes": seg.nbytes("train")}}
    for workers in args.workers:
        generator = torch.Generator().manual_seed(0)
        for backend in BACKENDS:
            ds = PairFolder(images, masks, baseline_pipeline(backend, args))
            loaders[f"torchvision {backend} w{workers}"] = (DataLoader(
                ds, batch_size=args.batch_size, shuffle=True, num_workers=workers, generator=generator,
                persistent_workers=workers > 0), workers, None)
    loaders["torchvision pil static w0"] = (DataLoader(
        PairFolder(images, masks, baseline_pipeline("pil", args, random=False)), batch_size=args.batch_size,
        shuffle=True, num_workers=0), 0, None)
    if args.torchvision_only:
        return loaders, rows
    for fmt in args.formats:
        t0 = time.perf_counter()
        result = dlstore.convert(images, tmp / FORMATS[fmt], masks=masks, static=static_spec(args),
                                 store_format=fmt, encoding=args.encoding, progress=False)
        rows[fmt] = {"bytes": result.nbytes, "convert_seconds": time.perf_counter() - t0,
                     "bytes_vs_folder": result.nbytes / rows["folder"]["bytes"]}
        ds = dlstore.open_dataset(result.path, transform=v2.Compose(random_ops(args.crop, args.padding)))
        for workers in args.workers:
            loaders[f"{fmt} w{workers}"] = (dlstore.loader(
                ds, batch_size=args.batch_size, shuffle=True, num_workers=workers, seed=0,
                persistent_workers=workers > 0), workers, True)
        loaders[f"{fmt} static w0"] = (dlstore.loader(
            dlstore.open_dataset(result.path), batch_size=args.batch_size, shuffle=True, num_workers=0, seed=0),
            0, False)
    return loaders, rows


def measure(loaders: dict, rounds: int, seconds: float) -> dict[str, list[float]]:
    """Samples/s of every configuration in each round (whole epochs for at least ``seconds`` each)."""
    runs: dict[str, list[float]] = {name: [] for name in loaders}
    names = list(loaders)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            loader = loaders[name][0]
            seen, start = 0, time.perf_counter()
            while True:
                seen += epoch(loader)
                elapsed = time.perf_counter() - start
                if elapsed >= seconds:
                    break
            runs[name].append(seen / elapsed)
        print(f"round {r + 1}/{rounds} done ({uptime().split('load average:')[-1].strip()})", flush=True)
    return runs


def summarise(loaders: dict, runs: dict[str, list[float]], rows: dict, args: argparse.Namespace) -> None:
    """Fill ``rows`` with each configuration's rates and its ratios to the faster baseline of its worker count."""
    baseline_of: dict[int, str] = {}
    for workers in args.workers:
        candidates = [f"torchvision {b} w{workers}" for b in BACKENDS]
        baseline_of[workers] = max(candidates, key=lambda n: statistics.median(runs[n]))
    for name, rates in runs.items():
        workers = loaders[name][1]
        base = baseline_of.get(workers, baseline_of[min(baseline_of)])
        row = rows.setdefault(name, {})
        row.update(workers=workers, backend=getattr(loaders[name][0], "backend", "torch DataLoader"),
                   median=statistics.median(rates), min=min(rates), max=max(rates), runs=rates,
                   baseline=base, ratio=statistics.median(rates) / statistics.median(runs[base]),
                   ratio_runs=[a / b for a, b in zip(rates, runs[base])])
        if loaders[name][2]:
            row["target_met"] = row["ratio"] >= TARGET


def report(rows: dict, names: list[str], load: tuple[str, str]) -> None:
    print(f"\n{'configuration':28s} {'batches by':>16s} {'samples/s':>10s} {'min':>8s} {'max':>8s} "
          f"{'vs baseline':>12s} {'per round':>12s}  baseline")
    for name in names:
        row = rows[name]
        spread = f"{min(row['ratio_runs']):.1f}-{max(row['ratio_runs']):.1f}x"
        verdict = "" if "target_met" not in row else \
            f"  target >= {TARGET:.0f}x {'met' if row['target_met'] else 'NOT met'}"
        print(f"{name:28s} {row['backend']:>16s} {row['median']:10,.0f} {row['min']:8,.0f} {row['max']:8,.0f} "
              f"{row['ratio']:11.2f}x {spread:>12s}  {row['baseline']}{verdict}")
    print(f"\nbytes on disk: JPEG + PNG folder {rows['folder']['bytes'] / 2**20:.1f} MiB", end="")
    for fmt in FORMATS:
        if fmt in rows and "bytes" in rows[fmt]:
            print(f"; {fmt} {rows[fmt]['bytes'] / 2**20:.1f} MiB ({rows[fmt]['bytes_vs_folder']:.1f}x, "
                  f"converted in {rows[fmt]['convert_seconds']:.1f} s)", end="")
    print(f"\nload before: {load[0]}\nload after:  {load[1]}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=512, help="training pairs to write")
    parser.add_argument("--size", default="256x320", help="HxW of the written images and masks")
    parser.add_argument("--resize", type=int, default=224)
    parser.add_argument("--center-crop", type=int, default=224)
    parser.add_argument("--crop", type=int, default=224, help="RandomCrop size")
    parser.add_argument("--padding", type=int, default=16, help="RandomCrop padding")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", default="0,2", help="worker counts, comma-separated")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--encoding", default="raw", help="the stores' image encoding (convert's encoding=)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="least seconds per configuration per round")
    parser.add_argument("--torchvision-only", action="store_true", help="measure the baselines only")
    parser.add_argument("--workdir", default=None, help="where to write the data and stores (default: a temp dir)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "segmentation.json"))
    args = parser.parse_args()
    args.workers = [int(w) for w in args.workers.split(",")]
    args.formats = [f for f in args.formats.split(",") if f]
    unknown = set(args.formats) - set(FORMATS)
    if unknown:
        parser.error(f"--formats: unknown {sorted(unknown)}; valid: {', '.join(FORMATS)}")
    args.size = tuple(int(v) for v in args.size.lower().split("x"))
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="dlstore-seg-", dir=args.workdir) as tmp:
        tmp = Path(tmp)
        seg = make_segmentation_set(tmp / "data", {"train": args.images}, size=args.size, seed=0)
        loaders, rows = make_loaders(args, seg, tmp)
        for name, (loader, _, _) in loaders.items():
            check_batch(name, loader, args.crop if "static" not in name else args.center_crop)
            epoch(loader)   # warm-up: page cache, handles, worker start
        load_before = uptime()
        runs = measure(loaders, args.rounds, args.seconds)
        load_after = uptime()
        summarise(loaders, runs, rows, args)
        report(rows, list(loaders), (load_before, load_after))
        payload = {
            "benchmark": "segmentation", "machine": machine_info(), "load_before": load_before,
            "load_after": load_after,
            "data": {"images": args.images, "size": list(args.size), "classes": list(CLASSES), "ignore": IGNORE,
                     "static": static_spec(args), "random": repr(v2.Compose(random_ops(args.crop, args.padding))),
                     "batch_size": args.batch_size, "workers": args.workers, "encoding": args.encoding,
                     "rounds": args.rounds, "seconds_per_run": args.seconds,
                     "torch_threads": torch.get_num_threads(), "torchvision_only": args.torchvision_only},
            "results": rows, "target": TARGET,
        }
        del loaders
    print(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
