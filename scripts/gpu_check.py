#!/usr/bin/env python
"""GPU check for dlstore.GPUDataset: preload speed and memory, correctness, loader speed.

Run on a machine with a GPU (needs only dlstore installed; the first version took
73 s on an H200 with 16 cores, the steps added since (5-7, 9) about a minute more)::

    python scripts/gpu_check.py --out gpu_check.json
    python scripts/gpu_check.py --device cpu --quick      # the same steps, small, on CPU

What it does, all in one process so that every ratio compares figures measured
in the same run:

1. builds two real stores with ``dlstore.convert``: a CIFAR-sized one (32x32
   PNGs, 50,000 samples, 10 classes) and an ImageNet-subset-sized one (JPEGs
   converted with ``resize=256,center_crop=224``, 10,000 samples, 100
   classes). To stay fast it generates a few thousand distinct images and
   hard-links each under several names, so ``convert`` still decodes every file;
2. measures host-to-device bandwidth (pinned memory, ``copy_``) on the device;
3. preloads each store with ``GPUDataset(normalize=...)`` in fp16: seconds,
   GB/s of uint8 read (vs the H2D bandwidth), device memory used vs predicted;
4. checks the device data against the CPU path (torchvision ``ToDtype(scale=True)``
   + ``Normalize`` on the stored uint8, cast to fp16) and the labels;
5. times epochs of the GPU loader with random crop + flip (batch transforms from
   ``dlstore.transforms``) against a DataLoader over the same store with the
   same augmentations per sample, at its best worker count out of a sweep;
6. compares residencies and gathers on the CIFAR store (fp16 vs uint8 held,
   fused vs unfused, padded copy, compiled on CUDA; ``benchmarks/gpu_residency.py``)
   and preload ring sizes on the ImageNet store;
7. times ``dlstore.loader(..., device=)`` (uint8 moved, normalised on the device)
   against the same pipeline normalising on the CPU and moving float32
   (``benchmarks/device_path.py``), with threads and with worker processes;
8. prints a table and writes everything to JSON (``--out``);
9. on CUDA, runs the suite's CUDA tests (``pytest -k cuda``: kernels, preload,
   every GPU path of the fidelity harness against torchvision) and reports them.

Targets (on a GPU): preload >= 50 % of the H2D bandwidth; GPU loader >= 50
CIFAR-10-sized epochs/s and >= 10x the best DataLoader; ``loader(device=)`` >= 1.5x
the same pipeline normalising on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader
from torchvision.transforms import v2

import dlstore
from dlstore._system import usable_cpus
from dlstore.sources.demo import make_image_folder

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
GB = 1e9


# --- environment ---------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": str(device), "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "dlstore": dlstore.__version__, "usable_cpus": usable_cpus(),
        "logical_cpus": os.cpu_count(),
    }
    try:
        import torchvision
        info["torchvision"] = torchvision.__version__
    except ImportError:  # pragma: no cover - torchvision is a dependency
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    return info


# --- data ----------------------------------------------------------------------------------

def build_folder(root: Path, *, count: int, unique: int, classes: int, size: tuple[int, int],
                 ext: str) -> Path:
    """An ImageFolder tree of ``count`` files, ``unique`` of them distinct, the rest hard links."""
    per_class = max(1, unique // classes)
    originals = make_image_folder(root / "unique", classes=classes, per_class=per_class, size=size, ext=ext)
    out = root / "images"
    want = max(1, count // classes)
    for c in range(classes):
        src_dir = originals / f"class_{c:02d}"
        dst_dir = out / f"class_{c:02d}"
        dst_dir.mkdir(parents=True)
        files = sorted(src_dir.iterdir())
        for k in range(want):
            src = files[k % len(files)]
            dst = dst_dir / f"img_{k:06d}{ext}"
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
    return out


def build_store(root: Path, name: str, *, count: int, unique: int, classes: int, size: tuple[int, int],
                ext: str, static: str, workers: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    folder = build_folder(root / name, count=count, unique=unique, classes=classes, size=size, ext=ext)
    made = time.perf_counter() - t0
    result = dlstore.convert(folder, root / f"{name}.shards", static=static, workers=workers, progress=False)
    return {"path": str(result.path), "count": result.count, "classes": len(result.classes),
            "shape": list(result.shape), "static": static, "bytes": result.nbytes,
            "generate_seconds": made, "convert_seconds": result.seconds, "convert_workers": result.workers}


# --- measurements --------------------------------------------------------------------------

def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def h2d_bandwidth(device: torch.device, nbytes: int, repeats: int) -> dict[str, Any]:
    """Pinned host -> device copy bandwidth (GB/s); on CPU, a plain memory copy of the same size."""
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=pin)
    sync(device)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=pin)
        sync(device)
        rates.append(nbytes / (time.perf_counter() - t0) / GB)
    del host, dev
    return {"what": "pinned host -> device copy_" if pin else "host memory copy_ (no device)",
            "bytes": nbytes, "gb_per_s": spread(rates)}


def reference_batch(store: dlstore.StoreDataset, indices: np.ndarray, mean, std) -> torch.Tensor:
    """The CPU path: stored uint8 -> ToDtype(float32, scale=True) -> Normalize -> fp16."""
    images, _ = store.read_batch(indices.tolist())
    ref = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])
    return ref(images).to(torch.float16)


def check_preload(path: str, device: torch.device, mean, std, *, repeats: int,
                  check_samples: int) -> tuple[dlstore.GPUDataset, dict[str, Any]]:
    """Preload ``repeats`` times (keeping the last), then compare with the CPU path."""
    seconds, used, peaks = [], [], []
    ds = None
    for _ in range(repeats):
        ds = None  # free the previous copy before measuring the next
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t0 = time.perf_counter()
        ds = dlstore.GPUDataset(path, device, normalize=(mean, std))
        sync(device)
        seconds.append(time.perf_counter() - t0)
        if device.type == "cuda":
            used.append(torch.cuda.memory_allocated(device) - before)
            peaks.append(torch.cuda.max_memory_allocated(device) - before)
    assert ds is not None
    n = len(ds)
    uint8_bytes = n * int(np.prod(ds.shape))
    store = dlstore.open_dataset(path)
    rng = np.random.default_rng(0)
    idx = np.arange(n) if n <= check_samples else np.sort(rng.choice(n, check_samples, replace=False))
    ref = reference_batch(store, idx, mean, std)
    got = ds.data[torch.from_numpy(idx).to(device)].cpu()
    diff = (got.float() - ref.float()).abs()
    labels_ok = torch.equal(ds.labels.cpu(), torch.as_tensor(store.targets))
    sync(device)
    t0 = time.perf_counter()
    u8 = dlstore.GPUDataset(path, device, torch.uint8)
    sync(device)
    u8_seconds = time.perf_counter() - t0
    u8_ok = torch.equal(u8.data[torch.from_numpy(idx).to(device)].cpu(), store.read_batch(idx.tolist())[0])
    del u8
    stats = {
        "samples": n, "shape": list(ds.shape), "mode": ds.mode, "dtype": "float16",
        "chunk_size": ds.chunk_size, "uint8_bytes_read": uint8_bytes,
        "seconds": spread(seconds),
        "gb_per_s_read": spread([uint8_bytes / s / GB for s in seconds]),
        "predicted_bytes": ds.needed_bytes, "nbytes": ds.nbytes,
        "device_bytes_used": spread(used) if used else None,
        "device_bytes_peak": spread(peaks) if peaks else None,
        "checked_samples": len(idx),
        "max_abs_diff_vs_cpu_path": float(diff.max()) if diff.numel() else 0.0,
        "exact_fraction_vs_cpu_path": float((diff == 0).float().mean()) if diff.numel() else 1.0,
        "labels_equal": labels_ok, "uint8_equal_to_store": u8_ok,
        "uint8_preload_seconds": u8_seconds, "uint8_preload_gb_per_s": uint8_bytes / u8_seconds / GB,
    }
    return ds, stats


def time_gpu_loader(ds: dlstore.GPUDataset, batch: int, transform, epochs: int) -> dict[str, Any]:
    ds.transform = transform
    loader = dlstore.loader(ds, batch, shuffle=True, drop_last=False, seed=0)
    device = ds.device
    count = 0
    for images, labels in loader:  # warm-up epoch (kernels, allocator)
        count += len(labels)
    sync(device)
    times = _benchmark("_common").time_epochs(loader, device, epochs)  # as benchmarks/gpu_residency.py times
    n = len(ds)
    return {"batch_size": batch, "epochs_timed": epochs, "samples_per_epoch": n,
            "epochs_per_s": spread([1 / t for t in times]),
            "samples_per_s": spread([n / t for t in times]),
            "batch_shape": list(images.shape), "batch_dtype": str(images.dtype)}


def time_dataloader(path: str, device: torch.device, batch: int, sample_transform, mean, std, *,
                    workers: list[int], epochs: int, max_batches: int) -> dict[str, Any]:
    """A DataLoader over the same store, same augmentations per sample, output like the GPU loader's."""
    ds = dlstore.open_dataset(path, transform=sample_transform)
    pin = device.type == "cuda"
    mean_t = torch.tensor(mean, device=device).view(1, -1, 1, 1)
    std_t = torch.tensor(std, device=device).view(1, -1, 1, 1)
    results = []
    for w in workers:
        kwargs: dict[str, Any] = {"num_workers": w, "pin_memory": pin}
        if w > 0:
            kwargs.update(persistent_workers=True, prefetch_factor=4)
        loader = DataLoader(ds, batch_size=batch, shuffle=True, drop_last=False, **kwargs)
        rates = []
        for e in range(epochs + 1):  # the first epoch starts the workers: not timed
            t0 = time.perf_counter()
            seen = 0
            for b, (images, labels) in enumerate(loader):
                images = images.to(device, non_blocking=pin)
                labels = labels.to(device, non_blocking=pin)
                images = images.to(torch.float32).mul_(1 / 255).sub_(mean_t).div_(std_t).half()
                seen += len(labels)
                if b + 1 >= max_batches:
                    break
            sync(device)
            if e > 0:
                rates.append(seen / (time.perf_counter() - t0))
        del loader
        results.append({"num_workers": w, "pin_memory": pin, "samples_per_s": spread(rates)})
    best = max(results, key=lambda r: r["samples_per_s"]["median"])
    return {"configs": results, "best": best, "epochs_timed": epochs, "max_batches": max_batches}


