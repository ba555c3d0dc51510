"""CIFAR-10 from GPU memory: convert once, preload, augment and train on the device.

    torchvision.datasets.CIFAR10(download=True) --dlstore.convert--> cifar10.shards
        --dlstore.GPUDataset--> the whole training set on the device (fp16, normalised), with its transform
        --dlstore.loader--> per batch: random crop (padding 4) + flip on the device, no workers

    python examples/cifar10_gpu.py --device cuda            # downloads CIFAR-10 to ./data once
    python examples/cifar10_gpu.py --device cpu --steps 20  # the same code on the CPU

``train()`` takes any fixed-shape store, so the tests run it on a store converted
from an in-memory array instead of downloading CIFAR-10.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import dlstore
from dlstore.transforms import BatchCompose, BatchRandomCrop, BatchRandomHorizontalFlip

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def convert_cifar10(root: str | Path, store: str | Path) -> Path:
    """CIFAR-10's training set as a shards store (kept if it exists already)."""
    import torchvision

    if not Path(store).exists():
        train = torchvision.datasets.CIFAR10(root, train=True, download=True)   # PIL images, no transform
        print(dlstore.convert(train, store, progress=False))
    return Path(store)


def conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class Residual(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(conv_bn(channels, channels), conv_bn(channels, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class Scale(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def make_model(classes: int = 10, width: int = 32) -> nn.Module:
    """A tiny ResNet: 32x32 -> 16 -> 8 -> 4, one residual block per stage."""
    return nn.Sequential(
        conv_bn(3, width),
        conv_bn(width, 2 * width), nn.MaxPool2d(2), Residual(2 * width),
        conv_bn(2 * width, 4 * width), nn.MaxPool2d(2),
        conv_bn(4 * width, 8 * width), nn.MaxPool2d(2), Residual(8 * width),
        nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(8 * width, classes),
        Scale(0.125),   # small logits at the start keep the first SGD steps from diverging (as airbench does)
    )


def train(store: str | Path, *, device: str = "cuda", epochs: int = 1, steps: int | None = None,
          batch_size: int = 512, lr: float = 0.05, width: int = 32, seed: int = 0) -> list[float]:
    """Train ``make_model()`` on ``store`` held in ``device`` memory; returns the loss of every step."""
    torch.manual_seed(seed)
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    data = dlstore.GPUDataset(store, device=device, dtype=dtype, normalize=(MEAN, STD),
                              transform=BatchCompose([BatchRandomCrop(32, padding=4), BatchRandomHorizontalFlip()]))
    print(data, f"loaded in {data.load_seconds:.2f} s")
    loader = dlstore.loader(data, batch_size, shuffle=True, drop_last=True, seed=seed, channels_last=True)
    model = make_model(len(data.classes), width).to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    losses: list[torch.Tensor] = []     # kept on the device: no sync with the host per step
    for epoch in range(epochs):
        start = time.perf_counter()
        for images, labels in loader:            # device tensors, augmented on the device
            # bf16 autocast on CUDA: no loss scaler needed; the CPU runs float32 throughout
            with torch.autocast(data.device.type, dtype=torch.bfloat16, enabled=data.device.type == "cuda"):
                loss = F.cross_entropy(model(images), labels, label_smoothing=0.2)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            if steps is not None and len(losses) >= steps:
                return torch.stack(losses).tolist()
        print(f"epoch {epoch}: {len(loader)} steps, last loss {losses[-1].item():.3f}, "
              f"{time.perf_counter() - start:.1f} s")
    return torch.stack(losses).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--data", default="data", help="where torchvision downloads CIFAR-10")
    parser.add_argument("--store", default="cifar10.shards")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--batch-size", type=int, default=512)
    args = parser.parse_args()
    store = convert_cifar10(args.data, args.store)
    losses = train(store, device=args.device, epochs=args.epochs, steps=args.steps, batch_size=args.batch_size)
    print(f"{len(losses)} steps, final loss {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
