"""The ImageNet-scale recipe: a downscaled JPEG store, RandomResizedCrop at read time.

Recipe::

    dlstore convert SRC DST --static resize_max=512 --encoding jpeg --quality 90
    open_dataset(DST, transform=v2.Compose([v2.RandomResizedCrop(224), v2.RandomHorizontalFlip()]))

A pipeline that starts with ``RandomResizedCrop`` has no static part, so a store of
it would hold every image at full size. ``resize_max=512`` caps the longer side
(never upscales) and JPEG q90 keeps the store near the source's size. The price is
an approximation: the crop is taken from the downscaled, re-encoded image instead of
the original. This script measures, in one run:

(a) fidelity: for crop boxes drawn by torchvision's ``RandomResizedCrop.get_params``
    on the store's decoded sample, the crop of that sample with torchvision's tensor
    kernel (the kernel dlstore's batch path reproduces exactly) against torchvision's
    result on the original PIL image (what ``ImageFolder`` +
    ``v2.RandomResizedCrop(224)`` gives) for the same box, mapped up by the resize
    factor and rounded to whole pixels of the original. Mean absolute difference (levels of 255) and
    PSNR over all crops, split into its sources: the kernel alone (PIL vs tensor on
    the original), resize_max alone (no JPEG), and the whole recipe;
(b) store bytes / source JPEG bytes (target <= 1.2);
(c) read rate, samples/s: the store through ``dlstore.loader`` against torchvision
    ``ImageFolder`` with the full pipeline (decode, RandomResizedCrop(224),
    RandomHorizontalFlip, PILToTensor) through a ``DataLoader``; both shuffled,
    uint8 batches, the same workers, rounds interleaved (target >= 5x). For
    context the same store held raw (``--encoding raw``: no decode per read) is
    measured in the same rounds, with its size, and the same JPEG store with
    every record decoded by PIL instead of torchvision (the per-record gain).

Images: ``--photos DIR`` (an ImageFolder tree of real photos). Without it there are
no photo collections on the development machine, so the script derives ``--images``
JPEGs from the two real photos scikit-learn ships (china.jpg, flower.jpg, 640x427):
random crops (30-100 % of the area), flips and colour gains, resized to a longer side
of 500-1200 pixels (4:3 or 3:4), saved at JPEG quality 75-95; scaled up, they are
smoother than camera photos of that size. Without scikit-learn: smooth gradients
plus texture.

    python benchmarks/imagenet_recipe.py [--images 1000] [--photos DIR] [--workers 0]
        [--resize-max 512] [--rounds 3] [--crops 400] [--out benchmarks/results/imagenet_recipe.json]
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, write_json

import dlstore
from dlstore.sources import pil_loader
from dlstore.transforms.static import ResizeMax

QUALITY, CROP = 90, 224


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def _base_photos() -> list[np.ndarray] | None:
    try:
        from sklearn.datasets import load_sample_images
    except ImportError:
        return None
    return list(load_sample_images().images)


def _synthetic(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Smooth colour gradients, a few soft blobs and fine noise texture."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.zeros((h, w, 3), np.float32)
    for c in range(3):
        a, b, d = rng.uniform(-1, 1, 3)
        img[..., c] = 128 + 90 * np.sin(a * x / w * 3 + b * y / h * 3 + d * 6)
    for _ in range(6):
        cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(0.05, 0.3) * min(h, w)
        img += (rng.uniform(-80, 80, 3) * np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * r * r))[..., None])
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_photos(root: Path, count: int, classes: int = 10, seed: int = 0) -> str:
    """``count`` JPEGs of 500-1200 px (longer side) in ``classes`` class folders; returns what they are."""
    rng = np.random.default_rng(seed)
    bases = _base_photos()
    for k in range(count):
        longer = int(rng.integers(500, 1201))
        shorter = longer * 3 // 4
        h, w = (shorter, longer) if rng.random() < 0.75 else (longer, shorter)
        if bases is None:
            img = Image.fromarray(_synthetic(rng, h, w))
        else:
            base = bases[k % len(bases)]
            bh, bw = base.shape[:2]
            area = rng.uniform(0.3, 1.0) * bh * bw
            ch = int(min(bh, math.sqrt(area * h / w)))
            cw = int(min(bw, ch * w / h))
            top, left = int(rng.integers(0, bh - ch + 1)), int(rng.integers(0, bw - cw + 1))
            crop = base[top:top + ch, left:left + cw]
            if rng.random() < 0.5:
                crop = crop[:, ::-1]
            crop = np.clip(crop * rng.uniform(0.8, 1.2, 3), 0, 255).astype(np.uint8)
            img = Image.fromarray(crop).resize((w, h), Image.BICUBIC)
        folder = root / f"class_{k % classes:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        img.save(folder / f"img_{k:05d}.jpg", quality=int(rng.integers(75, 96)))
    return ("smooth gradients + texture (scikit-learn not installed)" if bases is None else
            "derived from scikit-learn's 2 real photos (china.jpg, flower.jpg): crops, flips, colour gains, "
            "bicubic resize to 500-1200 px, JPEG q75-95")


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def fidelity(ds: dlstore.StoreDataset, resize_max: int, crops: int, seed: int) -> dict:
    """Errors of the recipe's crop against torchvision's crop of the original, over ``crops`` boxes."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(ds), size=min(crops, len(ds)), replace=False)
    resize = ResizeMax(resize_max)
    sums = {name: [0.0, 0.0, 0] for name in ("kernel", "resize_max", "recipe")}   # abs, sq, count
    per_crop_psnr = []
    for k in picks:
        path = Path(ds.root) / ds.samples[int(k)][0] if not Path(ds.samples[int(k)][0]).is_absolute() \
            else Path(ds.samples[int(k)][0])
        original = pil_loader(path)
        stored = ds.read(int(k))                                # decoded JPEG sample, capped
        small = F.pil_to_tensor(resize(original))               # resize_max without the JPEG step
        # The box is drawn where the recipe draws it (on the stored image) and mapped up to the
        # original, where rounding to whole pixels moves it by at most half an original pixel.
        box = transforms.RandomResizedCrop.get_params(stored, (0.08, 1.0), (3 / 4, 4 / 3))
        big_w, big_h = original.size
        sy, sx = big_h / stored.shape[1], big_w / stored.shape[2]
        top, left = min(big_h - 1, round(box[0] * sy)), min(big_w - 1, round(box[1] * sx))
        height = max(1, min(big_h - top, round(box[2] * sy)))
        width = max(1, min(big_w - left, round(box[3] * sx)))
        reference = F.pil_to_tensor(F.resized_crop(original, top, left, height, width, [CROP, CROP],
                                                   antialias=True)).to(torch.int32)
        outs = {
            "kernel": F.resized_crop(F.pil_to_tensor(original), top, left, height, width, [CROP, CROP],
                                     antialias=True),
            "resize_max": F.resized_crop(small, *box, [CROP, CROP], antialias=True),
            "recipe": F.resized_crop(stored, *box, [CROP, CROP], antialias=True),
        }
        for name, out in outs.items():
            d = (out.to(torch.int32) - reference).to(torch.float64)
            sums[name][0] += d.abs().sum().item()
            sums[name][1] += (d * d).sum().item()
            sums[name][2] += d.numel()
            if name == "recipe":
                mse = (d * d).mean().item()
                per_crop_psnr.append(10 * math.log10(255 ** 2 / mse) if mse else float("inf"))
    result = {}
    for name, (abs_sum, sq_sum, n) in sums.items():
        mse = sq_sum / n
        result[name] = {"mean_abs_diff": abs_sum / n, "psnr_db": 10 * math.log10(255 ** 2 / mse) if mse else None}
    finite = [p for p in per_crop_psnr if math.isfinite(p)]
    result["recipe"]["per_crop_psnr_db"] = {"median": statistics.median(finite), "p5": float(np.percentile(finite, 5)),
                                            "min": min(finite)}
    result["crops"] = len(picks)
    return result