def run_device_tests(device: torch.device, timeout: int = 240) -> dict[str, Any]:
    """The suite's device tests (CUDA variants of the GPU and fidelity tests) in a pytest subprocess.

    On CUDA these are the tests that skip everywhere else: GPU kernels against the CPU
    kernels, preload and streaming on the device, and every GPU path of the fidelity
    harness against torchvision on the same input.
    """
    import re
    import subprocess

    root = Path(__file__).resolve().parents[1]
    files = [str(p.relative_to(root)) for p in sorted((root / "tests").rglob("test_*.py"))
             if "cuda" in p.read_text(encoding="utf-8")]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda", *files]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, cwd=root, capture_output=True, text=True, timeout=timeout)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text, rc = f"{exc.stdout or ''}\ntimed out after {timeout} s", None
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", text)}
    failures = re.findall(r"^FAILED (\S+)", text, flags=re.MULTILINE)
    return {"device": str(device), "command": " ".join(cmd), "returncode": rc, "counts": counts,
            "failed": failures, "seconds": time.perf_counter() - t0, "tail": text[-3000:]}


def _benchmark(name: str):
    """A module of ``benchmarks/`` (not a package: loaded from its file)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"dlstore_benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the run -------------------------------------------------------------------------------

SIZES = {
    # name: (count, unique, classes, source size, ext, static, mean, std, batch)
    "full": {"cifar": (50_000, 5_000, 10, (32, 32), ".png", "center_crop=32"),
             "imagenet": (10_000, 500, 100, (300, 400), ".jpg", "resize=256,center_crop=224")},
    "quick": {"cifar": (2_000, 200, 10, (32, 32), ".png", "center_crop=32"),
              "imagenet": (200, 40, 10, (72, 96), ".jpg", "resize=64,center_crop=64")},
}


def batch_transforms(kind: str, size: int):
    from dlstore import transforms as T
    if kind == "cifar":
        return T.BatchCompose([T.BatchRandomCrop(size, padding=4), T.BatchRandomHorizontalFlip()])
    return T.BatchCompose([T.BatchRandomResizedCrop(size), T.BatchRandomHorizontalFlip()])


def sample_transforms(kind: str, size: int):
    if kind == "cifar":
        return v2.Compose([v2.RandomCrop(size, padding=4), v2.RandomHorizontalFlip()])
    return v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])


def jpeg_decode(path: str, device: torch.device, count: int, repeats: int) -> dict[str, Any]:
    """``count`` samples of a store encoded as the JPEG stores encode them (PIL, quality 90), decoded
    by PIL (the reference), by ``torchvision.io.decode_jpeg`` on the CPU (what JPEG stores use), and
    in one call on ``device`` (nvjpeg on CUDA): pixel differences against PIL and images/s of each.
    The decoder alone; ``jpeg_store_device`` times the whole device JPEG path."""
    from dlstore.formats.encoding import decode, decode_batch, encode

    ds = dlstore.open_dataset(path)
    records = [encode(ds.read(i).numpy(), "jpeg", quality=90) for i in range(min(count, len(ds)))]
    reference = [torch.from_numpy(decode(r)) for r in records]
    out: dict[str, Any] = {"images": len(records), "shape": list(reference[0].shape), "quality": 90}
    ways = {"pil": lambda: [torch.from_numpy(decode(r)) for r in records],
            "decode_jpeg cpu": lambda: decode_batch(records, "jpeg")}
    if device.type != "cpu":
        ways[f"decode_jpeg {device.type}"] = lambda: decode_batch(records, "jpeg", device=device)
    for name, fn in ways.items():
        fn()                                          # warm-up (nvjpeg's first call initialises it)
        seconds = []
        for _ in range(repeats):
            sync(device)
            t = time.perf_counter()
            got = fn()
            sync(device)
            seconds.append(time.perf_counter() - t)
        diff = torch.cat([(g.cpu().int() - r.int()).abs().reshape(-1) for g, r in zip(got, reference)])
        out[name] = {"images_per_s": spread([len(records) / x for x in seconds]),
                     "identical_to_pil": bool(diff.max() == 0), "max_abs_diff": int(diff.max()),
                     "mean_abs_diff": float(diff.float().mean()), "fraction_pixels_differing": float((diff > 0).float().mean())}
    return out


def jpeg_store_device(folder: Path, store: Path, device: torch.device, *, batch: int, seconds: float,
                      rounds: int) -> dict[str, Any]:
    """A JPEG store (q90) of ``folder`` read with RandomResizedCrop(224) + flip + normalise through
    ``loader(device=...)``: decoded on the device (records handed over, ``dlstore/data/device_decode.py``)
    against decoded on the host's loader threads, rounds interleaved; and the device's uint8 crops
    against the host's for the same draws (on CUDA: nvjpeg's and the CUDA resize's rounding)."""
    from torchvision.transforms import v2

    from dlstore.data.device_decode import DeviceDecode

    dlstore.convert(folder, store, encoding="jpeg", quality=90, workers=usable_cpus(), progress=False)
    crop = [v2.RandomResizedCrop(224), v2.RandomHorizontalFlip()]
    ds = dlstore.open_dataset(store, transform=v2.Compose(
        [*crop, v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]))
    ways = {"host decode": ds.host_stage(), "device decode": ds.host_stage(records_to=device)}

    def rate(way: str, r: int) -> float:
        # the host stage on the loader's threads, the device stage here (loader(device=) overlaps
        # them on a side stream; both ways alike, so the ratio stands)
        host_ds, steps = ways[way]
        n, t = 0, time.perf_counter()
        for images, _ in dlstore.loader(host_ds, batch, shuffle=True, seed=r):
            x = steps[0](images, device) if steps and isinstance(steps[0], DeviceDecode) else images.to(device)
            for step in steps[1:] if steps and isinstance(steps[0], DeviceDecode) else steps:
                x = step(x, None)
            n += len(x)
            if time.perf_counter() - t > seconds:
                break
        sync(device)
        return n / (time.perf_counter() - t)

    rates: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(rounds):
        for way in ways if r % 2 == 0 else reversed(list(ways)):
            rates[way].append(rate(way, r))
    out: dict[str, Any] = {"images": len(ds), "decodes_on_device": type(ways["device decode"][1][0]).__name__,
                           **{w: {"samples_per_s": spread(v)} for w, v in rates.items()}}
    plain = dlstore.open_dataset(store, transform=v2.Compose(crop))
    records_ds, steps = plain.host_stage(records_to=device)
    idx = list(range(min(len(plain), 256)))
    want = plain.get_batch(idx, generator=torch.Generator().manual_seed(0))[0]
    got = steps[0](records_ds.get_batch(idx, generator=torch.Generator().manual_seed(0))[0], device).cpu()
    diff = (got.int() - want.int()).abs()
    out["uint8_vs_host"] = {"max_abs_diff": int(diff.max()), "mean_abs_diff": float(diff.float().mean()),
                            "psnr_db": float(10 * torch.log10(255.0**2 / diff.float().pow(2).mean().clamp_min(1e-10)))}
    return out


