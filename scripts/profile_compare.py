#!/usr/bin/env python
"""The picture in docs/tools.md: your current pipeline (torchvision ImageFolder, decode + resize +
crop per sample, DataLoader workers) against a dlstore store of the same images, feeding the same
training step (a small conv net, forward/backward/SGD), with ``dlstore.tools.profile_training``.

    python scripts/profile_compare.py [--out docs/img/profile_compare.png] [--device cpu] [--steps 20]

It writes demo JPEGs (500x375, as ``dlstore demo``) and their store (``resize=256,center_crop=224``)
into a temporary folder, runs both loaders one after the other with the same step, prints the
report of each with the machine's load average, and saves the two-panel timeline. On CUDA the
panels carry the GPU utilisation sampled beside the loop; on the CPU (the committed picture) they
show wait vs step only.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.transforms import v2

import dlstore
from dlstore.sources.demo import make_image_folder
from dlstore.tools import profile_training, training_step, usable_cpus


def small_convnet(classes: int) -> torch.nn.Module:
    """A light model (4x4 average pooling first, then two convolutions): a step of tens of ms on a
    CPU, about what a GPU step of a real model costs, so the loader's share shows."""
    return torch.nn.Sequential(
        torch.nn.AvgPool2d(4),
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, classes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/img/profile_compare.png")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--workers", type=int, default=min(4, usable_cpus()))
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch.set_num_threads in the loop (1, as dlstore profile advises on a busy "
                             "machine: on 2 shared cores the step took 100 ms with 2 threads, 13 ms with 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_image_folder(root / "images", classes=3, per_class=args.images // 3)
        dlstore.convert(root / "images", root / "train.shards", static="resize=256,center_crop=224",
                        progress=False)
        folder = datasets.ImageFolder(str(root / "images"), transform=v2.Compose(
            [v2.Resize(256, antialias=True), v2.CenterCrop(224), v2.PILToTensor()]))
        loaders = {
            f"current pipeline: ImageFolder + DataLoader(num_workers={args.workers})":
                DataLoader(folder, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                           persistent_workers=args.workers > 0),
            "dlstore: dlstore.loader(open_dataset('train.shards'))":
                dlstore.loader(dlstore.open_dataset(root / "train.shards"), batch_size=args.batch_size,
                               shuffle=True),
        }
        model = small_convnet(3).to(args.device)
        step = training_step(model, torch.nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.01),
                             device=args.device)
        load = os.getloadavg()[0]
        result = profile_training(loaders, step, steps=args.steps, device=args.device, plot=args.out,
                                  title=f"batch {args.batch_size}, small conv net on {args.device} "
                                        f"({args.torch_threads} torch thread(s)), "
                                        f"{usable_cpus()} usable CPUs, 1-min load average {load:.1f}")
    print(result)
    print(f"load average (1 min) {load:.2f} before, {os.getloadavg()[0]:.2f} after; {usable_cpus()} usable CPUs")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
