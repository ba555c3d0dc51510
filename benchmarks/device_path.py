"""The device path (``dlstore.loader(..., device=)``, issue 14) against normalising in the workers, in one run.

Builds two shards stores with ``dlstore.convert`` from
``dlstore.sources.demo.make_image_folder`` (3x224x224 and 3x32x32) and runs the
same pipeline on both, ``RandomCrop(S, padding=4) + RandomHorizontalFlip() +
ToDtype(float32, scale=True) + Normalize(ImageNet)``, two ways:

* cpu-norm: today's loader; the threads / worker processes run the whole pipeline
  and hand float32 batches over;
* device: ``loader(..., device=D)``; threads / workers run the uint8 host stage,
  the main process moves uint8 to D and normalises there.

Measured, configurations interleaved round-robin over ``--rounds`` rounds (each
configuration runs whole epochs for at least ``--seconds`` per round), medians
and ratios printed:

(a) bytes per sample crossing the worker boundary (what the threads / the 2
    DataLoader worker processes hand to the main process): counted on the batches;
(b) samples/s of ``device="cpu"`` over cpu-norm, through 2 threads and through
    2 worker processes. On a machine without a GPU the device stage runs on the
    main process's CPU, serially: this measures what moving uint8 saves in IPC
    and what serialising the normalisation costs, not the GPU's gain. On a GPU
    machine, :func:`compare` measures that (``scripts/gpu_check.py`` calls it).

``uptime`` is printed before and after: on a shared machine the ratios hold only
for the load they were measured under.

    python benchmarks/device_path.py [--rounds 3] [--seconds 1.0] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torchvision.transforms import v2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, write_json

import dlstore
from dlstore.sources.demo import make_image_folder

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def pipeline(size: int) -> v2.Compose:
    return v2.Compose([v2.RandomCrop(size, padding=4), v2.RandomHorizontalFlip(),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


def build_store(root: Path, size: int, images: int) -> Path:
    """A shards store of ``images`` synthetic samples of 3 x size x size."""
    dst = root / f"s{size}.shards"
    if not dst.exists():
        folder = make_image_folder(root / f"images-{size}", classes=4, per_class=images // 4,
                                   size=(size + 8, size + 8), ext=".png")
        dlstore.convert(folder, dst, static=f"center_crop={size}", workers=0, progress=False)
    return dst


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _epochs(make: Any, seconds: float, device: torch.device) -> tuple[float, int]:
    """Whole epochs of the loader ``make()`` for at least ``seconds``: (samples/s, bytes per sample handed over)."""
    loader = make()
    n = nbytes = 0
    start = time.perf_counter()
    while True:
        for x, _ in loader:
            n += len(x)
            nbytes += x.nbytes
        _sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return n / elapsed, nbytes // n


def compare(path: str | os.PathLike, device: str | torch.device, *, batch: int = 256, seconds: float = 2.0,
            rounds: int = 3, threads: int | None = None, num_workers: int = 0) -> dict[str, Any]:
    """samples/s of ``loader(device=device)`` vs the same pipeline normalising on the CPU and moving float32.

    Pipeline: ``RandomCrop(S, padding=4)``, flip, ``ToDtype(float32)``, ``Normalize`` (S the store's
    size). Baseline: ``dlstore.loader`` running all of it in its threads/workers, then
    ``.to(device, non_blocking=True)`` of the float32 batch (pinned on the loader threads
    / by the DataLoader when ``device`` is CUDA), as a training loop does today. The two
    alternate, ``rounds`` times, each for ``seconds``; medians and their ratio.
    """
    device = torch.device(device)
    ds = dlstore.open_dataset(path, transform=pipeline(dlstore.open_dataset(path).shape[-1]))
    pin = device.type == "cuda"
    options: dict[str, Any] = {"num_workers": num_workers, "shuffle": True}
    if threads is not None:
        options["threads"] = threads
    if num_workers:
        options["persistent_workers"] = True

    class Moved:
        """The baseline: float32 batches from the loader, copied to ``device`` as users do."""

        def __init__(self) -> None:
            self.inner = dlstore.loader(ds, batch, pin_memory=pin, **options)

        def __iter__(self):
            for x, y in self.inner:
                yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    configs = {"cpu_float32": lambda: Moved(),
               "device": lambda: dlstore.loader(ds, batch, device=device, **options)}
    made = {name: make() for name, make in configs.items()}
    rates: dict[str, list[float]] = {name: [] for name in configs}
    moved: dict[str, int] = {}
    for name, loader in made.items():          # warm-up: worker start-up, first page faults
        _epochs(lambda loader=loader: loader, 0.0, device)
    for _ in range(rounds):
        for name, loader in made.items():
            rate, per_sample = _epochs(lambda loader=loader: loader, seconds, device)
            rates[name].append(rate)
            moved[name] = per_sample
    med = {name: statistics.median(r) for name, r in rates.items()}
    return {"device": str(device), "batch": batch, "shape": list(ds.shape), "threads": threads,
            "num_workers": num_workers, "samples_per_s": med, "runs": rates,
            "ratio_device_over_cpu_float32": med["device"] / med["cpu_float32"],
            "bytes_per_sample_delivered": moved}


def _boundary_bytes(ds: Any, batch: int, **options: Any) -> dict[str, int]:
    """Bytes per sample the threads / workers hand to the main process, float32 vs the device path's uint8."""
    full = dlstore.loader(ds, batch, **options)
    host = dlstore.loader(ds.host_stage()[0], batch, **options)      # what device= hands over
    out = {}
    for name, loader in (("cpu_norm_float32", full), ("device_uint8", host)):
        n = nbytes = 0
        for x, _ in loader:
            n, nbytes = n + len(x), nbytes + x.nbytes
        out[name] = nbytes // n
    return out


