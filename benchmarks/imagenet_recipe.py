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
    uint8 batches, the same workers, rounds interleaved (target >= 5x). With
    ``--workers 0`` the ``DataLoader`` runs on one core, while ``dlstore.loader``
    picks a ``ThreadLoader`` of min(usable CPUs, 8) threads (both cores of a 2-core
    machine): two more rows fix the count (``backend="threads"``, ``threads=1`` and
    ``threads=2``). For context the same store held raw (``--encoding raw``: no
    decode per read) is measured in the same rounds, with its size, and the same
    JPEG store with every record decoded by PIL instead of torchvision (the
    per-record gain);
(d) FFCV side by side, when ``ffcv`` imports (it is no dependency of dlstore): the
    same images written by FFCV's ``DatasetWriter`` (``RGBImageField(write_mode='jpg',
    max_resolution=512, jpeg_quality=90)``: the recipe's cap and quality; the cap is
    512 whatever ``--resize-max`` says) and read by ``Loader`` on the CPU with
    ``RandomResizedCropRGBImageDecoder((224, 224))`` (scale (0.08, 1), ratio (3/4, 4/3)),
    ``RandomHorizontalFlip``, ``ToTensor``, ``ToTorchImage``, ``order=RANDOM``, with
    ``num_workers`` 1 and 2 (numba threads in the main process), in the same
    interleaved rounds as (c), set against dlstore's threads 1 and 2 (the same
    cores; target for threads=2 / FFCV w2: >= 1.2x). Fidelity as in (a): FFCV's stored JPEG decoded by the
    libturbojpeg call of its ``SimpleRGBImageDecoder`` (``ffcv.libffcv.imdecode``;
    the decoder class itself refuses a dataset whose images differ in size), a box
    drawn by ``get_params`` on it (from the same torch RNG state as the recipe's box),
    cropped and resized with ``cv2.resize(..., interpolation=cv2.INTER_AREA)``, which
    is what ``RandomResizedCropRGBImageDecoder`` runs (``ffcv.libffcv.resize_crop`` ->
    ``cv::resize(..., INTER_AREA)`` in libffcv.cpp; the script checks the two agree),
    against torchvision's PIL crop of the original for the box mapped up. Without
    ``ffcv`` these entries read "ffcv not installed: skipped".

    Installing FFCV (CPU only; a separate virtual environment, Python 3.11)::

        apt-get install -y libturbojpeg0-dev libopencv-dev pkg-config
        python3 -m venv /work/venv-ffcv
        /work/venv-ffcv/bin/pip install torch==2.14.1 torchvision==0.29.1   # the main venv's
        /work/venv-ffcv/bin/pip install -e . scikit-learn
        /work/venv-ffcv/bin/pip install ffcv==1.0.2   # builds libffcv against the system
                                                      # OpenCV and libturbojpeg; pulls numba, opencv-python

Images: ``--photos DIR`` (an ImageFolder tree of real photos). Without it there are
no photo collections on the development machine, so the script derives ``--images``
JPEGs from the two real photos scikit-learn ships (china.jpg, flower.jpg, 640x427):
random crops (30-100 % of the area), flips and colour gains, resized to a longer side
of 500-1200 pixels (4:3 or 3:4), saved at JPEG quality 75-95; scaled up, they are
smoother than camera photos of that size. Without scikit-learn: smooth gradients
plus texture.

    python benchmarks/imagenet_recipe.py [--images 1000] [--photos DIR] [--workers 0]
        [--resize-max 512] [--rounds 3] [--crops 400] [--no-ffcv] [--out benchmarks/results/imagenet_recipe.json]
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
from _photos import base_photos, derived_photo

import dlstore
from dlstore.sources import pil_loader
from dlstore.transforms.static import ResizeMax

QUALITY, CROP = 90, 224
FFCV_MAX_RESOLUTION = 512
FFCV_SKIPPED = "ffcv not installed: skipped"


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


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
    bases = base_photos()
    for k in range(count):
        longer = int(rng.integers(500, 1201))
        shorter = longer * 3 // 4
        h, w = (shorter, longer) if rng.random() < 0.75 else (longer, shorter)
        if bases is None:
            img = Image.fromarray(_synthetic(rng, h, w))
        else:
            img = derived_photo(rng, bases[k % len(bases)], h, w)
        folder = root / f"class_{k % classes:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        img.save(folder / f"img_{k:05d}.jpg", quality=int(rng.integers(75, 96)))
    return ("smooth gradients + texture (scikit-learn not installed)" if bases is None else
            "derived from scikit-learn's 2 real photos (china.jpg, flower.jpg): crops, flips, colour gains, "
            "bicubic resize to 500-1200 px, JPEG q75-95")


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def import_ffcv():
    """FFCV's modules as a namespace, or the reason they are not importable."""
    try:
        import cv2
        from ffcv.fields import IntField, RGBImageField
        from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
        from ffcv.libffcv import imdecode, resize_crop
        from ffcv.loader import Loader, OrderOption
        from ffcv.reader import Reader
        from ffcv.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage
        from ffcv.writer import DatasetWriter
    except ImportError as exc:   # ffcv absent, or its libffcv / numba / cv2 not loadable
        return None, f"{type(exc).__name__}: {exc}"
    from importlib.metadata import version
    return dict(cv2=cv2, IntField=IntField, RGBImageField=RGBImageField, IntDecoder=IntDecoder,
                RandomResizedCropRGBImageDecoder=RandomResizedCropRGBImageDecoder, imdecode=imdecode,
                resize_crop=resize_crop, Loader=Loader, OrderOption=OrderOption, Reader=Reader,
                RandomHorizontalFlip=RandomHorizontalFlip, ToTensor=ToTensor, ToTorchImage=ToTorchImage,
                DatasetWriter=DatasetWriter, version=version("ffcv")), None   # ffcv.__version__ says 0.0.3rc1


class FfcvStored:
    """The images of an FFCV file as stored: the JPEG of sample ``i`` decoded by the call that
    FFCV's ``SimpleRGBImageDecoder`` makes (``libffcv.imdecode``: libturbojpeg, RGB, full size)."""

    def __init__(self, path: Path, ff: dict) -> None:
        self.ff = ff
        reader = ff["Reader"](str(path))
        self.meta = reader.metadata["f0"]                  # the image field: mode, width, height, data_ptr
        self.size_of = dict(zip(reader.alloc_table["ptr"].tolist(), reader.alloc_table["size"].tolist()))
        self.data = np.memmap(path, dtype=np.uint8, mode="r")

    def read_hwc(self, index: int) -> np.ndarray:
        field = self.meta[index]
        height, width = int(field["height"]), int(field["width"])
        ptr = int(field["data_ptr"])
        out = np.empty((height, width, 3), np.uint8)
        if int(field["mode"]) == 0:   # jpg
            source = np.ascontiguousarray(self.data[ptr:ptr + self.size_of[ptr]])
            self.ff["imdecode"](source, out, height, width, height, width, 0, 0, 1, 1, False, False)
        else:
            out[...] = self.data[ptr:ptr + height * width * 3].reshape(height, width, 3)
        return out


def write_ffcv(src: Path, path: Path, ff: dict) -> float:
    """The FFCV file of ``src`` (an ImageFolder tree, in ImageFolder's order); returns the seconds."""
    folder = datasets.ImageFolder(src, loader=pil_loader)
    writer = ff["DatasetWriter"](str(path), {
        "image": ff["RGBImageField"](write_mode="jpg", max_resolution=FFCV_MAX_RESOLUTION, jpeg_quality=QUALITY),
        "label": ff["IntField"](),
    }, num_workers=2)
    start = time.perf_counter()
    writer.from_indexed_dataset(folder)
    return time.perf_counter() - start


def ffcv_loader(path: Path, ff: dict, batch: int, workers: int):
    return ff["Loader"](str(path), batch_size=batch, num_workers=workers, order=ff["OrderOption"].RANDOM,
                        pipelines={"image": [ff["RandomResizedCropRGBImageDecoder"]((CROP, CROP)),
                                             ff["RandomHorizontalFlip"](), ff["ToTensor"](), ff["ToTorchImage"]()],
                                   "label": [ff["IntDecoder"](), ff["ToTensor"]()]})


def _map_box(box, stored_hw: tuple[int, int], original_size: tuple[int, int]) -> tuple[int, int, int, int]:
    """A box on the stored image mapped up to the original, rounded to whole original pixels."""
    big_w, big_h = original_size
    sy, sx = big_h / stored_hw[0], big_w / stored_hw[1]
    top, left = min(big_h - 1, round(box[0] * sy)), min(big_w - 1, round(box[1] * sx))
    height = max(1, min(big_h - top, round(box[2] * sy)))
    width = max(1, min(big_w - left, round(box[3] * sx)))
    return top, left, height, width


def _add(sums: list, diff: torch.Tensor, psnr: list | None) -> None:
    """One crop's difference from its reference into ``sums`` ([abs, squares, count]); its PSNR
    appended to ``psnr`` when given."""
    d = diff.to(torch.float64)
    sums[0] += d.abs().sum().item()
    sums[1] += (d * d).sum().item()
    sums[2] += d.numel()
    if psnr is not None:
        mse = (d * d).mean().item()
        psnr.append(10 * math.log10(255 ** 2 / mse) if mse else float("inf"))


def _summary(abs_sum: float, sq_sum: float, n: int) -> dict:
    mse = sq_sum / n
    return {"mean_abs_diff": abs_sum / n, "psnr_db": 10 * math.log10(255 ** 2 / mse) if mse else None}


def _psnr_stats(per_crop: list[float]) -> dict:
    finite = [p for p in per_crop if math.isfinite(p)]
    return {"median": statistics.median(finite), "p5": float(np.percentile(finite, 5)), "min": min(finite)}


def fidelity(ds: dlstore.StoreDataset, resize_max: int, crops: int, seed: int,
             ffcv_stored: FfcvStored | None = None, ffcv_index: dict | None = None) -> dict:
    """Errors of the recipe's crop against torchvision's crop of the original, over ``crops`` boxes."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(ds), size=min(crops, len(ds)), replace=False)
    resize = ResizeMax(resize_max)
    sums = {name: [0.0, 0.0, 0] for name in ("kernel", "resize_max", "recipe")}   # abs, sq, count
    per_crop_psnr = []
    ff_sums = {name: [0.0, 0.0, 0] for name in ("recipe", "kernel")}
    ff_psnr, ff_same_box, ff_same_size, ff_resize_check = [], 0, 0, 0
    for k in picks:
        path = Path(ds.root) / ds.samples[int(k)][0] if not Path(ds.samples[int(k)][0]).is_absolute() \
            else Path(ds.samples[int(k)][0])
        original = pil_loader(path)
        stored = ds.read(int(k))                                # decoded JPEG sample, capped
        small = F.pil_to_tensor(resize(original))               # resize_max without the JPEG step
        # The box is drawn where the recipe draws it (on the stored image) and mapped up to the
        # original, where rounding to whole pixels moves it by at most half an original pixel.
        rng_before = torch.get_rng_state()
        box = transforms.RandomResizedCrop.get_params(stored, (0.08, 1.0), (3 / 4, 4 / 3))
        top, left, height, width = _map_box(box, tuple(stored.shape[1:]), original.size)
        if ffcv_stored is not None:
            # FFCV's stored image, a box drawn on it from the same RNG state (the same box where
            # the two caps give the same size), FFCV's crop + INTER_AREA resize against
            # torchvision's PIL crop of the original for that box mapped up
            rng_after = torch.get_rng_state()
            torch.set_rng_state(rng_before)
            hwc = ffcv_stored.read_hwc(ffcv_index[path.resolve()])
            f_box = transforms.RandomResizedCrop.get_params(torch.from_numpy(hwc).permute(2, 0, 1),
                                                            (0.08, 1.0), (3 / 4, 4 / 3))
            torch.set_rng_state(rng_after)
            ff_same_size += hwc.shape[:2] == tuple(stored.shape[1:])
            ff_same_box += tuple(f_box) == tuple(box)
            i, j, h, w = f_box
            cv2 = ffcv_stored.ff["cv2"]
            f_out = cv2.resize(hwc[i:i + h, j:j + w], (CROP, CROP), interpolation=cv2.INTER_AREA)
            lib_out = np.empty((CROP, CROP, 3), np.uint8)   # what the decoder itself runs
            ffcv_stored.ff["resize_crop"](hwc, i, i + h, j, j + w, lib_out)
            ff_resize_check = max(ff_resize_check, int(np.abs(f_out.astype(np.int16) - lib_out).max()))
            ft, fl, fh, fw = _map_box(f_box, hwc.shape[:2], original.size)
            f_ref = F.pil_to_tensor(F.resized_crop(original, ft, fl, fh, fw, [CROP, CROP],
                                                   antialias=True)).to(torch.int32)
            orig_hwc = np.asarray(original)
            f_kernel = cv2.resize(orig_hwc[ft:ft + fh, fl:fl + fw], (CROP, CROP), interpolation=cv2.INTER_AREA)
            for name, out in (("recipe", f_out), ("kernel", f_kernel)):
                _add(ff_sums[name], torch.from_numpy(out).permute(2, 0, 1).to(torch.int32) - f_ref,
                     ff_psnr if name == "recipe" else None)
        reference = F.pil_to_tensor(F.resized_crop(original, top, left, height, width, [CROP, CROP],
                                                   antialias=True)).to(torch.int32)
        outs = {
            "kernel": F.resized_crop(F.pil_to_tensor(original), top, left, height, width, [CROP, CROP],
                                     antialias=True),
            "resize_max": F.resized_crop(small, *box, [CROP, CROP], antialias=True),
            "recipe": F.resized_crop(stored, *box, [CROP, CROP], antialias=True),
        }
        for name, out in outs.items():
            _add(sums[name], out.to(torch.int32) - reference, per_crop_psnr if name == "recipe" else None)
    result = {name: _summary(*sums[name]) for name in sums}
    result["recipe"]["per_crop_psnr_db"] = _psnr_stats(per_crop_psnr)
    result["crops"] = len(picks)
    if ffcv_stored is None:
        result["ffcv"] = FFCV_SKIPPED
    else:
        result["ffcv"] = {**_summary(*ff_sums["recipe"]), "per_crop_psnr_db": _psnr_stats(ff_psnr),
                          "what": f"FFCV jpg max_resolution={FFCV_MAX_RESOLUTION} q{QUALITY}, libffcv.imdecode, "
                                  "cv2.resize INTER_AREA, vs torchvision PIL RandomResizedCrop on the original",
                          "kernel": {**_summary(*ff_sums["kernel"]),
                                     "what": "cv2.resize INTER_AREA on the original vs torchvision PIL, same box"},
                          "stored_size_same_as_recipe": ff_same_size, "box_same_as_recipe": ff_same_box,
                          "cv2_resize_vs_libffcv_resize_crop_max_abs_diff": ff_resize_check}
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


def backend_of(loader) -> str:
    """What ``dlstore.loader`` chose: its back-end, and its thread or worker count."""
    if getattr(loader, "backend", None) == "threads":
        return f"threads, num_threads={loader.num_threads}"
    return f"{getattr(loader, 'backend', type(loader).__name__)}, num_workers={loader.num_workers}"


def ffcv_epoch_rate(loader, limit: int) -> float:
    """``epoch_rate`` for an FFCV ``Loader``: its epoch thread, which decodes ahead, is stopped
    and joined before the next configuration is timed, and torch's thread count (which FFCV
    sets to its ``num_workers``) is put back to 1."""
    from queue import Empty
    it = iter(loader)
    start, seen = time.perf_counter(), 0
    try:
        for images, _ in it:
            assert images.dtype == torch.uint8 and tuple(images.shape[1:]) == (3, CROP, CROP)
            seen += len(images)
            if seen >= limit:
                break
        rate = seen / (time.perf_counter() - start)
    finally:
        it.terminate_event.set()
        it.join(2.0)
        while it.is_alive():        # blocked putting the end of the epoch in a full queue
            try:
                it.output_queue.get_nowait()
            except Empty:
                pass
            it.join(0.05)
        it.close()
        torch.set_num_threads(1)
    return rate


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
    parser.add_argument("--no-ffcv", action="store_true", help="skip FFCV even where it imports")
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

        ff, ffcv_reason = (None, "--no-ffcv") if args.no_ffcv else import_ffcv()
        ffcv_info: dict = {"status": "measured"} if ff else {"status": FFCV_SKIPPED, "why": ffcv_reason}
        ffcv_stored = ffcv_index = None
        if ff:
            beton = tmp_path / "train.beton"
            ffcv_info["write_seconds"] = write_ffcv(src, beton, ff)
            ffcv_info["bytes"] = beton.stat().st_size
            ffcv_info["ratio_to_source"] = ffcv_info["bytes"] / source_bytes
            ffcv_info["version"] = ff["version"]
            ffcv_info["writer"] = (f"DatasetWriter(RGBImageField(write_mode='jpg', max_resolution="
                                   f"{FFCV_MAX_RESOLUTION}, jpeg_quality={QUALITY}), IntField(), num_workers=2)")
            ffcv_stored = FfcvStored(beton, ff)
            ffcv_index = {Path(p).resolve(): i for i, (p, _) in enumerate(datasets.ImageFolder(src).samples)}
            print(f"(d) FFCV file {ffcv_info['bytes'] / 2**20:.1f} MiB ({ffcv_info['ratio_to_source']:.2f}x the "
                  f"source), written in {ffcv_info['write_seconds']:.1f} s")
        else:
            print(f"(d) {FFCV_SKIPPED} ({ffcv_reason})")

        fid = fidelity(dlstore.open_dataset(dst), args.resize_max, args.crops, seed=0, ffcv_stored=ffcv_stored,
                       ffcv_index=ffcv_index)
        print(f"(a) RandomResizedCrop({CROP}) vs torchvision on the original PIL image, {fid['crops']} crops:")
        for name, label in (("kernel", "tensor kernel on the original (floor)"),
                            ("resize_max", f"resize_max={args.resize_max}, no JPEG"), ("recipe", "recipe (resize_max + JPEG q90)")):
            print(f"    {label:<40} mean |d| {fid[name]['mean_abs_diff']:.2f} levels, "
                  f"PSNR {fid[name]['psnr_db']:.1f} dB")
        print(f"    per-crop PSNR of the recipe: median {fid['recipe']['per_crop_psnr_db']['median']:.1f} dB, "
              f"5th percentile {fid['recipe']['per_crop_psnr_db']['p5']:.1f} dB")
        if ff:
            f = fid["ffcv"]
            print(f"    {'FFCV (max_resolution 512, q90, INTER_AREA)':<40} mean |d| {f['mean_abs_diff']:.2f} levels, "
                  f"PSNR {f['psnr_db']:.1f} dB; per crop median {f['per_crop_psnr_db']['median']:.1f} dB, "
                  f"5th percentile {f['per_crop_psnr_db']['p5']:.1f} dB")
            print(f"    {'FFCV kernel alone (INTER_AREA, original)':<40} mean |d| {f['kernel']['mean_abs_diff']:.2f} "
                  f"levels, PSNR {f['kernel']['psnr_db']:.1f} dB; boxes equal to the recipe's: "
                  f"{f['box_same_as_recipe']}/{fid['crops']}; cv2.resize vs libffcv resize_crop max |d| "
                  f"{f['cv2_resize_vs_libffcv_resize_crop_max_abs_diff']}")

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
        # with workers 0 the default loader is a ThreadLoader of min(usable CPUs, 8) threads, not
        # one core: these two rows fix the count, 1 (per core, against FFCV w1) and 2 (both
        # cores, against FFCV w2, whose numba threads use both)
        threads_loaders = {f"store_threads{n}": dlstore.loader(
            dlstore.open_dataset(dst, transform=dynamic), batch_size=args.batch, shuffle=True, backend="threads",
            num_threads=n, generator=torch.Generator().manual_seed(0)) for n in (1, 2)}
        folder = datasets.ImageFolder(src, transform=v2.Compose(
            [v2.RandomResizedCrop(CROP, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor()]))
        folder_loader = DataLoader(folder, batch_size=args.batch, shuffle=True, num_workers=args.workers)
        limit = min(args.limit, len(folder))
        loaders = {"imagefolder": folder_loader, "store": store_loader, **threads_loaders, "store_pil": pil_loader,
                   "store_raw": raw_loader}
        store_backend = backend_of(store_loader)
        if ff:
            for w in (1, 2):
                loaders[f"ffcv_w{w}"] = ffcv_loader(beton, ff, args.batch, w)
            torch.set_num_threads(1)
        rates: dict[str, list[float]] = {name: [] for name in loaders}

        def rate(name: str, count: int) -> float:
            return (ffcv_epoch_rate if name.startswith("ffcv") else epoch_rate)(loaders[name], count)

        for name in loaders:
            rate(name, args.batch)              # warm-up: imports, first decodes, numba compiles
        for r in range(args.rounds):
            order = list(loaders) if r % 2 == 0 else list(reversed(loaders))
            for name in order:
                rates[name].append(rate(name, limit))
            print(f"    round {r}: " + ", ".join(f"{name} {rates[name][-1]:.0f}/s" for name in loaders))
        median = {name: statistics.median(v) for name, v in rates.items()}
        speedup = median["store"] / median["imagefolder"]
        print(f"(c) read rate, {limit} samples per round, batch {args.batch}, workers {args.workers}, "
              f"{args.rounds} rounds interleaved: ImageFolder {median['imagefolder']:.0f} samples/s, "
              f"store {median['store']:.0f} samples/s ({store_backend}): {speedup:.2f}x (target >= 5); held raw "
              f"{median['store_raw']:.0f} samples/s: {median['store_raw'] / median['imagefolder']:.2f}x")
        scaling = statistics.median(a / b for a, b in zip(rates["store_threads2"], rates["store_threads1"]))
        print(f"    backend='threads': threads=1 {median['store_threads1']:.0f} samples/s, threads=2 "
              f"{median['store_threads2']:.0f} samples/s: {scaling:.2f}x (median of the per-round ratios)")
        decoder = statistics.median(a / b for a, b in zip(rates["store"], rates["store_pil"]))
        print(f"    torchvision decode / PIL decode, the same store: {decoder:.2f}x (median of the per-round "
              f"ratios; {median['store_pil']:.0f} samples/s with PIL, "
              f"{median['store_pil'] / median['imagefolder']:.2f}x ImageFolder)")
        read_ffcv: dict = {}
        if ff:
            for w in (1, 2):
                read_ffcv[f"ffcv_w{w}"] = {"rates": rates[f"ffcv_w{w}"], "median": median[f"ffcv_w{w}"],
                                           "num_workers": w, "over_imagefolder":
                                           median[f"ffcv_w{w}"] / median["imagefolder"]}
            read_ffcv["store_over_ffcv_w2"] = median["store"] / median["ffcv_w2"]
            read_ffcv["store_over_ffcv_w1"] = median["store"] / median["ffcv_w1"]
            # like for like in cores: dlstore's n threads against FFCV's n numba threads, as the ratio
            # of the medians and as the median of the per-round ratios (less moved by one slow round)
            for n in (1, 2):
                mine, theirs = f"store_threads{n}", f"ffcv_w{n}"
                read_ffcv[f"{mine}_over_{theirs}"] = {
                    "of_medians": median[mine] / median[theirs],
                    "median_per_round": statistics.median(a / b for a, b in zip(rates[mine], rates[theirs])),
                    **({"target": 1.2} if n == 2 else {})}
            read_ffcv["ffcv_loader"] = ("Loader(order=RANDOM, os_cache default, CPU; image: "
                                        "RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip, ToTensor, "
                                        "ToTorchImage; label: IntDecoder, ToTensor)")
            print(f"    FFCV, num_workers 1: {median['ffcv_w1']:.0f} samples/s, num_workers 2: "
                  f"{median['ffcv_w2']:.0f} samples/s ({median['ffcv_w2'] / median['imagefolder']:.2f}x "
                  f"ImageFolder); dlstore default ({store_backend}) / FFCV w2: "
                  f"{read_ffcv['store_over_ffcv_w2']:.2f}x, / FFCV w1: {read_ffcv['store_over_ffcv_w1']:.2f}x")
            for n in (1, 2):
                ratio = read_ffcv[f"store_threads{n}_over_ffcv_w{n}"]
                print(f"    dlstore threads={n} / FFCV num_workers={n}: {ratio['of_medians']:.2f}x "
                      f"(per round, median {ratio['median_per_round']:.2f}x)" + (" (target >= 1.2)" if n == 2 else ""))
        else:
            read_ffcv = {"ffcv_w1": FFCV_SKIPPED, "ffcv_w2": FFCV_SKIPPED}
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
                     "store_backend": store_backend, "threads2_over_threads1": scaling,
                     "speedup_raw": median["store_raw"] / median["imagefolder"],
                     "torchvision_over_pil_decode": decoder, **read_ffcv},
            "ffcv": ffcv_info,
        })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