def epoch_rate(loader, limit: int) -> float:
    """Samples per second over one pass, stopped after ``limit`` samples."""
    start, seen = time.perf_counter(), 0
    for images, _ in loader:
        assert images.dtype == torch.uint8 and tuple(images.shape[1:]) == (3, CROP, CROP)
        seen += len(images)
        if seen >= limit:
            break
    return seen / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000, help="images to generate (without --photos)")
    parser.add_argument("--photos", help="an ImageFolder tree of real photos to measure instead")
    parser.add_argument("--resize-max", type=int, default=512, help="the cap on the longer side")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers, both loaders")
    parser.add_argument("--convert-workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=int, default=640, help="samples read per round and loader")
    parser.add_argument("--crops", type=int, default=400, help="crop boxes for the fidelity measurement")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "imagenet_recipe.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)   # both loaders alike: less dependent on what other jobs leave

    load_before = uptime()
    print(f"uptime before: {load_before}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        if args.photos:
            src, kind = Path(args.photos), f"real photos from {args.photos}"
        else:
            src = tmp_path / "images"
            start = time.perf_counter()
            kind = make_photos(src, args.images)
            print(f"generated {args.images} JPEGs in {time.perf_counter() - start:.1f} s: {kind}")
        dst = tmp_path / "train.shards"
        result = dlstore.convert(src, dst, static=f"resize_max={args.resize_max}", encoding="jpeg", quality=QUALITY,
                                 workers=args.convert_workers, progress=False)
        print(result)
        raw = tmp_path / "train_raw.shards"
        raw_result = dlstore.convert(src, raw, static=f"resize_max={args.resize_max}", workers=args.convert_workers,
                                     progress=False)
        source_bytes = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        store_bytes, raw_bytes = tree_bytes(dst), tree_bytes(raw)
        sizes = [Image.open(p).size for p in sorted(src.rglob("*.jpg"))[:2000]]
        size_ratio = store_bytes / source_bytes
        print(f"(b) source JPEGs {source_bytes / 2**20:.1f} MiB, store {store_bytes / 2**20:.1f} MiB: "
              f"{size_ratio:.2f}x the source (target <= 1.2); held raw {raw_bytes / 2**20:.1f} MiB, "
              f"{raw_bytes / source_bytes:.2f}x")

        fid = fidelity(dlstore.open_dataset(dst), args.resize_max, args.crops, seed=0)
        print(f"(a) RandomResizedCrop({CROP}) vs torchvision on the original PIL image, {fid['crops']} crops:")
        for name, label in (("kernel", "tensor kernel on the original (floor)"),
                            ("resize_max", f"resize_max={args.resize_max}, no JPEG"), ("recipe", "recipe (resize_max + JPEG q90)")):
            print(f"    {label:<40} mean |d| {fid[name]['mean_abs_diff']:.2f} levels, "
                  f"PSNR {fid[name]['psnr_db']:.1f} dB")
        print(f"    per-crop PSNR of the recipe: median {fid['recipe']['per_crop_psnr_db']['median']:.1f} dB, "
              f"5th percentile {fid['recipe']['per_crop_psnr_db']['p5']:.1f} dB")

        dynamic = v2.Compose([v2.RandomResizedCrop(CROP, antialias=True), v2.RandomHorizontalFlip()])
        store_ds = dlstore.open_dataset(dst, transform=dynamic)
        store_loader = dlstore.loader(store_ds, batch_size=args.batch, shuffle=True, num_workers=args.workers,
                                      generator=torch.Generator().manual_seed(0))
        # the same store with every record decoded by PIL (the reader's torchvision check forced to
        # "differs"): what the per-record torchvision decode gains, in the same rounds
        pil_ds = dlstore.open_dataset(dst, transform=dynamic)
        pil_ds.reader._batch_jpeg = False
        pil_loader = dlstore.loader(pil_ds, batch_size=args.batch, shuffle=True, num_workers=args.workers,
                                    generator=torch.Generator().manual_seed(0))
        raw_loader = dlstore.loader(dlstore.open_dataset(raw, transform=dynamic), batch_size=args.batch,
                                    shuffle=True, num_workers=args.workers, generator=torch.Generator().manual_seed(0))
        folder = datasets.ImageFolder(src, transform=v2.Compose(
            [v2.RandomResizedCrop(CROP, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor()]))
        folder_loader = DataLoader(folder, batch_size=args.batch, shuffle=True, num_workers=args.workers)
        limit = min(args.limit, len(folder))
        loaders = {"imagefolder": folder_loader, "store": store_loader, "store_pil": pil_loader,
                   "store_raw": raw_loader}
        rates: dict[str, list[float]] = {name: [] for name in loaders}
        for dl in loaders.values():
            epoch_rate(dl, args.batch)          # warm-up: imports, first decodes
        for r in range(args.rounds):
            order = list(loaders) if r % 2 == 0 else list(reversed(loaders))
            for name in order:
                rates[name].append(epoch_rate(loaders[name], limit))
            print(f"    round {r}: " + ", ".join(f"{name} {rates[name][-1]:.0f}/s" for name in loaders))
        median = {name: statistics.median(v) for name, v in rates.items()}
        speedup = median["store"] / median["imagefolder"]
        print(f"(c) read rate, {limit} samples per round, batch {args.batch}, workers {args.workers}, "
              f"{args.rounds} rounds interleaved: ImageFolder {median['imagefolder']:.0f} samples/s, "
              f"store {median['store']:.0f} samples/s: {speedup:.2f}x (target >= 5); held raw "
              f"{median['store_raw']:.0f} samples/s: {median['store_raw'] / median['imagefolder']:.2f}x")
        decoder = statistics.median(a / b for a, b in zip(rates["store"], rates["store_pil"]))
        print(f"    torchvision decode / PIL decode, the same store: {decoder:.2f}x (median of the per-round "
              f"ratios; {median['store_pil']:.0f} samples/s with PIL, "
              f"{median['store_pil'] / median['imagefolder']:.2f}x ImageFolder)")
        load_after = uptime()
        print(f"uptime after: {load_after}")
        write_json(args.out, {
            "benchmark": "imagenet_recipe",
            "machine": machine_info(),
            "load": {"before": load_before, "after": load_after},
            "config": {"images": len(folder), "source": kind, "static": f"resize_max={args.resize_max}",
                       "encoding": "jpeg", "quality": QUALITY, "crop": CROP, "workers": args.workers,
                       "batch": args.batch, "rounds": args.rounds, "samples_per_round": limit,
                       "torch_threads": 1, "versions": {"torch": torch.__version__, "dlstore": dlstore.__version__},
                       "source_sizes_px": {"min_long": min(max(s) for s in sizes),
                                           "max_long": max(max(s) for s in sizes),
                                           "mean_pixels": float(np.mean([w * h for w, h in sizes]))}},
            "convert_seconds": {"jpeg": result.seconds, "raw": raw_result.seconds},
            "size": {"source_bytes": source_bytes, "store_bytes": store_bytes, "ratio": size_ratio,
                     "target": 1.2, "raw_store_bytes": raw_bytes, "raw_ratio": raw_bytes / source_bytes},
            "fidelity": fid,
            "read": {"rates": rates, "median": median, "speedup": speedup, "target": 5.0,
                     "speedup_raw": median["store_raw"] / median["imagefolder"],
                     "torchvision_over_pil_decode": decoder},
        })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
