"""Semantic segmentation from a dlstore store, as torchvision's segmentation references train.

    dlstore.convert(IMAGES, "train.shards", masks=MASKS, static="resize=160,center_crop=144x192")
    train = v2.Compose([v2.RandomCrop(128, padding=8, fill={tv_tensors.Image: 0, tv_tensors.Mask: 255}),
                        v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
    loader = dlstore.loader(dlstore.open_dataset("train.shards", transform=train), batch_size=16, shuffle=True)
    for images, masks in loader:                      # (B, 3, 128, 128) float, (B, 128, 128) uint8
        loss = F.cross_entropy(model(images), masks.long(), ignore_index=255)

The random crop and flip run on the image and its mask together, per batch, inside the read
from the store; ToDtype and Normalize touch only the image (as v2 does on ``(Image, Mask)``).
Validation reads the store of the held-out pairs as converted (the static ops only), and scores
the mean intersection over union of the classes, the ignore value left out.

    python examples/segmentation.py [--images IMAGES --masks MASKS] [--epochs 3] [--device cpu]

Without ``--images``: the demo set (``dlstore.sources.demo.make_segmentation_folder``), its last
fifth held out for validation.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torchvision import tv_tensors
from torchvision.transforms import v2

import dlstore
from dlstore.sources.demo import make_segmentation_folder

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
IGNORE = 255


def tiny_fcn(classes: int) -> nn.Module:
    """A small fully convolutional net: three strided stages down, one upsampling head."""
    def stage(cin: int, cout: int, stride: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    class FCN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(stage(3, 24, 1), stage(24, 48, 2), stage(48, 64, 2), stage(64, 64, 1))
            self.head = nn.Conv2d(64, classes, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.interpolate(self.head(self.body(x)), size=x.shape[-2:], mode="bilinear", align_corners=False)

    return FCN()


def mean_iou(confusion: torch.Tensor) -> float:
    """Mean over the classes that occur of intersection / union, from a (K, K) confusion matrix."""
    hits = confusion.diag().double()
    union = confusion.sum(0).double() + confusion.sum(1).double() - hits
    present = union > 0
    return float((hits[present] / union[present]).mean())


def evaluate(model: nn.Module, loader: dlstore.Loader, classes: int, device: torch.device) -> float:
    model.eval()
    confusion = torch.zeros(classes, classes, dtype=torch.int64)
    with torch.no_grad():
        for images, masks in loader:
            predicted = model(images.to(device)).argmax(1).cpu()
            keep = masks != IGNORE
            confusion += torch.bincount(masks[keep].long() * classes + predicted[keep],
                                        minlength=classes * classes).view(classes, classes)
    return mean_iou(confusion)


def make_stores(images: Path, masks: Path, work: Path, static: str) -> tuple[Path, Path]:
    """The training and validation stores: the pairs' last fifth (by name) held out."""
    pairs = sorted(p for p in images.rglob("*") if p.is_file())
    held_out = {p.stem for p in pairs[len(pairs) * 4 // 5:]}
    split = {}
    for name in ("train", "val"):
        for kind, folder in (("images", images), ("masks", masks)):
            dst = work / name / kind
            dst.mkdir(parents=True, exist_ok=True)
            for p in sorted(folder.rglob("*")):
                if p.is_file() and (p.stem in held_out) == (name == "val"):
                    (dst / p.name).symlink_to(p.resolve())
        split[name] = work / f"{name}.shards"
        dlstore.convert(work / name / "images", split[name], masks=work / name / "masks", static=static,
                        progress=False)
    return split["train"], split["val"]


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=Path)
    parser.add_argument("--masks", type=Path)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--count", type=int, default=80, help="pairs of the demo set")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    work = Path(tempfile.mkdtemp(prefix="dlstore-seg-"))
    if args.images is None:
        make_segmentation_folder(work / "demo", count=args.count, classes=args.classes, size=(120, 160))
        args.images, args.masks = work / "demo" / "images", work / "demo" / "masks"
    train_store, val_store = make_stores(args.images, args.masks, work, "resize=80,center_crop=72x96")
    train = v2.Compose([v2.RandomCrop(64, padding=4, fill={tv_tensors.Image: 0, tv_tensors.Mask: IGNORE}),
                        v2.RandomHorizontalFlip(),
                        v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
    val = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
    train_loader = dlstore.loader(dlstore.open_dataset(train_store, transform=train), batch_size=args.batch_size,
                                  shuffle=True, drop_last=True, num_workers=args.workers, seed=0, device=device)
    val_loader = dlstore.loader(dlstore.open_dataset(val_store, transform=val), batch_size=args.batch_size,
                                num_workers=args.workers)
    torch.manual_seed(0)
    model = tiny_fcn(args.classes).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    score = 0.0
    for epoch in range(args.epochs):
        model.train()
        train_loader.set_epoch(epoch)
        total = steps = 0.0
        for images, masks in train_loader:
            loss = F.cross_entropy(model(images), masks.long(), ignore_index=IGNORE)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total, steps = total + loss.item(), steps + 1
        score = evaluate(model, val_loader, args.classes, device)
        print(f"epoch {epoch}: loss {total / max(steps, 1):.3f}, val mIoU {score:.3f}")
    return score


if __name__ == "__main__":
    main()
