"""Segmentation training parity: a small FCN trained through torchvision and through dlstore scores the same.

Data: ``_segdata.make_segmentation_set`` (four shape classes, each with its colour and texture, on
photo crops, a 1-pixel ignore band around every boundary), ``--train`` + ``--val`` pairs of 96x128,
data seed 0. Every path implements this pipeline on ``(image, tv_tensors.Mask)``::

    static  v2.Resize(80), v2.CenterCrop((72, 96))                  (dlstore: at conversion)
    random  v2.RandomCrop(64, padding=8, fill={tv_tensors.Image: 0, tv_tensors.Mask: 255}),
            v2.RandomHorizontalFlip()

Paths (the seed fixes the model's init, the order and the random draws):

  (a) torchvision  a PIL segmentation Dataset (``_segdata.PairFolder``: static on PIL, ``v2.ToImage()``,
                   random) + ``torch.utils.data.DataLoader(num_workers=0)``
  (b) dlstore      ``dlstore.convert(images, shards, masks=masks, static=...)``, ``open_dataset(shards,
                   transform=v2.Compose(random))`` + ``dlstore.loader(num_workers=0, seed=seed)``
Controls, deliberately wrong, through the torchvision path:

  (u) unpaired flip  the flip drawn separately for the image and for the mask (``flip(image)``,
                     ``flip(mask)``: the classic bug of transforming them one by one), so half the
                     flipped samples carry a mirrored mask
  (z) fill 0         the mask padded with 0 (background) instead of 255 (ignore)

The model: 4 conv-BN-ReLU blocks (``--width`` channels, one of stride 2, two dilated), a 1x1
classifier and a 2x bilinear upsample; AdamW with a one-cycle learning rate, cross-entropy with
``ignore_index=255``; one torch thread. Evaluation: the held-out split through the static part
only (whole 72x96 images, the same tensors for every path), mean IoU over the five classes
(background included) from the confusion matrix of all non-ignore pixels.

Parity criterion, decided before the runs: the noise band is ``max(1 point, 2 std(a))`` of the
mean IoU over the seeds; (b) is at parity when ``|mean(b) - mean(a)|`` is within the band, and a
control is caught when its distance from (a) is outside it. The table prints both, and so does the
JSON. Before training, a pixel check: the first ``--check`` samples of the store (no transform)
must equal torchvision's static part of the same pairs, image and mask, bit for bit.

    python benchmarks/seg_parity.py [--seeds 3] [--epochs 6] [--train 384] [--val 128]
        [--paths ab] [--controls uz] [--torchvision-only] [--out benchmarks/results/seg_parity.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader
from torchvision import tv_tensors
from torchvision.transforms import v2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, uptime, write_json  # noqa: E402
from _segdata import CLASSES, IGNORE, PairFolder, make_segmentation_set  # noqa: E402

import dlstore  # noqa: E402

SIZE = (96, 128)
RESIZE, CENTER_CROP, CROP, PADDING = 80, (72, 96), 64, 8
STATIC = f"resize={RESIZE},center_crop={CENTER_CROP[0]}x{CENTER_CROP[1]}"
MEAN, STD = 0.45, 0.25
NAMES = {"a": "torchvision", "b": "dlstore", "u": "unpaired flip", "z": "mask fill 0"}
FLOOR = 1.0   # points of mean IoU: the least noise band


def static_ops() -> list[v2.Transform]:
    return [v2.Resize(RESIZE), v2.CenterCrop(CENTER_CROP)]


def random_ops(mask_fill: int = IGNORE) -> list[v2.Transform]:
    return [v2.RandomCrop(CROP, padding=PADDING, fill={tv_tensors.Image: 0, tv_tensors.Mask: mask_fill}),
            v2.RandomHorizontalFlip()]


class UnpairedFlip:
    """The bug of control (u): the joint crop, then a flip drawn for the image and another for the mask."""

    def __init__(self):
        self.joint = v2.Compose([*static_ops(), v2.ToImage(), random_ops()[0]])
        self.flip = v2.RandomHorizontalFlip()

    def __call__(self, image, mask):
        image, mask = self.joint(image, mask)
        return self.flip(image), self.flip(mask)


def torchvision_transform(path: str):
    if path == "u":
        return UnpairedFlip()
    return v2.Compose([*static_ops(), v2.ToImage(), *random_ops(0 if path == "z" else IGNORE)])


def make_loader(path: str, seg, store: Path | None, *, seed: int, batch_size: int) -> Iterable:
    """Path ``path``'s training loader of (images uint8 (B,3,64,64), masks uint8 (B,64,64)); one epoch per iter."""
    if path == "b":
        ds = dlstore.open_dataset(store, transform=v2.Compose(random_ops()))
        return dlstore.loader(ds, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=0, seed=seed)
    ds = PairFolder(seg.images("train"), seg.masks("train"), torchvision_transform(path))
    return DataLoader(ds, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=0,
                      generator=torch.Generator().manual_seed(seed))