def run(args: argparse.Namespace, log=print) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    sizes = dict(SIZES["quick" if args.quick else "full"])
    if args.cifar:
        sizes["cifar"] = (args.cifar, min(args.cifar, sizes["cifar"][1]), *sizes["cifar"][2:])
    if args.imagenet:
        sizes["imagenet"] = (args.imagenet, min(args.imagenet, sizes["imagenet"][1]), *sizes["imagenet"][2:])
    cpus = usable_cpus()
    workers = sorted({w for w in (0, 2, 4, 8, 12, 16, 32) if w <= cpus} | {cpus})
    if args.quick:
        workers = sorted({0, min(2, cpus)})
    out: dict[str, Any] = {"script": "scripts/gpu_check.py", "quick": args.quick,
                           "machine": machine(device), "stores": {}, "preload": {}, "gpu_loader": {},
                           "dataloader": {}, "targets": {}}
    log(f"device {device} ({out['machine'].get('gpu', 'no GPU')}), {cpus} usable CPUs, "
        f"torch {torch.__version__}")
    tmp = Path(tempfile.mkdtemp(prefix="dlstore-gpu-check-", dir=args.workdir))
    try:
        for kind, (count, unique, classes, size, ext, static) in sizes.items():
            log(f"building {kind} store: {count:,} x {static} ({unique:,} distinct source images) ...")
            out["stores"][kind] = build_store(tmp, kind, count=count, unique=unique, classes=classes,
                                              size=size, ext=ext, static=static, workers=cpus)
            s = out["stores"][kind]
            log(f"  {s['count']:,} samples {'x'.join(map(str, s['shape']))}, {s['bytes'] / GB:.2f} GB, "
                f"converted in {s['convert_seconds']:.1f} s")
        bw_bytes = (64 << 20) if args.quick else (1 << 30)
        out["h2d"] = h2d_bandwidth(device, bw_bytes, repeats=5)
        log(f"H2D bandwidth: {out['h2d']['gb_per_s']['median']:.1f} GB/s ({out['h2d']['what']})")
        for kind in sizes:
            path = out["stores"][kind]["path"]
            mean, std = (CIFAR_MEAN, CIFAR_STD) if kind == "cifar" else (IMAGENET_MEAN, IMAGENET_STD)
            log(f"preloading {kind} ...")
            sample_bytes = int(np.prod(out["stores"][kind]["shape"]))
            ds, pre = check_preload(path, device, mean, std, repeats=args.repeats,
                                    check_samples=max(256, (256 << 20) // sample_bytes))
            out["preload"][kind] = pre
            side = ds.shape[-1]
            log(f"timing GPU loader on {kind} ...")
            out["gpu_loader"][kind] = time_gpu_loader(ds, args.batch, batch_transforms(kind, side),
                                                      args.epochs if kind == "cifar" else max(1, args.epochs // 5))
            out["gpu_loader"][kind + "_no_transform"] = time_gpu_loader(ds, args.batch, None, max(1, args.epochs // 2))
            del ds
            if device.type == "cuda":
                torch.cuda.empty_cache()
            log(f"timing DataLoader on {kind} (workers {workers}) ...")
            max_batches = 10**9 if kind == "cifar" else max(4, 4096 // args.batch)
            out["dataloader"][kind] = time_dataloader(
                path, device, args.batch, sample_transforms(kind, side), mean, std, workers=workers,
                epochs=1 if args.quick else 2, max_batches=max_batches)
        cifar_path = out["stores"]["cifar"]["path"]
        log("residency and gather variants on cifar (fp16/uint8 held, fused/unfused, padded copy) ...")
        out["residency"] = _benchmark("gpu_residency").residency_comparison(
            cifar_path, device, epochs=1 if args.quick else 5, batch=args.batch, repeats=1 if args.quick else 3,
            compile=device.type == "cuda" and not args.quick, normalize=(CIFAR_MEAN, CIFAR_STD), log=log)
        log("preload ring sizes on imagenet ...")
        out["preload_ring"] = _benchmark("gpu_residency").preload_bandwidth(
            out["stores"]["imagenet"]["path"], device, repeats=1 if args.quick else 3,
            normalize=(IMAGENET_MEAN, IMAGENET_STD))
        log("loader(device=...) vs the same pipeline normalising on the CPU ...")
        device_path = _benchmark("device_path")
        out["device_loader"] = {}
        for kind in sizes:
            for workers in (0,) if args.quick else (0, min(8, cpus)):
                key = f"{kind}, " + (f"{workers} workers" if workers else "threads")
                out["device_loader"][key] = device_path.compare(
                    out["stores"][kind]["path"], device, batch=args.batch if kind == "cifar" else 128,
                    seconds=0.3 if args.quick else 2.0, rounds=1 if args.quick else 3, num_workers=workers)
                log(f"  {key}: {out['device_loader'][key]['ratio_device_over_cpu_float32']:.2f}x")
        log("JPEG decode: PIL vs decode_jpeg on the CPU and on the device ...")
        out["jpeg_decode"] = jpeg_decode(out["stores"]["imagenet"]["path"], device, count=64 if args.quick else 512,
                                         repeats=1 if args.quick else 3)
        log("JPEG store through loader(device=...): decoded on the device vs on the host threads ...")
        out["jpeg_store_device"] = jpeg_store_device(
            tmp / "imagenet" / "images", tmp / "imagenet_jpeg.shards", device, batch=64 if args.quick else 128,
            seconds=0.3 if args.quick else 3.0, rounds=2 if args.quick else 4)
        j = out["jpeg_store_device"]
        log(f"  host {j['host decode']['samples_per_s']['median']:,.0f}, device "
            f"{j['device decode']['samples_per_s']['median']:,.0f} samples/s; uint8 vs host: max |d| "
            f"{j['uint8_vs_host']['max_abs_diff']}, PSNR {j['uint8_vs_host']['psnr_db']:.1f} dB")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    h2d = out["h2d"]["gb_per_s"]["median"]
    for kind in sizes:
        pre = out["preload"][kind]
        gpu = out["gpu_loader"][kind]["samples_per_s"]["median"]
        dl = out["dataloader"][kind]["best"]["samples_per_s"]["median"]
        out["targets"][kind] = {
            "preload_fraction_of_h2d": pre["gb_per_s_read"]["median"] / h2d,
            "gpu_loader_vs_best_dataloader": gpu / dl,
            "gpu_loader_epochs_per_s": out["gpu_loader"][kind]["epochs_per_s"]["median"],
        }
    if args.tests:
        log("running the suite's device tests (pytest -k cuda) ...")
        out["device_tests"] = run_device_tests(device)
        c = out["device_tests"]["counts"]
        log(f"  {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped")
    out["seconds"] = time.perf_counter() - start
    return out


def report(out: dict[str, Any]) -> str:
    """The results as a plain-text table."""
    cpu_note = "" if out["machine"]["device"].startswith("cuda") else \
        "  [CPU run: no GPU; the GPU targets do not apply]"
    lines = [f"dlstore GPU check on {out['machine'].get('gpu', out['machine'].get('cpu', '?'))} "
             f"({out['machine']['device']}), torch {out['machine']['torch']}{cpu_note}",
             f"H2D reference: {out['h2d']['gb_per_s']['median']:.2f} GB/s ({out['h2d']['what']}, "
             f"{out['h2d']['bytes'] / 2**20:.0f} MiB)", ""]
    head = f"{'':34s}" + "".join(f"{k:>22s}" for k in out["preload"])
    lines.append(head)

    def row(label: str, values: list[str]) -> None:
        lines.append(f"{label:34s}" + "".join(f"{v:>22s}" for v in values))

    kinds = list(out["preload"])
    row("samples x shape", [f"{out['preload'][k]['samples']:,} x {'x'.join(map(str, out['preload'][k]['shape']))}"
                            for k in kinds])
    row("preload seconds (median)", [f"{out['preload'][k]['seconds']['median']:.3f}" for k in kinds])
    row("preload GB/s of uint8 read", [f"{out['preload'][k]['gb_per_s_read']['median']:.2f}" for k in kinds])
    row("  fraction of H2D bandwidth", [f"{out['targets'][k]['preload_fraction_of_h2d']:.0%}" for k in kinds])
    row("uint8 preload GB/s (no convert)", [f"{out['preload'][k]['uint8_preload_gb_per_s']:.2f}" for k in kinds])
    row("device bytes predicted", [f"{out['preload'][k]['predicted_bytes'] / 2**20:,.1f} MiB" for k in kinds])
    if out["preload"][kinds[0]]["device_bytes_used"] is not None:
        row("device bytes used / peak", [
            f"{out['preload'][k]['device_bytes_used']['median'] / 2**20:,.1f}/"
            f"{out['preload'][k]['device_bytes_peak']['median'] / 2**20:,.1f} MiB" for k in kinds])
    row("max |diff| vs CPU path (fp16)", [f"{out['preload'][k]['max_abs_diff_vs_cpu_path']:.2g}" for k in kinds])
    row("labels / uint8 equal", [f"{out['preload'][k]['labels_equal']} / {out['preload'][k]['uint8_equal_to_store']}"
                                 for k in kinds])
    row("GPU loader epochs/s (crop+flip)", [f"{out['gpu_loader'][k]['epochs_per_s']['median']:,.2f}" for k in kinds])
    row("GPU loader samples/s (crop+flip)", [f"{out['gpu_loader'][k]['samples_per_s']['median']:,.0f}" for k in kinds])
    row("GPU loader samples/s (no aug.)",
        [f"{out['gpu_loader'][k + '_no_transform']['samples_per_s']['median']:,.0f}" for k in kinds])
    workers = [c["num_workers"] for c in out["dataloader"][kinds[0]]["configs"]]
    for i, w in enumerate(workers):
        row(f"DataLoader samples/s, {w} workers",
            [f"{out['dataloader'][k]['configs'][i]['samples_per_s']['median']:,.0f}" for k in kinds])
    row("best DataLoader (workers)", [f"{out['dataloader'][k]['best']['samples_per_s']['median']:,.0f} "
                                      f"({out['dataloader'][k]['best']['num_workers']})" for k in kinds])
    row("GPU loader / best DataLoader", [f"{out['targets'][k]['gpu_loader_vs_best_dataloader']:,.1f}x"
                                         for k in kinds])
    lines.append("")
    if out["machine"]["device"].startswith("cuda"):
        t = out["targets"]
        verdict = lambda ok: "met" if ok else "NOT met"
        lines.append(f"target preload >= 50% of H2D: {verdict(all(v['preload_fraction_of_h2d'] >= 0.5 for v in t.values()))}")
        lines.append(f"target >= 50 CIFAR epochs/s: {verdict(t['cifar']['gpu_loader_epochs_per_s'] >= 50)} "
                     f"({t['cifar']['gpu_loader_epochs_per_s']:.1f})")
        lines.append(f"target >= 10x best DataLoader (CIFAR): {verdict(t['cifar']['gpu_loader_vs_best_dataloader'] >= 10)}")
    if "residency" in out:
        lines.append("")
        lines.append(f"CIFAR store, crop(pad 4)+flip+normalise, batch {out['residency']['batch']}: "
                     "epoch speed / end-to-end / memory vs fp16 held, unfused (same batches?)")
        for name, r in out["residency"]["variants"].items():
            lines.append(f"  {name:32s} {r['epoch_speed_vs_baseline']:6.2f}x {r['end_to_end_vs_baseline']:6.2f}x "
                         f"{r['memory_vs_baseline']:6.2f}  {r['same_batches']}")
    if "preload_ring" in out:
        pr = out["preload_ring"]
        lines.append(f"preload GB/s by ring (plain copy {pr['copy_GBps']:.1f} GB/s): " + ", ".join(
            f"{k}: uint8 {v['uint8']['GBps']:.1f} ({v['uint8']['fraction_of_copy']:.0%}), fp16 {v['fp16']['GBps']:.1f}"
            for k, v in pr["rings"].items()))
    if "device_loader" in out:
        lines.append("loader(device=) / CPU-normalised float32 moved: " + ", ".join(
            f"{k} {v['ratio_device_over_cpu_float32']:.2f}x" for k, v in out["device_loader"].items()))
        if out["machine"]["device"].startswith("cuda"):
            best = max(v["ratio_device_over_cpu_float32"] for v in out["device_loader"].values())
            lines.append(f"target loader(device=) >= 1.5x CPU normalisation: {'met' if best >= 1.5 else 'NOT met'} "
                         f"(best {best:.2f}x)")
    if "jpeg_decode" in out:
        j = out["jpeg_decode"]
        lines.append(f"JPEG decode of {j['images']} x {'x'.join(map(str, j['shape']))} q{j['quality']} records, vs PIL: "
                     + ", ".join(f"{k} {v['images_per_s']['median']:,.0f}/s (max |diff| {v['max_abs_diff']}, "
                                 f"{v['fraction_pixels_differing']:.1%} of pixels differ)"
                                 for k, v in j.items() if isinstance(v, dict)))
    if "jpeg_store_device" in out:
        j = out["jpeg_store_device"]
        u = j["uint8_vs_host"]
        lines.append(f"JPEG store, RRC(224) + flip + normalise via loader(device=): host decode "
                     f"{j['host decode']['samples_per_s']['median']:,.0f}/s, device decode "
                     f"{j['device decode']['samples_per_s']['median']:,.0f}/s; device crops vs host: max |diff| "
                     f"{u['max_abs_diff']}, mean {u['mean_abs_diff']:.3f}, PSNR {u['psnr_db']:.1f} dB")
    if "device_tests" in out:
        t = out["device_tests"]
        c = t["counts"]
        lines.append(f"device tests (pytest -k cuda): {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, "
                     f"{c.get('skipped', 0)} skipped" + (f"; failed: {', '.join(t['failed'])}" if t["failed"] else ""))
    lines.append(f"total time {out['seconds']:.0f} s")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small stores (seconds on a CPU)")
    parser.add_argument("--cifar", type=int, default=0, help="samples of the CIFAR-sized store")
    parser.add_argument("--imagenet", type=int, default=0, help="samples of the ImageNet-sized store")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=20, help="timed GPU-loader epochs (CIFAR)")
    parser.add_argument("--repeats", type=int, default=3, help="preloads per store")
    parser.add_argument("--workdir", default=None, help="where to build the stores (default: $TMPDIR)")
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--tests", action=argparse.BooleanOptionalAction, default=None,
                        help="also run the suite's CUDA tests in a subprocess (default: on a CUDA device)")
    args = parser.parse_args(argv)
    if args.tests is None:
        args.tests = args.device.startswith("cuda")
    if args.quick and args.epochs == 20:
        args.epochs = 3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here; run with --device cpu (add --quick for a fast run)", file=sys.stderr)
        return 2
    out = run(args)
    text = report(out)
    print()
    print(text)
    out["table"] = text
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
