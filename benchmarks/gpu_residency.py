"""uint8 vs fp16 residency of a GPUDataset, fused vs unfused gather, end to end, in one run.

End to end = preload + ``epochs`` epochs of crop(padding=4) + flip + ToDtype + Normalize
batches (fp16 out, channels_last), for:

    fp16 held, unfused      GPUDataset(dtype=fp16, normalize=...)           loader(fused=False)   the baseline
    fp16 held, fused        the same dataset                                loader()
    uint8 held, unfused     GPUDataset(..., hold="uint8")                   loader(fused=False)
    uint8 held, fused       the same dataset                                loader()
    uint8 held, padded      GPUDataset(..., hold="uint8", padding=4)        loader()    (the crop pads nothing)
    (+ compiled variants of the fused ones with --compile)

Every variant serves the same batches bit for bit (checked here on the first epoch).

    python benchmarks/gpu_residency.py [--device cpu] [--count 10000] [--epochs 3] [--batch 512] [--compile]
                                       [--out benchmarks/results/gpu_residency.json]

On a GPU machine, ``scripts/gpu_check.py`` (or anyone) can call
``residency_comparison(path, device, epochs=..., batch=...)`` on an existing store.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import load_gpu_check, machine_info, sync, time_epochs, write_json

import dlstore
from dlstore.transforms import BatchCompose, BatchRandomCrop, BatchRandomHorizontalFlip

CIFAR = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


def variants(compile: bool) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(name, GPUDataset options, loader options)."""
    out = [("fp16 held, unfused", {}, {"fused": False}),
           ("fp16 held, fused", {}, {"fused": True}),
           ("uint8 held, unfused", {"hold": "uint8"}, {"fused": False}),
           ("uint8 held, fused", {"hold": "uint8"}, {"fused": True}),
           ("uint8 held, padded copy", {"hold": "uint8", "padding": 4}, {"fused": True})]
    if compile:
        out += [("fp16 held, fused, compiled", {}, {"fused": True, "compile": True}),
                ("uint8 held, fused, compiled", {"hold": "uint8"}, {"fused": True, "compile": True}),
                ("uint8 padded, fused, compiled", {"hold": "uint8", "padding": 4}, {"fused": True, "compile": True})]
    return out


