"""Training parity: the same CNN trained through four loaders on real data reaches the same accuracy.

Data: scikit-learn's ``load_digits`` (1,797 real 8x8 handwritten digits, grey levels 0-16,
shipped inside the package: no download), written as an ImageFolder of 32x32 PNGs: values
scaled to 0-255 (``round(v * 255 / 16)``), upscaled 4x with PIL ``BILINEAR``, saved as 8-bit
grayscale ("L"). A fixed stratified split: ``numpy.random.RandomState(0)`` permutes each class
and sends ``round(25 %)`` of it to ``test/`` (450 images), the rest to ``train/`` (1,347).

The pipeline, as a torchvision user writes it. No flip: a mirrored 2, 3, 4, 5, 6, 7 or 9 is not
that digit, so a flip would train on images that no test digit looks like.

    v2.Compose([v2.Grayscale(1),                  # both decoders give RGB; back to the 1 channel
                v2.CenterCrop(32),                # fixes the stored size (a no-op on 32x32 images)
                v2.PILToTensor(),
                v2.RandomCrop(32, padding=4),     # black padding
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize([mean], [std])])     # of the training pixels

Paths; the same model (a 3-block CNN with BatchNorm), SGD with Nesterov momentum and a
triangular learning rate, batch size, epochs and seeds (the seed fixes the model's init):

  (a) torchvision  ImageFolder(train, transform=pipeline) + torch DataLoader
  (b) store        convert(train, shards, static=split_transforms(pipeline)), open_dataset(..., transform=
                   hybrid) + dlstore.loader (crop fused into the gather, ToDtype+Normalize per batch)
  (c) gpu          GPUDataset(shards, device, float16, normalize=(mean, std)) + its loader with the random
                   crop; device cuda when present, else cpu. The crop is the pipeline's own v2.RandomCrop
                   when the GPU loader takes torchvision ops, else BatchRandomCrop(32, padding=4) (printed)
  (d) block        (b) in a block-shuffled order: BlockShuffleSampler(block_size=8, window=16), drawn per
                   epoch from the loader's generator. The store is in class order (ImageFolder's), so a
                   window of 128 samples (2 batches, 9.5 % of the store) holds about 7 of the 10 classes:
                   a more local order than the defaults give ImageNet (a window of 76 batches there)
Controls, not parity paths: the store through dlstore.loader with a deliberately drifted
augmentation (Batch* transforms), to show how large a drift each accuracy can see:

  (n) no crop      ToDtype + Normalize only
  (m) mean fill    the crop's padding in the mean grey (round(255 mean)) instead of black, as a loader
                   that pads after normalising, with fill 0, does
  (p) padding 2    RandomCrop(32, padding=2): offsets from a narrower range (each one is also a
                   padding-4 offset: the pixel check passes it, only the shifted set can see it)
  (k) block 64x2   (d) with blocks of 64 and windows of 2: each batch from 2 runs of one class or two,
                   an order too local, to show what the accuracies see of one

All four run by default, on the first 2 seeds (--control-seeds; --controls n for the no-crop
one only, --controls '' for none).

Every path is evaluated by the same code on two in-memory test sets of the same 450 images:
"test", the pixels written to the test PNGs through ToDtype + Normalize, and "shifted test", the
same through the pipeline's RandomCrop once first (torchvision's, under torch.manual_seed(12345):
one fixed offset and black padding per image). Digits are centred, so the plain test set hardly
needs the augmentation (the control (n) scores about as well as (a) on it); the shifted set is
the one that sees a drifted augmentation (see the controls' rows). Parity target, on both sets:
|mean(x) - mean(a)| <= max(1 point, 2 std(a)) for x = b, c, d. Epoch time is wall time
of data + training steps; "data" is the part spent waiting for the next batch. Training runs in
this process with one torch thread.

Before training, a pixel check: the first (unshuffled) batch of each path must equal, sample
by sample, torchvision's RandomCrop(32, padding=4) + ToDtype + Normalize of the pixels written
to that sample's PNG, for some crop offset (float32 within 1e-5, float16 within its rounding),
and the samples must not all share one offset. Accuracy can miss a small drift; this cannot (the
distribution of the offsets is left to the differential harness of issue 13).

    python benchmarks/train_parity.py [--seeds 5] [--epochs 8] [--batch-size 64] [--width 8] [--lr 0.1]
                                      [--controls nmpk] [--control-seeds 2] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader
from torchvision import datasets

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, write_json  # noqa: E402
from _digits import PADDING, SIZE, Setup, pixel_check, prepare  # noqa: E402

import dlstore  # noqa: E402
from dlstore.transforms import BatchCompose, BatchNormalize, BatchRandomCrop  # noqa: E402

PATHS = ("a", "b", "c", "d")
# Controls: deliberately drifted augmentations or orders, to show what drift the accuracies can see.
CONTROLS = {"n": "no crop", "m": "mean fill", "p": "padding 2", "k": "block 64x2"}
NAMES = {"a": "torchvision", "b": "store", "c": "gpu", "d": "block shuffle", **CONTROLS}
BLOCKS = {"d": (8, 16), "k": (64, 2)}   # (block_size, window) of the block-shuffled paths


# --- the paths -----------------------------------------------------------------------

def device_default() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def gpu_crop(setup: Setup) -> tuple[object, str]:
    """The random crop of the GPU path: the pipeline's own ``v2.RandomCrop`` (the GPUDataset's transform)."""
    crop = next(t for t in setup.hybrid.dynamic_ops if type(t).__name__ == "RandomCrop")
    return crop, repr(crop)


def make_loader(path: str, setup: Setup, *, seed: int, batch_size: int, shuffle: bool = True,
                device: str = "cpu", gpu: dict | None = None) -> Iterable:
    """Path ``path``'s training loader: (images, labels) batches, one epoch per ``iter``.

    ``gpu`` caches the GPUDataset and its crop between calls (the preload is done once).
    """
    generator = torch.Generator().manual_seed(seed)
    if path == "a":
        train = datasets.ImageFolder(str(setup.train_dir), transform=setup.pipeline)
        return DataLoader(train, batch_size=batch_size, shuffle=shuffle, drop_last=shuffle,
                          num_workers=0, generator=generator)
    if path in ("b", *BLOCKS):
        ds = dlstore.open_dataset(setup.store, transform=setup.hybrid)
        if path == "b" or not shuffle:
            return dlstore.loader(ds, batch_size, shuffle=shuffle, drop_last=shuffle, generator=generator)
        block_size, window = BLOCKS[path]   # a new order each epoch, drawn as (b)'s RandomSampler draws
        sampler = dlstore.BlockShuffleSampler(ds, block_size=block_size, window=window, generator=generator)
        return dlstore.loader(ds, batch_size, sampler=sampler, drop_last=True, generator=generator)
    if path in CONTROLS:
        norm = BatchNormalize([setup.mean], [setup.std])
        fill = round(setup.mean * 255)
        drifted = {"n": norm, "m": BatchCompose([BatchRandomCrop(SIZE, padding=PADDING, fill=fill), norm]),
                   "p": BatchCompose([BatchRandomCrop(SIZE, padding=PADDING // 2), norm])}[path]
        ds = dlstore.open_dataset(setup.store, batch_transform=drifted)
        return dlstore.loader(ds, batch_size, shuffle=shuffle, drop_last=shuffle, num_workers=0,
                              generator=generator)
    if path == "c":
        gpu = {} if gpu is None else gpu
        if "dataset" not in gpu:
            gpu["crop"], gpu["crop_repr"] = gpu_crop(setup)
            gpu["dataset"] = dlstore.GPUDataset(setup.store, device, torch.float16,
                                                normalize=([setup.mean], [setup.std]), transform=gpu["crop"])
        return dlstore.loader(gpu["dataset"], batch_size, shuffle, drop_last=shuffle, seed=seed)
    raise ValueError(f"unknown path {path!r}; valid: {', '.join((*PATHS, *CONTROLS))}")


def classes_per_batch(path: str, setup: Setup, *, batch_size: int) -> float:
    """Distinct classes per batch over one shuffled epoch of a store path: how mixed its order is."""
    return statistics.fmean(len(set(y.tolist())) for _, y in make_loader(path, setup, seed=0, batch_size=batch_size))


# --- pixel check ---------------------------------------------------------------------------

def check_pixels(path: str, setup: Setup, *, batch_size: int = 128, device: str = "cpu",
                 gpu: dict | None = None) -> dict:
    """``pixel_check`` on the first unshuffled batch of ``path`` (store order = ImageFolder order);
    float16 batches are held to 4e-3, two fp16 steps at the largest value (about 2.1)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # path (a) draws its crops from torch's global generator
        images, _ = next(iter(make_loader(path, setup, seed=0, batch_size=batch_size, shuffle=False,
                                          device=device, gpu=gpu)))
    tolerance = 4e-3 if images.dtype == torch.float16 else 1e-5
    return {**pixel_check(images, setup.base[:len(images)], setup, tolerance=tolerance),
            "tolerance": tolerance, "dtype": str(images.dtype).removeprefix("torch.")}