def static_pairs(seg, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The split through torchvision's static part: images uint8 (N,3,72,96), masks uint8 (N,72,96)."""
    ds = PairFolder(seg.images(split), seg.masks(split), v2.Compose([*static_ops(), v2.ToImage()]))
    images, masks = zip(*(ds[i] for i in range(len(ds))))
    return torch.stack([torch.as_tensor(x) for x in images]), torch.stack([torch.as_tensor(m) for m in masks])


def pixel_check(store: Path, train: tuple[torch.Tensor, torch.Tensor], count: int) -> dict:
    """How many of the store's first ``count`` samples equal torchvision's static pixels, image and mask."""
    ds = dlstore.open_dataset(store)
    same_images = same_masks = 0
    for i in range(min(count, len(ds))):
        image, mask = ds[i]
        same_images += torch.equal(torch.as_tensor(image), train[0][i])
        same_masks += torch.equal(torch.as_tensor(mask), train[1][i])
    return {"samples": min(count, len(ds)), "images_equal": same_images, "masks_equal": same_masks}


# --- the model ---------------------------------------------------------------------------

def make_model(width: int) -> nn.Module:
    def block(cin: int, cout: int, stride: int = 1, dilation: int = 1) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride, padding=dilation, dilation=dilation, bias=False),
                nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    w = width
    return nn.Sequential(*block(3, w), *block(w, 2 * w, stride=2), *block(2 * w, 2 * w, dilation=2),
                         *block(2 * w, 2 * w, dilation=4), nn.Conv2d(2 * w, len(CLASSES), 1),
                         nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False))


def as_input(images: torch.Tensor) -> torch.Tensor:
    return (torch.as_tensor(images).float() / 255 - MEAN) / STD


def mean_iou(model: nn.Module, val: tuple[torch.Tensor, torch.Tensor], batch_size: int = 64) -> tuple[float, list]:
    """(mean IoU in %, IoU per class) over the non-ignore pixels of ``val``."""
    classes = len(CLASSES)
    confusion = torch.zeros(classes * classes, dtype=torch.long)
    model.eval()
    with torch.no_grad():
        for start in range(0, len(val[0]), batch_size):
            predicted = model(as_input(val[0][start:start + batch_size])).argmax(1)
            truth = val[1][start:start + batch_size].long()
            keep = truth != IGNORE
            confusion += torch.bincount(truth[keep] * classes + predicted[keep], minlength=classes * classes)
    confusion = confusion.view(classes, classes).double()
    tp = confusion.diag()
    iou = tp / (confusion.sum(0) + confusion.sum(1) - tp).clamp(min=1)
    return 100 * iou.mean().item(), [round(100 * v, 2) for v in iou.tolist()]


