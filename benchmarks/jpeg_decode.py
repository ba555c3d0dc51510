"""JPEG store reads against the decode limit of the cores, and the reduced decode's cost in pixels.

One interleaved run (rounds alternate the order) of, on the same photo-like JPEGs:

* ``imagefolder_w0`` / ``imagefolder_w2``: torchvision ``ImageFolder`` (PIL decode of the
  source file, ``v2.RandomResizedCrop(224)``, flip, ``PILToTensor``) through a DataLoader with
  0 and 2 workers;
* ``store``: the same images converted to a JPEG store (``resize_max``, q90, the ImageNet
  recipe), read by the default ``dlstore.loader`` (threads; each batch decoded in one call, the
  crops drawn on the decoded sizes);
* ``store_reduced``: the same with ``reduced_decode=True`` (libjpeg DCT scaling);
* ``limit``: the CPU's limit, the same number of threads doing only decode + resized crop
  (``torchvision.io.decode_jpeg`` on each batch's list + the ``F.resized_crop_image`` kernel, as
  cheap per record as the store's path; boxes drawn beforehand) of the store's records, already
  in memory.

Then (``--psnr``) the reduced decode against the exact path: for JPEGs of a longer side of
270-840 px and crop-scale ranges, the PSNR of the reduced output against the exact output with
the same boxes (over the crops decoded reduced: the others are the exact ones), the share of
crops decoded reduced, and the decode + crop time ratio (exact / reduced, best of 2 alternated).

    python benchmarks/jpeg_decode.py [--images 320] [--rounds 3] [--out benchmarks/results/jpeg_decode.json]
"""

from __future__ import annotations

import argparse
import io
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.io import decode_jpeg
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, write_json
from imagenet_recipe import make_photos

import dlstore
from dlstore.data.intraop import one_thread_here
from dlstore.formats.encoding import decode_reduced, image_size, reduced_scale
from dlstore.transforms import BatchRandomResizedCrop

CROP, QUALITY = 224, 90
BOX = ("top", "left", "height", "width")


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def epoch_rate(loader, limit: int) -> float:
    start, seen = time.perf_counter(), 0
    for images, _ in loader:
        seen += len(images)
        if seen >= limit:
            break
    return seen / (time.perf_counter() - start)


def limit_rate(records: list[np.ndarray], threads: int, batch: int, seed: int) -> float:
    """Samples/s of ``threads`` threads doing only decode + resized crop of ``records`` (in memory)."""
    crop = BatchRandomResizedCrop(CROP)
    tensors = [torch.from_numpy(r.reshape(-1).copy()) for r in records]
    sizes = torch.tensor([image_size(r) for r in records])
    boxes = crop.sample_sizes(sizes[:, 0], sizes[:, 1], generator=torch.Generator().manual_seed(seed))
    boxes = list(zip(*(boxes[k].tolist() for k in BOX)))

    def work(lo: int) -> int:   # as cheap as the store's path per record: one decode call, the kernel itself
        images = decode_jpeg(tensors[lo:lo + batch])
        for image, box in zip(images, boxes[lo:lo + batch]):
            F.resized_crop_image(image, *box, [CROP, CROP], antialias=True)
        return len(images)

    with ThreadPoolExecutor(threads, initializer=one_thread_here) as pool:
        start = time.perf_counter()
        n = sum(pool.map(work, range(0, len(tensors), batch)))
    return n / (time.perf_counter() - start)


def exact_crop(record: np.ndarray, t: int, l: int, h: int, w: int) -> torch.Tensor:
    return F.resized_crop(decode_jpeg(torch.from_numpy(record.reshape(-1).copy())), t, l, h, w, [CROP, CROP],
                          antialias=True)