# --- training ------------------------------------------------------------------------------

def make_model(width: int = 16, classes: int = 10) -> nn.Module:
    """Three conv-BN-ReLU-maxpool blocks (width, 2 width, 4 width channels; 32 -> 4 pixels), a linear head."""
    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
                nn.MaxPool2d(2)]

    return nn.Sequential(*block(1, width), *block(width, 2 * width), *block(2 * width, 4 * width),
                         nn.Flatten(), nn.Linear(4 * width * 4 * 4, classes))


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512) -> float:
    """Top-1 accuracy in percent; the same code for every path."""
    model.eval()
    correct = 0
    for s in range(0, len(x), batch_size):
        correct += (model(x[s:s + batch_size]).argmax(1) == y[s:s + batch_size]).sum().item()
    return 100.0 * correct / len(x)


def train(loader: Iterable, setup: Setup, *, seed: int, epochs: int, width: int, lr: float,
          device: str) -> dict:
    """Train a fresh model (init seeded with ``seed``) for ``epochs`` on ``loader``; test accuracy and timings."""
    torch.manual_seed(seed)  # the model's init; path (a) also draws its crops from this stream
    model = make_model(width).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    steps = epochs * len(loader)
    warmup = max(1, steps // 5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min((k + 1) / warmup, (steps - k) / (steps - warmup)))
    loss_fn = nn.CrossEntropyLoss()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    epoch_s, data_s = [], []
    for _ in range(epochs):
        model.train()
        sync()
        start = time.perf_counter()
        waited = 0.0
        batches = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                x, y = next(batches)
            except StopIteration:
                break
            x = x.to(device, torch.float32, non_blocking=True)
            y = y.to(device, non_blocking=True)
            waited += time.perf_counter() - t0
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        sync()
        epoch_s.append(time.perf_counter() - start)
        data_s.append(waited)
    test_y = setup.test_y.to(device)
    return {"accuracy": evaluate(model, setup.test_x.to(device), test_y),
            "shifted": evaluate(model, setup.shifted_x.to(device), test_y),
            "epoch_s": epoch_s, "data_s": data_s, "final_loss": loss.item()}


def run_path(path: str, setup: Setup, *, seed: int, epochs: int, batch_size: int, width: int, lr: float,
             device: str, gpu: dict | None = None) -> dict:
    """One training run of ``path`` with ``seed``."""
    loader = make_loader(path, setup, seed=seed, batch_size=batch_size, device=device, gpu=gpu)
    return train(loader, setup, seed=seed, epochs=epochs, width=width, lr=lr, device=device)


METRICS = {"accuracy": "test", "shifted": "shifted"}


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Per path and metric: mean/std over seeds, difference to (a), parity; median epoch and data time."""
    out: dict = {}
    for path, rs in runs.items():
        out[path] = {"epoch_s": statistics.median(s for r in rs for s in r["epoch_s"]),
                     "data_s": statistics.median(s for r in rs for s in r["data_s"]), "runs": rs}
    for metric in METRICS:
        ref = [r[metric] for r in runs["a"]]
        mean_a = statistics.fmean(ref)
        target = max(1.0, 2 * (statistics.stdev(ref) if len(ref) > 1 else 0.0))
        for path, rs in runs.items():
            values = [r[metric] for r in rs]
            mean = statistics.fmean(values)
            out[path][metric] = {
                "values": values, "mean": mean, "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "diff_vs_a": mean - mean_a, "target": target,
                "parity": None if path == "a" else abs(mean - mean_a) <= target}
    for path, s in out.items():
        verdicts = [s[m]["parity"] for m in METRICS]
        s["parity"] = None if None in verdicts else all(verdicts)
        s["control"] = path in CONTROLS  # drifted on purpose: its verdict shows what the target can see
    return out


def report(summary: dict, pixels: dict) -> None:
    heads = "".join(f" {label + ' acc %':>16s} {'vs (a)':>7s}" for label in METRICS.values())
    print(f"\n  {'path':16s}{heads} {'epoch s':>8s} {'data s':>7s}  {'pixels = torchvision':21s} parity")
    for path, s in summary.items():
        p = pixels[path]
        pix = f"{p['matched']}/{p['samples']}, {p['distinct']} offsets"
        verdict = "-" if s["parity"] is None else ("PASS" if s["parity"] else "FAIL")
        if s["control"]:
            verdict = f"({verdict}: control)"
        cells = "".join(f" {s[m]['mean']:8.2f} +- {s[m]['std']:4.2f} {s[m]['diff_vs_a']:+7.2f}" for m in METRICS)
        print(f"  ({path}) {NAMES[path]:12s}{cells} {s['epoch_s']:8.3f} {s['data_s']:7.3f}  {pix:21s} {verdict}")
    targets = ", ".join(f"{label} {summary['a'][m]['target']:.2f}" for m, label in METRICS.items())
    print(f"  parity: |mean(x) - mean(a)| <= max(1 point, 2 std(a)) on both test sets ({targets} points)")
    for path, p in pixels.items():
        if p["matched"] < p["samples"] or p["distinct"] < 2:
            control = " (a control)" if path in CONTROLS else ""
            print(f"  pixel check FAILED for ({path}){control}: {p['matched']}/{p['samples']} samples equal "
                  f"torchvision's crop for some offset (tolerance {p['tolerance']}, {p['dtype']}); largest "
                  f"deviation {p['worst']:.4f}; {p['distinct']} distinct offsets")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=8, help="channels of the first conv block")
    parser.add_argument("--lr", type=float, default=0.1, help="peak learning rate")
    parser.add_argument("--device", default=device_default(), help="training device, and path (c)'s")
    parser.add_argument("--controls", default="nmpk", help="control paths to run too, any of "
                        + ", ".join(f"{k} ({v})" for k, v in CONTROLS.items()) + "; '' for none")
    parser.add_argument("--control-seeds", type=int, default=2,
                        help="seeds of the controls (the first ones); they show the scale of a drift")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "train_parity.json"))
    args = parser.parse_args()
    if set(args.controls) - set(CONTROLS):
        parser.error(f"--controls takes letters of {''.join(CONTROLS)}, got {args.controls!r}")
    # One intra-op thread: on a shared machine torch's pool otherwise waits for cores that other
    # processes hold, which swamps the per-path differences in epoch time.
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dlstore-parity-") as tmp:
        t0 = time.perf_counter()
        setup = prepare(Path(tmp))
        print(f"digits: {len(setup.base)} train / {len(setup.test_y)} test 32x32 PNGs, mean {setup.mean}, "
              f"std {setup.std}; prepared in {time.perf_counter() - t0:.1f} s (convert {setup.convert_s:.1f} s)")
        print(f"(b) {setup.hybrid!r}")
        gpu: dict = {}
        paths = (*PATHS, *(args.controls if args.control_seeds > 0 else ""))
        pixels = {path: check_pixels(path, setup, device=args.device, gpu=gpu) for path in paths}
        print(f"(c) {gpu['dataset']!r}, crop: {gpu['crop_repr']}")
        mixing = {path: classes_per_batch(path, setup, batch_size=args.batch_size) for path in ("b", *BLOCKS)
                  if path in paths}
        print("classes per batch of " + str(args.batch_size) + ": "
              + ", ".join(f"({p}) {NAMES[p]} {v:.1f}" for p, v in mixing.items()))
        runs: dict[str, list[dict]] = {path: [] for path in paths}
        for seed in range(args.seeds):  # paths interleaved per seed: load changes hit them alike
            for path in paths:
                if path in CONTROLS and seed >= args.control_seeds:
                    continue
                r = run_path(path, setup, seed=seed, epochs=args.epochs, batch_size=args.batch_size,
                             width=args.width, lr=args.lr, device=args.device, gpu=gpu)
                runs[path].append(r)
                print(f"  seed {seed} ({path}) test {r['accuracy']:6.2f} %, shifted {r['shifted']:6.2f} %, "
                      f"epoch {statistics.median(r['epoch_s']):.3f} s", flush=True)
        summary = summarise(runs)
    total = time.perf_counter() - started
    load_after = os.getloadavg()
    print(f"\n{args.seeds} seeds ({min(args.seeds, args.control_seeds)} for the controls) x {args.epochs} "
          f"epochs, batch {args.batch_size}, width {args.width}, device {args.device}, torch threads 1")
    report(summary, pixels)
    loads = [", ".join(f"{x:.2f}" for x in load) for load in (load_before, load_after)]
    print(f"\ntotal {total:.0f} s; load average (1, 5, 15 min) before {loads[0]}, after {loads[1]} "
          f"({os.cpu_count()} CPUs)")
    path = write_json(args.out, {
        "benchmark": "train_parity", "machine": machine_info(), "args": vars(args), "total_s": total,
        "load_before": load_before, "load_after": load_after,
        "data": {"source": "sklearn.datasets.load_digits", "train": len(setup.base), "test": len(setup.test_y),
                 "png": "32x32 L, round(v*255/16), PIL BILINEAR 4x", "split": "stratified, RandomState(0), 25 % test",
                 "mean": setup.mean, "std": setup.std},
        "pipeline": repr(setup.pipeline), "hybrid": repr(setup.hybrid), "gpu_crop": gpu["crop_repr"],
        "gpu_dataset": repr(gpu["dataset"]), "pixels": pixels, "paths": summary,
        "blocks": {p: dict(zip(("block_size", "window"), BLOCKS[p])) for p in BLOCKS}, "classes_per_batch": mixing,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