def _uptime() -> str:
    return subprocess.run(["uptime"], check=False, capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "device_path.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)       # the loader's threads/workers are the parallelism measured
    up_before = _uptime()
    print(f"load before: {up_before}")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="dlstore-device-"))
    stores = {224: (build_store(root, 224, 256), 64), 32: (build_store(root, 32, 2048), 256)}
    ways = {"threads2": {"backend": "threads", "num_threads": 2}, "workers2": {"num_workers": 2, "backend": "dataloader"}}
    boundary: dict[str, Any] = {}
    for size, (path, batch) in stores.items():
        ds = dlstore.open_dataset(path, transform=pipeline(size))
        for way, options in ways.items():
            boundary[f"{size}/{way}"] = _boundary_bytes(ds, batch, **options)
    # (b): all eight configurations alternate within each round
    loaders: dict[str, Any] = {}
    for size, (path, batch) in stores.items():
        ds = dlstore.open_dataset(path, transform=pipeline(size))
        for way, options in ways.items():
            extra = {"persistent_workers": True} if "num_workers" in options else {}
            loaders[f"{size}/{way}/cpu_norm"] = dlstore.loader(ds, batch, shuffle=True, **options, **extra)
            loaders[f"{size}/{way}/device_cpu"] = dlstore.loader(ds, batch, shuffle=True, device="cpu",
                                                                 **options, **extra)
    cpu = torch.device("cpu")
    for loader in loaders.values():
        _epochs(lambda loader=loader: loader, 0.0, cpu)
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    for _ in range(args.rounds):
        for name, loader in loaders.items():
            rates[name].append(_epochs(lambda loader=loader: loader, args.seconds, cpu)[0])
    med = {name: statistics.median(r) for name, r in rates.items()}
    up_after = _uptime()
    print("\n(a) bytes per sample crossing the worker boundary (threads / 2 worker processes):")
    for key, b in boundary.items():
        print(f"  {key:>14}: float32 {b['cpu_norm_float32']:>7}  uint8 {b['device_uint8']:>7}  "
              f"ratio {b['cpu_norm_float32'] / b['device_uint8']:.2f}x")
    print(f"\n(b) samples/s, median of {args.rounds} rounds (device=\"cpu\": the device stage on this CPU):")
    ratios = {}

    def spread(k: str) -> str:
        return f"{min(rates[k]):.0f}-{max(rates[k]):.0f}"

    for size in stores:
        for way in ways:
            a, b = med[f"{size}/{way}/cpu_norm"], med[f"{size}/{way}/device_cpu"]
            ratios[f"{size}/{way}"] = b / a
            print(f"  3x{size}x{size} {way}: cpu-norm {a:>8.0f} ({spread(f'{size}/{way}/cpu_norm')})  "
                  f"device=cpu {b:>8.0f} ({spread(f'{size}/{way}/device_cpu')})  ratio {b / a:.2f}")
    print(f"\nload after: {up_after}")
    out = write_json(args.out, {
        "machine": machine_info(), "torch": torch.__version__, "uptime_before": up_before, "uptime_after": up_after,
        "rounds": args.rounds, "seconds": args.seconds, "pipeline": repr(pipeline(224)),
        "bytes_per_sample": boundary, "samples_per_s": med, "runs": rates,
        "ratio_device_cpu_over_cpu_norm": ratios})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