def reduced_crop(record: np.ndarray, t: int, l: int, h: int, w: int) -> torch.Tensor:
    """What ``reduced_decode=True`` does with one record and its box (``decode_crop``)."""
    s = reduced_scale(h, w, (CROP, CROP))
    if s == 1:
        return exact_crop(record, t, l, h, w)
    small, s = decode_reduced(record, s)
    image = torch.from_numpy(small)
    hh, ww = image.shape[1:]
    t2, b2 = min(round(t / s), hh - 1), min(round((t + h) / s), hh)
    l2, r2 = min(round(l / s), ww - 1), min(round((l + w) / s), ww)
    return F.resized_crop(image, t2, l2, max(1, b2 - t2), max(1, r2 - l2), [CROP, CROP], antialias=True)


def psnr_table(tmp: Path, sizes: list[int], scales: list[tuple[float, float]], per: int) -> list[dict]:
    """Reduced against exact decode + RandomResizedCrop(224), same boxes, for each (longer side, scale)."""
    src = tmp / "psnr_src"
    make_photos(src, per, classes=1, seed=1)
    photos = [Image.open(p).convert("RGB") for p in sorted(src.rglob("*.jpg"))]
    rows = []
    for longer in sizes:
        records = []
        for img in photos:
            w, h = img.size
            f = longer / max(w, h)
            buf = io.BytesIO()
            img.resize((max(1, round(w * f)), max(1, round(h * f))), Image.BICUBIC).save(buf, "JPEG", quality=QUALITY)
            records.append(np.frombuffer(buf.getvalue(), np.uint8).reshape(1, 1, -1))
        for scale in scales:
            crop = BatchRandomResizedCrop(CROP, scale=scale)
            hw = torch.tensor([image_size(r) for r in records])
            boxes = crop.sample_sizes(hw[:, 0], hw[:, 1], generator=torch.Generator().manual_seed(longer))
            cells = [(r, *(int(boxes[key][k]) for key in BOX)) for k, r in enumerate(records)]
            sq, n = 0.0, 0            # over the crops decoded reduced (the others are identical)
            for cell in cells:
                if reduced_scale(cell[3], cell[4], (CROP, CROP)) > 1:
                    d = exact_crop(*cell).double() - reduced_crop(*cell).double()
                    sq += float((d * d).sum())
                    n += d.numel()
            reduced = sum(reduced_scale(bh, bw, (CROP, CROP)) > 1 for _, _, _, bh, bw in cells)
            times = {"exact": [], "reduced": []}
            for rep in range(2):      # timed apart, in alternating order
                for name in (("exact", "reduced") if rep % 2 == 0 else ("reduced", "exact")):
                    fn = exact_crop if name == "exact" else reduced_crop
                    start = time.perf_counter()
                    for cell in cells:
                        fn(*cell)
                    times[name].append(time.perf_counter() - start)
            t_exact, t_reduced = min(times["exact"]), min(times["reduced"])
            mse = sq / n if n else 0.0
            rows.append({"longer_side": longer, "scale": list(scale), "crops": len(records),
                         "reduced_share": reduced / len(records),
                         "psnr_db_of_reduced_crops": 10 * math.log10(255 ** 2 / mse) if mse else None,
                         "speedup": t_exact / t_reduced})
            print(f"    {longer:>4} px, scale {scale}: {100 * reduced / len(records):3.0f} % reduced, "
                  f"PSNR of those {rows[-1]['psnr_db_of_reduced_crops'] or float('nan'):.1f} dB, decode+crop {rows[-1]['speedup']:.2f}x")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=320)
    parser.add_argument("--resize-max", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--psnr-images", type=int, default=24, help="photos per cell of the PSNR table (0: skip)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "jpeg_decode.json"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*deprecated.*")   # torchvision 0.29's decoders
    torch.set_num_threads(1)
    load_before = load()
    print(f"load average before: {load_before}")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        kind = make_photos(tmp / "images", args.images)
        dst = tmp / "train.shards"
        dlstore.convert(tmp / "images", dst, static=f"resize_max={args.resize_max}", encoding="jpeg",
                        quality=QUALITY, workers=2, progress=False)
        dynamic = v2.Compose([v2.RandomResizedCrop(CROP, antialias=True), v2.RandomHorizontalFlip()])
        store = dlstore.open_dataset(dst, transform=dynamic)
        store_loader = dlstore.loader(store, args.batch, shuffle=True, generator=torch.Generator().manual_seed(0))
        threads = store_loader.num_threads
        reduced_loader = dlstore.loader(dlstore.open_dataset(dst, transform=dynamic, reduced_decode=True), args.batch,
                                        shuffle=True, generator=torch.Generator().manual_seed(0))
        folder = datasets.ImageFolder(tmp / "images", transform=v2.Compose(
            [v2.RandomResizedCrop(CROP, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor()]))
        records = store.reader.records(list(range(len(store))))
        runs = {
            "imagefolder_w0": lambda: epoch_rate(DataLoader(folder, args.batch, shuffle=True), len(folder)),
            "imagefolder_w2": lambda: epoch_rate(DataLoader(folder, args.batch, shuffle=True, num_workers=2),
                                                 len(folder)),
            "store": lambda: epoch_rate(store_loader, len(store)),
            "store_reduced": lambda: epoch_rate(reduced_loader, len(store)),
            "limit": lambda: limit_rate(records, threads, args.batch, seed=len(rates["limit"])),
        }
        rates: dict[str, list[float]] = {name: [] for name in runs}
        epoch_rate(store_loader, args.batch)    # warm-up: imports, the reader's PIL check
        for r in range(args.rounds):
            for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
                rates[name].append(runs[name]())
            print(f"  round {r} (load {load()}): " + ", ".join(f"{n} {rates[n][-1]:.0f}/s" for n in runs))
        median = {name: statistics.median(v) for name, v in rates.items()}
        ratios = {"store_over_imagefolder_w2": median["store"] / median["imagefolder_w2"],
                  "store_over_imagefolder_w0": median["store"] / median["imagefolder_w0"],
                  "store_over_limit": median["store"] / median["limit"],
                  "reduced_over_store": median["store_reduced"] / median["store"]}
        print(f"{len(store)} images ({kind}), store resize_max={args.resize_max} q{QUALITY}, batch {args.batch}, "
              f"{threads} threads, {args.rounds} rounds interleaved (medians):")
        for name in runs:
            print(f"  {name:<15} {median[name]:7.1f} samples/s")
        print(f"  store / ImageFolder w2: {ratios['store_over_imagefolder_w2']:.2f}x (target >= 1.5)")
        print(f"  store / decode-only limit: {ratios['store_over_limit']:.2f}x (target >= 0.85)")
        print(f"  reduced decode / exact: {ratios['reduced_over_store']:.2f}x")
        table = []
        if args.psnr_images:
            print(f"reduced decode against exact, RandomResizedCrop({CROP}), {args.psnr_images} photos per cell:")
            table = psnr_table(tmp, [270, 420, 560, 840, 1120],
                               [(0.08, 1.0), (0.25, 1.0), (0.5, 1.0), (0.08, 0.25)], args.psnr_images)
        load_after = load()
        print(f"load average after: {load_after}")
        write_json(args.out, {
            "benchmark": "jpeg_decode", "machine": machine_info(),
            "load_average": {"before": load_before, "after": load_after},
            "config": {"images": len(store), "source": kind, "static": f"resize_max={args.resize_max}",
                       "quality": QUALITY, "crop": CROP, "batch": args.batch, "threads": threads,
                       "rounds": args.rounds, "torch_threads": 1,
                       "versions": {"torch": torch.__version__, "dlstore": dlstore.__version__}},
            "rates": rates, "median": median, "ratios": ratios,
            "targets": {"store_over_imagefolder_w2": 1.5, "store_over_limit": 0.85},
            "reduced_vs_exact": table,
        })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
