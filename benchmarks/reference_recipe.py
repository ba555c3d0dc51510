"""torchvision's reference classification recipe, data-bound: the script as is against the script on a store.

The script is ``references/classification/train.py`` with its ``presets.py``: an ``ImageFolder``
whose transform is a ``ClassificationPresetTrain`` (a plain class holding a ``Compose`` in
``.transforms``), a ``DataLoader`` with ``sampler=``, ``num_workers=`` and ``collate_fn=``. The
switch (docs/recipes.md) converts the training folder once::

    dlstore convert train train.shards --static resize_max=512 --encoding jpeg --quality 90

and changes two calls: ``ImageFolder(traindir, preset)`` -> ``dlstore.open_dataset(store, preset)``,
``DataLoader(...)`` -> ``dlstore.Loader(...)``, the arguments as they are. This script runs both,
data-bound (a trivial model: a 4x4 average pool and a linear layer, one SGD step per batch), on
the same photo-like images, for the default preset (``RandomResizedCrop(224)``, flip,
``PILToTensor``, ``ConvertImageDtype`` (v1) or ``ToDtype`` (``--use-v2``), ``Normalize``) with
``collate_fn=default_collate`` (the script without ``--mixup-alpha``/``--cutmix-alpha``), at
``--workers 0`` and 2, and for context the recipe of torchvision's newer weights
(``--auto-augment ta_wide --random-erase 0.1 --mixup-alpha 0.2 --cutmix-alpha 1.0``, v2). Every
configuration is one epoch a round, the original and dlstore in turn, rounds interleaved (the
order reversed every other round).

Rates: samples/s from the first batch to the end of the epoch ("steady": what an epoch of
ImageNet sees, where starting the workers is a rounding error), and over the whole epoch
(worker start-up included, as this small epoch pays it). Targets (issue 42): steady rate of
dlstore over the original >= 2x at 2 workers and >= 3x at 0 workers, for v1 and v2.

With ``--workers 0`` the original runs in the main process, one core; ``dlstore.Loader`` then
builds batches on min(usable CPUs, 8) threads (``backend="threads"``), both cores here: the
``threads1`` rows fix it at one thread, core for core. torch's intra-op threads are set to 1 for
both (``--torch-threads``). ``--profile`` adds a per-sample breakdown of the original's work
and of dlstore's (decode, crop, conversion, collate), timed alone on one thread.

Images: ``--photos DIR`` (an ImageFolder tree of real photos), else ``--images`` JPEGs of
ImageNet-like sizes (longer side 500, shorter 333-375, 3 in 4 landscape) derived from the two
real photos scikit-learn ships (random crops, flips, colour gains, bicubic resize, JPEG q75-95),
or, without scikit-learn, ``dlstore.sources.demo`` images (stripes and noise).

    python benchmarks/reference_recipe.py [--images 400] [--rounds 3] [--batch-size 32]
        [--photos DIR] [--profile] [--out benchmarks/results/reference_recipe.json]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, RandomSampler, default_collate
from torchvision import datasets
from torchvision.transforms import InterpolationMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, uptime, write_json
from _photos import base_photos, derived_photo, photo_store

import dlstore

CROP, MEAN, STD = 224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
STATIC = "resize_max=512"


# --- the reference script's idioms (presets.py, transforms.py, train.py) -------------------

def _module(use_v2: bool) -> Any:
    if use_v2:
        import torchvision.transforms.v2 as T
    else:
        import torchvision.transforms as T
    return T


class ClassificationPresetTrain:
    """presets.py's training preset (backend "pil"), the options this benchmark uses."""

    def __init__(self, *, crop_size: int, auto_augment_policy: str | None = None, random_erase_prob: float = 0.0,
                 use_v2: bool = False):
        T = _module(use_v2)
        ops = [T.RandomResizedCrop(crop_size, interpolation=InterpolationMode.BILINEAR, antialias=True),
               T.RandomHorizontalFlip(0.5)]
        if auto_augment_policy == "ta_wide":
            ops.append(T.TrivialAugmentWide(interpolation=InterpolationMode.BILINEAR))
        ops += [T.PILToTensor(),
                T.ToDtype(torch.float, scale=True) if use_v2 else T.ConvertImageDtype(torch.float),
                T.Normalize(mean=MEAN, std=STD)]
        if random_erase_prob > 0:
            ops.append(T.RandomErasing(p=random_erase_prob))
        if use_v2:
            ops.append(T.ToPureTensor())
        self.transforms = T.Compose(ops)

    def __call__(self, img: Any) -> Any:
        return self.transforms(img)


