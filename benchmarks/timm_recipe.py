"""timm's train.py recipe with ``--aa rand-m9-mstd0.5``, data-bound: timm's own loader against dlstore's.

timm's training data path (train.py, timm 1.0): ``create_dataset`` (an ``ImageDataset`` over the
JPEGs), ``create_loader`` (``dataset.transform = create_transform(...)``: timm's
``RandomResizedCropAndInterpolation`` with train.py's default ``--train-interpolation random``
(``--train-interpolation bilinear``: one that runs on tensors),
a flip, ``RandAugment`` on PIL images, ``MaybePILToTensor``; a ``DataLoader`` with
``FastCollateMixup`` as ``collate_fn``; a ``PrefetchLoader`` that converts to float, normalises
and runs ``RandomErasing`` (``--reprob``) on the batch). Measured, on the same photos, the store
converted as docs/recipes.md says (``--static resize_max=512 --encoding jpeg --quality 90``):

* ``timm``: the script as is;
* ``dlstore dataset``: ``create_dataset(...)`` -> ``dlstore.open_dataset(store)``, the rest as is
  (``create_loader``'s assignment to ``dataset.transform`` is planned by dlstore; timm's DataLoader
  reads whole batches through ``__getitems__``);
* ``dlstore loader``: that, and the DataLoader inside timm's ``PrefetchLoader`` replaced by
  ``dlstore.Loader`` with the same arguments (``loader_train.loader = dlstore.Loader(...)``).

``--mixup 0.2 --cutmix 1.0 --reprob 0.25``, batch 32 (timm's default is 128; 400 images make
12 batches of 32), ``--workers`` 0 and 2 (timm's ``persistent_workers=True`` for both), a trivial
model (a 4x4 average pool and a linear layer, one SGD step per batch), two epochs back to back per
measurement, every configuration once a round, rounds interleaved (order reversed every other
round). Rates: samples/s over the two epochs.

Where the time goes (``--profile``): each step of a sample, timed alone on one thread: the decode
(timm's PIL open + convert against the store's ``decode_jpeg`` and the ``ToPILImage`` that timm's
PIL ops then need), the crop, RandAugment, the PIL -> tensor conversion, the collate and the
prefetcher's float conversion.

Images: as benchmarks/reference_recipe.py (``--photos DIR`` for real ones).

    python benchmarks/timm_recipe.py [--images 400] [--rounds 3] [--profile]
        [--out benchmarks/results/timm_recipe.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, uptime, write_json
from _photos import photo_store
from reference_recipe import TinyModel, make_photos, tree_bytes

import dlstore

timm_data = None      # imported in main: timm is an optional extra (pip install -e '.[examples]')

SIZE, AA, REPROB, MIXUP, CUTMIX = 224, "rand-m9-mstd0.5", 0.25, 0.2, 1.0
STATIC = "resize_max=512"
LOADERS = ("timm", "dlstore dataset", "dlstore loader")


def loader_options(workers: int, batch: int, interpolation: str) -> dict[str, Any]:
    """create_loader's arguments as train.py passes them for this recipe (CPU, prefetcher on)."""
    return dict(input_size=(3, SIZE, SIZE), batch_size=batch, is_training=True, re_prob=REPROB, re_mode="pixel",
                auto_augment=AA, interpolation=interpolation, num_workers=workers, device=torch.device("cpu"),
                use_prefetcher=True, mean=timm_data.IMAGENET_DEFAULT_MEAN, std=timm_data.IMAGENET_DEFAULT_STD)


def build(kind: str, src: Path, store: Path, workers: int, batch: int, classes: int, interpolation: str) -> Any:
    collate_fn = timm_data.FastCollateMixup(mixup_alpha=MIXUP, cutmix_alpha=CUTMIX, label_smoothing=0.1,
                                            num_classes=classes)
    if kind == "timm":
        dataset = timm_data.create_dataset("", root=str(src), split="", is_training=True)
    else:
        dataset = dlstore.open_dataset(store)
    loader = timm_data.create_loader(dataset, collate_fn=collate_fn, **loader_options(workers, batch, interpolation))
    if kind == "dlstore loader":
        loader.loader = dlstore.Loader(dataset, batch_size=batch, shuffle=True, drop_last=True, num_workers=workers,
                                       collate_fn=collate_fn, persistent_workers=workers > 0)
    return loader