def train(path: str, seg, store: Path | None, val, *, seed: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(seed)
    model = make_model(args.width)
    loader = make_loader(path, seg, store, seed=seed, batch_size=args.batch_size)
    steps = args.epochs * len(loader)
    optimiser = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=args.lr, total_steps=steps)
    loss_fn = nn.CrossEntropyLoss(ignore_index=IGNORE)
    start, data_seconds = time.perf_counter(), 0.0
    for epoch in range(args.epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        model.train()
        waited = time.perf_counter()
        for images, masks in loader:
            data_seconds += time.perf_counter() - waited
            loss = loss_fn(model(as_input(images)), torch.as_tensor(masks).long())
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            schedule.step()
            waited = time.perf_counter()
    seconds = time.perf_counter() - start
    miou, per_class = mean_iou(model, val)
    return {"path": path, "seed": seed, "miou": miou, "iou": per_class, "final_loss": loss.item(),
            "seconds": seconds, "data_seconds": data_seconds}


# --- the protocol ------------------------------------------------------------------------

def verdicts(runs: list[dict], order: str) -> dict[str, dict]:
    """Per path: mean and std of the mean IoU over seeds, its distance from (a), and the verdict."""
    by_path = {p: [r["miou"] for r in runs if r["path"] == p] for p in order}
    reference = by_path["a"]
    band = max(FLOOR, 2 * statistics.stdev(reference)) if len(reference) > 1 else FLOOR
    out = {}
    for path, scores in by_path.items():
        if not scores:
            continue
        mean = statistics.mean(scores)
        row = {"name": NAMES[path], "seeds": len(scores), "mean": mean,
               "std": statistics.stdev(scores) if len(scores) > 1 else 0.0, "runs": scores,
               "diff": mean - statistics.mean(reference), "band": band}
        inside = abs(row["diff"]) <= band
        if path == "b":
            row["verdict"] = "parity" if inside else "NOT at parity"
        elif path != "a":
            row["verdict"] = "caught" if not inside else "NOT caught"
        out[path] = row
    return out


def report(rows: dict[str, dict], runs: list[dict], check: dict | None) -> None:
    print(f"\n{'path':20s} {'mIoU %':>7s} {'std':>5s} {'vs (a)':>7s} {'band':>5s}  {'per seed':24s} "
          f"{'s/run':>6s} {'data s':>6s}  verdict")
    for path, row in rows.items():
        mine = [r for r in runs if r["path"] == path]
        seconds = statistics.mean(r["seconds"] for r in mine)
        data = statistics.mean(r["data_seconds"] for r in mine)
        seeds = " ".join(f"{s:.1f}" for s in row["runs"])
        print(f"({path}) {row['name']:16s} {row['mean']:7.2f} {row['std']:5.2f} {row['diff']:+7.2f} "
              f"{row['band']:5.2f}  {seeds:24s} {seconds:6.1f} {data:6.1f}  {row.get('verdict', 'reference')}")
    if check is not None:
        print(f"pixel check, store vs torchvision static: {check['images_equal']}/{check['samples']} images, "
              f"{check['masks_equal']}/{check['samples']} masks identical")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--train", type=int, default=384, help="training pairs")
    parser.add_argument("--val", type=int, default=128, help="held-out pairs")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=16, help="channels of the first block")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--paths", default="ab")
    parser.add_argument("--controls", default="uz", help="controls to run (u, z; '' for none)")
    parser.add_argument("--check", type=int, default=32, help="store samples in the pixel check")
    parser.add_argument("--torchvision-only", action="store_true", help="leave out (b) and the store")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "seg_parity.json"))
    args = parser.parse_args()
    order = "".join(p for p in args.paths + args.controls if not (args.torchvision_only and p == "b"))
    unknown = set(order) - set(NAMES)
    if unknown or "a" not in order:
        parser.error(f"paths and controls among {', '.join(NAMES)}, (a) included; got {order!r}")
    args.order = order
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    load_before, started = uptime(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dlstore-segparity-") as tmp:
        seg = make_segmentation_set(Path(tmp) / "data", {"train": args.train, "val": args.val}, size=SIZE, seed=0)
        val = static_pairs(seg, "val")
        store, check = None, None
        if "b" in args.order:
            store = dlstore.convert(seg.images("train"), Path(tmp) / "train.shards", masks=seg.masks("train"),
                                    static=STATIC, store_format="shards", progress=False).path
            check = pixel_check(store, static_pairs(seg, "train"), args.check)
        runs = []
        # seed-major: a change of machine load hits every path of a seed alike
        for seed in range(args.seeds):
            for path in args.order:
                run = train(path, seg, store, val, seed=seed, args=args)
                runs.append(run)
                print(f"seed {seed} ({path}) {NAMES[path]:14s} mIoU {run['miou']:6.2f}  loss {run['final_loss']:.3f}  "
                      f"{run['seconds']:.1f} s", flush=True)
    rows = verdicts(runs, args.order)
    load_after = uptime()
    report(rows, runs, check)
    print(f"total {time.perf_counter() - started:.0f} s\nload before: {load_before}\nload after:  {load_after}")
    payload = {
        "benchmark": "seg_parity", "machine": machine_info(), "load_before": load_before, "load_after": load_after,
        "data": {"train": args.train, "val": args.val, "size": list(SIZE), "classes": list(CLASSES),
                 "static": STATIC, "random": repr(v2.Compose(random_ops())), "eval": "val through the static part"},
        "training": {"seeds": args.seeds, "epochs": args.epochs, "batch_size": args.batch_size, "width": args.width,
                     "lr": args.lr, "optimiser": "AdamW one-cycle", "torch_threads": torch.get_num_threads()},
        "criterion": f"|mean(x) - mean(a)| <= max({FLOOR} point, 2 std(a)) of the mean IoU over seeds",
        "pixel_check": check, "results": rows, "runs": runs, "seconds": time.perf_counter() - started,
    }
    print(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