def collate_for(mixup_alpha: float, cutmix_alpha: float, num_classes: int) -> Callable[[list], Any]:
    """train.py's collate_fn: ``default_collate``, or v2 MixUp / CutMix (one, chosen per batch) after it."""
    from torchvision.transforms import v2

    choices = ([v2.MixUp(alpha=mixup_alpha, num_classes=num_classes)] if mixup_alpha > 0 else []) + \
              ([v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes)] if cutmix_alpha > 0 else [])
    if not choices:
        return default_collate
    mixup_cutmix = v2.RandomChoice(choices)
    return lambda batch: mixup_cutmix(*default_collate(batch))


# --- the images ---------------------------------------------------------------------------

def make_photos(root: Path, count: int, classes: int = 10, seed: int = 0) -> str:
    """``count`` JPEGs of ImageNet-like sizes in ``classes`` class folders; returns what they are."""
    bases = base_photos()
    if bases is None:
        from dlstore.sources.demo import make_image_folder
        make_image_folder(root, classes=classes, per_class=math.ceil(count / classes), size=(375, 500), quality=85)
        return "dlstore.sources.demo images, 375x500, q85 (scikit-learn not installed)"
    rng = np.random.default_rng(seed)
    for k in range(count):
        shorter = int(rng.integers(333, 376))
        h, w = (shorter, 500) if rng.random() < 0.75 else (500, shorter)
        folder = root / f"class_{k % classes:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        derived_photo(rng, bases[k % len(bases)], h, w).save(folder / f"img_{k:05d}.jpg",
                                                             quality=int(rng.integers(75, 96)))
    return ("derived from scikit-learn's 2 real photos (china.jpg, flower.jpg): crops, flips, colour gains, "
            "bicubic resize to 500 x 333-375 (3 in 4 landscape), JPEG q75-95")


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# --- one epoch, data-bound ---------------------------------------------------------------