def run(loader: Iterable, classes: int, epochs: int = 2, batches: int | None = None) -> float:
    """Samples/s over ``epochs`` passes (or the first ``batches`` of one), a training step per batch."""
    model = TinyModel(classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen, start = 0, time.perf_counter()
    for _ in range(epochs):
        for k, (images, targets) in enumerate(loader):
            if k == batches:
                break
            if images.dtype != torch.float32 or tuple(images.shape[1:]) != (3, SIZE, SIZE):
                raise RuntimeError(f"unexpected batch {images.dtype} {tuple(images.shape)}")
            loss = torch.sum(-targets * torch.log_softmax(model(images), dim=-1), dim=-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += len(images)
        if batches is not None:
            break
    return seen / (time.perf_counter() - start)


def _ms(fn: Any, n: int) -> float:
    fn(0)
    start = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - start) / n * 1e3


def profile(src: Path, store: Path, classes: int, batch: int, interpolation: str, n: int = 64) -> dict[str, Any]:
    """Milliseconds per sample of each step, timed alone in this thread."""
    from torchvision.transforms.v2 import functional as F

    ds = dlstore.open_dataset(store)
    pipeline = timm_data.create_transform(SIZE, is_training=True, auto_augment=AA, interpolation=interpolation,
                                          use_prefetcher=True)
    crop, flip, rand_augment, to_tensor = pipeline.transforms
    paths = [p for p, _ in timm_data.create_dataset("", root=str(src), split="", is_training=True).reader.samples[:n]]

    def timm_open(i: int) -> Image.Image:
        with open(paths[i % n], "rb") as f:      # timm's ImageDataset: Image.open(f).convert('RGB')
            return Image.open(f).convert("RGB")

    images = [timm_open(i) for i in range(n)]
    crops = [crop(img) for img in images]
    tensors = [to_tensor(c) for c in crops]
    collate = timm_data.FastCollateMixup(mixup_alpha=MIXUP, cutmix_alpha=CUTMIX, num_classes=classes)
    uint8 = torch.stack(tensors[:batch])
    mean = torch.tensor([x * 255 for x in timm_data.IMAGENET_DEFAULT_MEAN]).view(1, 3, 1, 1)
    std = torch.tensor([x * 255 for x in timm_data.IMAGENET_DEFAULT_STD]).view(1, 3, 1, 1)
    from timm.data.random_erasing import RandomErasing
    erase = RandomErasing(REPROB, mode="pixel", device="cpu")
    batches = [list(range(k, k + batch)) for k in range(0, n - batch + 1, batch)]
    return {
        "decode: timm's PIL open + convert('RGB') of the source JPEG": _ms(timm_open, n),
        "decode: the store's records (read_batch: decode_jpeg, batch by batch)": _ms(
            lambda k: ds.read_batch(batches[k % len(batches)]), len(batches)) / batch,
        "decode: ToPILImage of a stored sample (what timm's PIL ops then need)": _ms(
            lambda i: F.to_pil_image(ds.read(i % n)), n) - _ms(lambda i: ds.read(i % n), n),
        f"RandomResizedCropAndInterpolation(224, {interpolation}) on PIL": _ms(lambda i: crop(images[i % n]), n),
        "the same crop on the stored uint8 tensor (torchvision's v1 kernel)": _ms(
            lambda i: crop(ds.read(i % n)), n) - _ms(lambda i: ds.read(i % n), n),
        "RandomHorizontalFlip on PIL": _ms(lambda i: flip(crops[i % n]), n),
        "RandAugment rand-m9-mstd0.5 on PIL": _ms(lambda i: rand_augment(crops[i % n]), n),
        "MaybePILToTensor": _ms(lambda i: to_tensor(crops[i % n]), n),
        "FastCollateMixup, per sample": _ms(lambda i: collate([(t, 0) for t in tensors[:batch]]), 8) / batch,
        "PrefetchLoader: float, normalise, RandomErasing, per sample": _ms(
            lambda i: erase(uint8.float().sub_(mean).div_(std)), 8) / batch,
    }


def main() -> None:
    global timm_data
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--photos", help="an ImageFolder tree of real photos to measure instead")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", default="0,2", help="comma-separated worker counts")
    parser.add_argument("--train-interpolation", default="random", help="train.py's (default random)")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="time each step per sample, alone")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "timm_recipe.json"))
    args = parser.parse_args()
    import timm
    import timm.data
    timm_data = timm.data
    torch.set_num_threads(args.torch_threads)
    worker_counts = [int(w) for w in args.workers.split(",")]

    load_before = uptime()
    print(f"uptime before: {load_before}")
    with tempfile.TemporaryDirectory() as tmp:
        src, kind, store, converted = photo_store(tmp, args.photos, make_photos, args.images, STATIC)
        print(converted)
        ds = dlstore.open_dataset(store)
        timm_classes = timm_data.create_dataset("", root=str(src), split="", is_training=True).reader.class_to_idx
        if timm_classes != ds.class_to_idx:
            raise SystemExit(f"class order differs: timm {timm_classes}, store {ds.class_to_idx}")
        classes = len(ds.classes)
        configs = {(w, k): build(k, src, store, w, args.batch_size, classes, args.train_interpolation)
                   for w in worker_counts for k in LOADERS}
        for (w, k), loader in configs.items():
            inner = getattr(loader, "loader", loader)
            print(f"  workers {w}, {k}: {type(inner).__name__}" + (f" ({inner.backend})" if k == "dlstore loader"
                                                                     else ""))
        for loader in configs.values():      # warm-up: workers started (persistent), first decodes
            run(loader, classes, batches=3)
        rates: dict[tuple[int, str], list[float]] = {c: [] for c in configs}
        order = list(configs)
        for r in range(args.rounds):
            for c in (order if r % 2 == 0 else order[::-1]):
                rates[c].append(run(configs[c], classes))
            print(f"  round {r} ({uptime().split('load average: ')[-1]}): " + ", ".join(
                f"w{w} {k} {rates[(w, k)][-1]:.0f}/s" for (w, k) in order), flush=True)
        summary = {}
        print(f"\n{len(ds)} images ({kind}), batch {args.batch_size}, {args.rounds} rounds, samples/s (median):")
        for w in worker_counts:
            base = rates[(w, "timm")]
            for k in LOADERS:
                per_round = [a / b for a, b in zip(rates[(w, k)], base)]
                summary[f"w{w} {k}"] = {"rates": rates[(w, k)], "median": statistics.median(rates[(w, k)]),
                                        "over_timm_per_round": per_round,
                                        "over_timm": statistics.median(rates[(w, k)]) / statistics.median(base)}
                print(f"  workers {w}  {k:<16} {summary[f'w{w} {k}']['median']:7.0f}  "
                      f"{summary[f'w{w} {k}']['over_timm']:.2f}x timm (per round {min(per_round):.2f}-"
                      f"{max(per_round):.2f})")
        for loader in configs.values():
            close = getattr(getattr(loader, "loader", None), "close", None)
            if close is not None:
                close()
        prof = profile(src, store, classes, args.batch_size, args.train_interpolation) if args.profile else None
        if prof:
            print("\nper sample, timed alone (ms):")
            for name, ms in prof.items():
                print(f"  {ms:6.3f}  {name}")
        load_after = uptime()
        print(f"uptime after: {load_after}")
        sizes = [Image.open(p).size for p in sorted(src.rglob("*.jpg"))]
        write_json(args.out, {
            "benchmark": "timm_recipe",
            "machine": machine_info(),
            "load": {"before": load_before, "after": load_after},
            "config": {"images": len(ds), "source": kind, "static": STATIC, "encoding": "jpeg", "quality": 90,
                       "size": SIZE, "aa": AA, "reprob": REPROB, "mixup": MIXUP, "cutmix": CUTMIX,
                       "train_interpolation": args.train_interpolation, "batch_size": args.batch_size,
                       "rounds": args.rounds,
                       "epochs_per_measurement": 2, "torch_threads": args.torch_threads, "workers": worker_counts,
                       "model": "AdaptiveAvgPool2d(4) + Linear, SGD",
                       "source_mean_pixels": float(np.mean([w * h for w, h in sizes])),
                       "versions": {"torch": torch.__version__, "timm": timm.__version__,
                                    "dlstore": dlstore.__version__}},
            "store": {"source_bytes": tree_bytes(src), "store_bytes": tree_bytes(store),
                      "convert_seconds": converted.seconds},
            "results": summary,
            "profile_ms_per_sample": prof,
        })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