def residency_comparison(path: str | os.PathLike, device: str | torch.device = "cuda", *, epochs: int = 3,
                         batch: int = 512, repeats: int = 3, compile: bool = False,
                         normalize: Any = CIFAR, log=print) -> dict[str, Any]:
    """Preload seconds, epoch seconds and end-to-end seconds of each residency / gather variant.

    The crop is the store's own size with padding 4 (the CIFAR recipe). Each variant is
    preloaded ``repeats`` times (median), then runs one warm-up epoch (compiles, if asked)
    and ``epochs`` timed epochs; ``end_to_end_s = preload_s + epochs * epoch_s``. Ratios
    are against "fp16 held, unfused" from the same run. ``same_batches`` checks that every
    variant's first epoch equals the baseline's bit for bit.
    """
    device = torch.device(device)
    shape = dlstore.open_dataset(path).shape
    size = tuple(shape[1:])
    transform = BatchCompose([BatchRandomCrop(size, padding=4), BatchRandomHorizontalFlip()])
    results: dict[str, Any] = {}
    reference = None
    # warm-up: CUDA context, allocator and pinned-memory caches, so that the baseline's first
    # preload does not pay them for everyone
    dlstore.GPUDataset(path, device, torch.float16, normalize=normalize)
    sync(device)
    for name, ds_kw, loader_kw in variants(compile):
        preloads = []
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            ds = dlstore.GPUDataset(path, device, torch.float16, normalize=normalize, **ds_kw)
            sync(device)
            preloads.append(time.perf_counter() - t0)
        ds.transform = transform
        loader = dlstore.loader(ds, batch, shuffle=True, seed=0, drop_last=True, channels_last=True, **loader_kw)
        first = [x for x, _ in loader]   # warm-up epoch (epoch 0), kept for the equality check
        sync(device)
        if reference is None:
            reference = first
        same = len(first) == len(reference) and all(torch.equal(a, b) for a, b in zip(first, reference))
        del first
        times = time_epochs(loader, device, epochs)
        samples = len(loader) * batch
        preload_s = statistics.median(preloads)
        epoch_s = statistics.median(times)
        results[name] = {
            "preload_s": preload_s, "preload_runs": preloads, "epoch_s": epoch_s, "epoch_runs": times,
            "end_to_end_s": preload_s + epochs * epoch_s, "samples_per_s": samples / epoch_s,
            "device_bytes": ds.nbytes, "mode": ds.mode, "fused": loader.strategy.fused,
            "compiled": bool(loader.strategy.gather is not None and loader.strategy.gather.compiled), "same_batches": same,
        }
        log(f"  {name:30s} preload {preload_s * 1e3:8.1f} ms  epoch {epoch_s * 1e3:8.1f} ms  "
            f"{samples / epoch_s:12,.0f} samples/s  {ds.nbytes / 2**20:8.1f} MiB  same={same}")
        del ds, loader
    base = results["fp16 held, unfused"]
    for r in results.values():
        r["end_to_end_vs_baseline"] = base["end_to_end_s"] / r["end_to_end_s"]
        r["epoch_speed_vs_baseline"] = base["epoch_s"] / r["epoch_s"]
        r["preload_speed_vs_baseline"] = base["preload_s"] / r["preload_s"]
        r["memory_vs_baseline"] = r["device_bytes"] / base["device_bytes"]
    return {"path": str(path), "device": str(device), "shape": list(shape), "count": len(dlstore.open_dataset(path)),
            "epochs": epochs, "batch": batch, "repeats": repeats, "variants": results}


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """GB/s of a plain copy of ``nbytes``: pinned host -> device on CUDA, a host memcpy on CPU."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda").fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(host, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9


def preload_bandwidth(path: str | os.PathLike, device: str | torch.device = "cuda", *, repeats: int = 3,
                      rings: tuple[int, ...] = (2, 4, 8), chunk_mib: tuple[int | None, ...] = (None,),
                      normalize: Any = CIFAR) -> dict[str, Any]:
    """Preload GB/s (uint8 bytes read per second) for each preload ring size, vs a plain copy.

    On CUDA ``ring`` pinned host buffers are filled by ``ring - 1`` reader threads (``ring=2``:
    one reader, the behaviour before the ring); on CPU the ring is fixed at two buffers.
    ``chunk_mib``: chunk sizes to try (None: the default, 64 MiB); rows are keyed
    ``"ring R"`` or ``"ring R, chunk C MiB"``.
    """
    from dlstore.data.gpu import preload as gpu_module

    device = torch.device(device)
    store = dlstore.open_dataset(path)
    nbytes = len(store) * int(torch.tensor(store.shape).prod())
    copy = copy_bandwidth(device, min(nbytes, 1 << 30))
    out: dict[str, Any] = {"bytes": nbytes, "copy_GBps": copy, "rings": {}}
    saved = gpu_module.PRELOAD_RING
    sample = nbytes // len(store)
    dlstore.GPUDataset(path, device, torch.uint8)   # warm-up (context, caches)
    try:
        for ring in (rings if device.type == "cuda" else rings[:1]):
            gpu_module.PRELOAD_RING = ring
            for mib in chunk_mib:
                chunk = None if mib is None else max(1, (mib << 20) // sample)
                row = {}
                for name, kw in (("uint8", {"dtype": torch.uint8}),
                                 ("fp16", {"dtype": torch.float16, "normalize": normalize})):
                    seconds = []
                    for _ in range(repeats):
                        sync(device)
                        t0 = time.perf_counter()
                        ds = dlstore.GPUDataset(path, device, chunk_size=chunk, **kw)
                        sync(device)
                        seconds.append(time.perf_counter() - t0)
                        del ds
                    gbps = nbytes / statistics.median(seconds) / 1e9
                    row[name] = {"GBps": gbps, "fraction_of_copy": gbps / copy, "seconds": seconds}
                out["rings"][f"ring {ring}" + ("" if mib is None else f", chunk {mib} MiB")] = row
    finally:
        gpu_module.PRELOAD_RING = saved
    return out


def build_array_store(root: Path, count: int, size: int) -> dict[str, Any]:
    """A store of ``count`` random 3 x size x size samples, converted from arrays (fast to make)."""
    import numpy as np

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (count, size, size, 3), dtype=np.uint8)
    result = dlstore.convert((images, np.arange(count) % 10), root / f"arrays{size}.shards",
                             workers=0, progress=False)
    return {"path": str(result.path), "count": result.count, "shape": list(result.shape), "source": "arrays"}


def report(out: dict[str, Any]) -> str:
    lines = [(f"{'variant':32s} {'end-to-end':>11s} {'x base':>7s} {'epoch x':>8s} {'preload x':>9s} "
             f"{'memory x':>8s} {'same':>5s}")]
    for name, r in out["variants"].items():
        lines.append(f"{name:32s} {r['end_to_end_s']:10.3f}s {r['end_to_end_vs_baseline']:6.2f}x "
                     f"{r['epoch_speed_vs_baseline']:7.2f}x {r['preload_speed_vs_baseline']:8.2f}x "
                     f"{r['memory_vs_baseline']:8.2f} {r['same_batches']!s:>5s}")
    return "\n".join(lines)


def _load() -> str:
    try:
        return open("/proc/loadavg", encoding="ascii").read().strip()
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--count", type=int, default=10_000, help="samples of the CIFAR-like 3x32x32 store")
    p.add_argument("--store", help="an existing fixed-shape store instead of building one")
    p.add_argument("--source", choices=["arrays", "folder"], default="arrays",
                   help="build the store from random arrays (fast) or a PNG folder (as gpu_check)")
    p.add_argument("--size", type=int, default=32, help="sample side of the built store")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="add torch.compile'd fused variants")
    p.add_argument("--out", default=str(HERE / "results" / "gpu_residency.json"))
    args = p.parse_args(argv)
    load_before = _load()
    with tempfile.TemporaryDirectory(prefix="dlstore-residency-") as tmp:
        store_info: dict[str, Any] = {}
        path = args.store
        if path is None and args.source == "arrays":
            store_info = build_array_store(Path(tmp), args.count, args.size)
            path = store_info["path"]
        elif path is None:
            check = load_gpu_check()
            store_info = check.build_store(Path(tmp), "cifar", count=args.count, unique=min(args.count, 300),
                                           classes=10, size=(32, 32), ext=".png", static="center_crop=32",
                                           workers=min(4, os.cpu_count() or 1))
            path = store_info["path"]
        print(f"dlstore GPU residency on {args.device}, torch {torch.__version__}, load {load_before}")
        out = residency_comparison(path, args.device, epochs=args.epochs, batch=args.batch,
                                   repeats=args.repeats, compile=args.compile)
        out["preload"] = preload_bandwidth(path, args.device, repeats=args.repeats)
    try:
        machine = machine_info()
    except ImportError as exc:   # a machine without every optional module (e.g. lmdb)
        machine = {"error": str(exc)}
    out.update({"machine": machine, "torch": torch.__version__, "load_before": load_before,
                "load_after": _load(), "store": store_info})
    print(report(out))
    pre = out["preload"]
    print(f"plain copy {pre['copy_GBps']:.2f} GB/s; preload of {pre['bytes'] / 1e6:.0f} MB:")
    for ring, row in pre["rings"].items():
        print(f"  {ring}: " + ", ".join(f"{k} {v['GBps']:.2f} GB/s ({v['fraction_of_copy']:.0%} of copy)"
                                            for k, v in row.items()))
    print(f"load average before / after: {load_before} / {out['load_after']}")
    print(f"wrote {write_json(args.out, out)}")
    return out


if __name__ == "__main__":
    main()