class TinyModel(torch.nn.Module):
    """A model that costs next to nothing: the loader bounds the epoch."""

    def __init__(self, classes: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(),
                                       torch.nn.Linear(48, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def epoch(loader: Iterable, classes: int, crop: int = CROP, batches: int | None = None) -> dict:
    """One pass (or its first ``batches``) with a training step per batch: {"steady": samples/s
    after the first batch, "whole": samples/s over the pass, "first_s": seconds to the first batch}."""
    model = TinyModel(classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = time.perf_counter()
    first_at, seen, after_first = None, 0, 0
    for k, (images, targets) in enumerate(loader):
        if k == batches:
            break
        if images.dtype != torch.float32 or tuple(images.shape[1:]) != (3, crop, crop):
            raise RuntimeError(f"unexpected batch {images.dtype} {tuple(images.shape)}")
        loss = torch.nn.functional.cross_entropy(model(images), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        seen += len(images)
        if first_at is None:
            first_at = time.perf_counter()
        else:
            after_first += len(images)
    end = time.perf_counter()
    return {"steady": after_first / (end - first_at), "whole": seen / (end - start), "first_s": first_at - start}


# --- the configurations ------------------------------------------------------------------

CONFIGS = {   # name: (preset options, collate options, workers)
    "v1_w0": (dict(use_v2=False), (0.0, 0.0), 0),
    "v2_w0": (dict(use_v2=True), (0.0, 0.0), 0),
    "v1_w2": (dict(use_v2=False), (0.0, 0.0), 2),
    "v2_w2": (dict(use_v2=True), (0.0, 0.0), 2),
    "full_v2_w0": (dict(use_v2=True, auto_augment_policy="ta_wide", random_erase_prob=0.1), (0.2, 1.0), 0),
    "full_v2_w2": (dict(use_v2=True, auto_augment_policy="ta_wide", random_erase_prob=0.1), (0.2, 1.0), 2),
}
THREADS1 = ("v1_w0", "v2_w0")    # dlstore at one loader thread too, core for core with the original


def build(name: str, src: Path, store: Path, batch: int, classes: int, passes: int) -> dict[str, Any]:
    """The loaders of one configuration: the original script's and the switched one's. The sampler
    is train.py's ``RandomSampler``, its epoch ``passes`` permutations long (``num_samples``)."""
    preset_options, (mixup, cutmix), workers = CONFIGS[name]
    collate_fn = collate_for(mixup, cutmix, classes)
    preset = ClassificationPresetTrain(crop_size=CROP, **preset_options)
    pin = torch.cuda.is_available()          # train.py passes pin_memory=True
    folder = datasets.ImageFolder(str(src), preset)
    loaders: dict[str, Any] = {
        "original": DataLoader(folder, batch_size=batch, sampler=RandomSampler(folder, num_samples=passes * len(folder)),
                               num_workers=workers, pin_memory=pin, collate_fn=collate_fn)}
    ds = dlstore.open_dataset(store, preset)
    loaders["dlstore"] = dlstore.Loader(ds, batch_size=batch, sampler=RandomSampler(ds, num_samples=passes * len(ds)),
                                        num_workers=workers, pin_memory=pin, collate_fn=collate_fn)
    if name in THREADS1:
        loaders["dlstore_threads1"] = dlstore.Loader(
            ds, batch_size=batch, sampler=RandomSampler(ds, num_samples=passes * len(ds)), pin_memory=pin,
            collate_fn=collate_fn, num_threads=1)
    return loaders


def run_rounds(loaders: dict[str, dict[str, Any]], rounds: int, classes: int) -> dict[str, dict[str, list[dict]]]:
    """Every loader one epoch a round, in a fixed order reversed every other round."""
    order = [(c, k) for c, ls in loaders.items() for k in ls]
    results: dict[str, dict[str, list[dict]]] = {c: {k: [] for k in ls} for c, ls in loaders.items()}
    for (c, k) in order:     # warm-up: imports, first decodes, compiled kernels
        epoch(loaders[c][k], classes, batches=3)
    for r in range(rounds):
        for (c, k) in (order if r % 2 == 0 else order[::-1]):
            results[c][k].append(epoch(loaders[c][k], classes))
        print(f"  round {r} ({uptime().split('load average: ')[-1]}): " + ", ".join(
            f"{c} {results[c]['dlstore'][-1]['steady'] / results[c]['original'][-1]['steady']:.2f}x"
            for c in loaders), flush=True)
    return results


def summarise(results: dict[str, dict[str, list[dict]]], loaders: dict[str, dict[str, Any]]) -> dict:
    out = {}
    for c, by_loader in results.items():
        med = {k: {m: statistics.median(e[m] for e in runs) for m in ("steady", "whole", "first_s")}
               for k, runs in by_loader.items()}
        per_round = [d["steady"] / o["steady"] for d, o in zip(by_loader["dlstore"], by_loader["original"])]
        workers = CONFIGS[c][2]
        entry = {"median": med, "runs": by_loader,
                 "speedup_steady": med["dlstore"]["steady"] / med["original"]["steady"],
                 "speedup_steady_per_round": {"median": statistics.median(per_round), "min": min(per_round),
                                              "max": max(per_round)},
                 "speedup_whole": med["dlstore"]["whole"] / med["original"]["whole"],
                 "dlstore_backend": loaders[c]["dlstore"].backend, "workers": workers}
        if not c.startswith("full"):
            entry["target"] = 3.0 if workers == 0 else 2.0
        if "dlstore_threads1" in med:
            entry["speedup_threads1_steady"] = med["dlstore_threads1"]["steady"] / med["original"]["steady"]
        out[c] = entry
    return out


# --- where the time goes (--profile) -------------------------------------------------------

def _ms(fn: Callable[[int], Any], n: int) -> float:
    fn(0)
    start = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - start) / n * 1e3


def profile(src: Path, store: Path, batch: int, n: int = 64) -> dict[str, Any]:
    """Milliseconds per sample, in this thread (torch at one thread): the original's steps timed
    alone, and dlstore's ``get_batch`` for each preset with cProfile's largest entries."""
    import cProfile
    import pstats

    from torchvision.transforms import v2
    from torchvision.transforms.v2 import functional as F

    from dlstore.sources import pil_loader

    paths = [p for p, _ in datasets.ImageFolder(str(src)).samples[:n]]
    images = [pil_loader(p) for p in paths]
    crop = v2.RandomResizedCrop(CROP, antialias=True)
    cropped = [crop(img) for img in images]
    floats = [F.normalize(F.convert_image_dtype(F.pil_to_tensor(x), torch.float), MEAN, STD) for x in cropped]
    out: dict[str, Any] = {"original (ImageFolder + preset + DataLoader), each step alone": {
        "pil_loader: open, decode, RGB": _ms(lambda i: pil_loader(paths[i % n]), n),
        "RandomResizedCrop(224) on PIL": _ms(lambda i: crop(images[i % n]), n),
        "flip, PILToTensor, ConvertImageDtype, Normalize": _ms(lambda i: F.normalize(F.convert_image_dtype(
            F.pil_to_tensor(F.horizontal_flip(cropped[i % n])), torch.float), MEAN, STD), n),
        f"default_collate of {batch} float samples": _ms(
            lambda i: default_collate([(floats[(i + j) % n], 0) for j in range(batch)]), 8) / batch}}
    for use_v2 in (False, True):
        ds = dlstore.open_dataset(store, ClassificationPresetTrain(crop_size=CROP, use_v2=use_v2))
        g = torch.Generator().manual_seed(0)
        batches = [list(range(k * batch, (k + 1) * batch)) for k in range(len(ds) // batch)]
        total = _ms(lambda k: ds.get_batch(batches[k % len(batches)], generator=g), len(batches)) / batch
        prof = cProfile.Profile()
        prof.enable()
        for b in batches:
            ds.get_batch(b, generator=g)
        prof.disable()
        stats = pstats.Stats(prof).stats       # (file, line, name) -> (calls, primitive, tottime, cumtime, callers)
        top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:5]
        samples = len(batches) * batch
        out[f"dlstore get_batch, {'v2' if use_v2 else 'v1'} preset"] = {
            "total": total,
            **{f"{name} (tottime, cProfile)": t / samples * 1e3 for (_, _, name), (_, _, t, _, _) in top}}
    return out


# --- main ---------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--photos", help="an ImageFolder tree of real photos to measure instead")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="train.py's default")
    parser.add_argument("--passes", type=int, default=2, help="permutations of the images in one timed epoch")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="time each step per sample, alone")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "reference_recipe.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    names = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown --configs {unknown}; choose from {list(CONFIGS)}")

    load_before = uptime()
    print(f"uptime before: {load_before}")
    with tempfile.TemporaryDirectory() as tmp:
        src, kind, store, converted = photo_store(tmp, args.photos, make_photos, args.images, STATIC)
        print(converted)
        classes = len(datasets.ImageFolder(str(src)).classes)
        sizes = [Image.open(p).size for p in sorted(src.rglob("*.jpg"))]
        loaders = {c: build(c, src, store, args.batch_size, classes, args.passes) for c in names}
        for c in names:
            print(f"  {c}: dlstore backend {loaders[c]['dlstore'].backend}")
        results = run_rounds(loaders, args.rounds, classes)
        summary = summarise(results, loaders)
        print(f"\n{len(sizes)} images ({kind}), batch {args.batch_size}, {args.rounds} rounds, samples/s (median):")
        print(f"  {'config':<11} {'backend':<10} {'original':>9} {'dlstore':>9} {'steady x':>9} {'whole x':>8} "
              f"{'threads=1 x':>11}  target")
        for c, s in summary.items():
            m = s["median"]
            t1 = f"{s['speedup_threads1_steady']:.2f}" if "speedup_threads1_steady" in s else ""
            target = f">= {s['target']:.0f}x: {'met' if s['speedup_steady'] >= s['target'] else 'NOT met'}" \
                if "target" in s else "(context)"
            print(f"  {c:<11} {s['dlstore_backend']:<10} {m['original']['steady']:>9.0f} "
                  f"{m['dlstore']['steady']:>9.0f} "
                  f"{s['speedup_steady']:>8.2f}x {s['speedup_whole']:>7.2f}x {t1:>11}  {target}")
        prof = profile(src, store, args.batch_size) if args.profile else None
        if prof:
            print("\nper sample, timed alone (ms):")
            for part, steps in prof.items():
                print(f"  {part}:")
                for k, v in steps.items():
                    print(f"    {v:6.3f}  {k}")
        load_after = uptime()
        print(f"uptime after: {load_after}")
        write_json(args.out, {
            "benchmark": "reference_recipe",
            "machine": machine_info(),
            "load": {"before": load_before, "after": load_after},
            "config": {"images": len(sizes), "source": kind, "static": STATIC, "encoding": "jpeg", "quality": 90,
                       "crop": CROP, "batch_size": args.batch_size, "rounds": args.rounds,
                       "samples_per_epoch": args.passes * len(sizes),
                       "torch_threads": args.torch_threads, "model": "AdaptiveAvgPool2d(4) + Linear, SGD",
                       "configs": {c: {"preset": CONFIGS[c][0], "mixup_cutmix": CONFIGS[c][1],
                                       "workers": CONFIGS[c][2]} for c in names},
                       "source_mean_pixels": float(np.mean([w * h for w, h in sizes])),
                       "versions": {"torch": torch.__version__, "dlstore": dlstore.__version__}},
            "store": {"source_bytes": tree_bytes(src), "store_bytes": tree_bytes(store),
                      "convert_seconds": converted.seconds},
            "results": summary,
            "profile_ms_per_sample": prof,
        })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
