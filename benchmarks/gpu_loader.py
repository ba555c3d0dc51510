"""GPUDataset + its loader vs a DataLoader over the same store, measured in one run.

Runs the steps of ``scripts/gpu_check.py`` (the same code: build a CIFAR-sized
and an ImageNet-sized store with ``dlstore.convert``, measure the host-to-device
or memory-copy bandwidth, preload with ``GPUDataset``, check it against the CPU
path, time epochs of the GPU loader with random crop + flip against a DataLoader
with the same augmentations per sample at its best worker count) with sizes
that suit the machine: on a CPU-only machine ``device="cpu"`` and fewer samples.

    python benchmarks/gpu_loader.py [--device cpu] [--cifar 10000] [--imagenet 1000]
                                    [--out benchmarks/results/gpu_loader.json]

Prints the table and the ratios; writes JSON with the machine, versions, data
sizes and every repeat. On CPU the figures say how the same code path behaves
without a GPU; the issue's speed targets apply to the CUDA run of
``scripts/gpu_check.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import load_gpu_check, machine_info, write_json  # noqa: E402


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--cifar", type=int, default=50_000 if cuda else 10_000)
    parser.add_argument("--imagenet", type=int, default=10_000 if cuda else 1_000)
    parser.add_argument("--epochs", type=int, default=20 if cuda else 5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--out", default=str(HERE / "results" / "gpu_loader.json"))
    args = parser.parse_args()

    gpu_check = load_gpu_check()
    check_args = gpu_check.parse_args([
        "--device", args.device, "--cifar", str(args.cifar), "--imagenet", str(args.imagenet),
        "--epochs", str(args.epochs), "--repeats", str(args.repeats), "--batch", str(args.batch),
        "--out", args.out])
    out = gpu_check.run(check_args)
    text = gpu_check.report(out)
    print()
    print(text)
    ratios = {kind: t["gpu_loader_vs_best_dataloader"] for kind, t in out["targets"].items()}
    print("ratios GPU loader / best DataLoader: "
          + ", ".join(f"{kind} {r:,.1f}x" for kind, r in ratios.items())
          + ("" if args.device.startswith("cuda") else "   (device=cpu: no GPU on this machine)"))
    path = write_json(args.out, {"benchmark": "gpu_loader", "machine": machine_info(), "ratios": ratios,
                                 "table": text, **out})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
