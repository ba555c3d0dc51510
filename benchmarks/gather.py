"""Crop + flip against static-only reads on every format, and what one batch costs stage by stage.

Writes one store per format (shards, LMDB, HDF5; and HDF5 with lzf chunks, read natively) of
``--images`` photo-like 224x224 samples (smooth gradients plus noise), then:

* ``stages``: one batch of 64 random samples, warm, each stage timed alone (median of
  ``--stage-repeats`` calls): the index check, finding the samples (``_extents``: offsets
  from the chunk index / the B-tree's leaves / the shard layout), the advice (willneed on:
  the page-cache probe that skips a warm batch), the native copy (``get_many``), the crop
  kernel on those copies, the in-place addresses (``sample_addresses``) and the kernel
  reading in place; then the whole ``StoreDataset.get_batch``, static only and with crop +
  flip.
* ``lab``: epochs through ``dlstore.loader`` (defaults: ``num_workers=0`` builds batches on
  threads; ``num_workers=2`` on the shared-memory ring), batch 64, shuffled, static only
  (no transform) and with ``RandomCrop(224, padding=16)`` + ``RandomHorizontalFlip()``,
  every (format, transform, workers) cell once per round, in a shuffled order, the load
  average recorded beside each. Ratios: crop+flip / the format's static-only rate, and
  crop+flip / shards' crop+flip, both per round (medians over rounds).

The stores are read warm (written just before, read once before timing): this compares
CPU work per batch, not disks (``cold_cache.py`` does that).

    python benchmarks/gather.py [--images 2000] [--rounds 5] [--epochs 3] [--parts stages,lab]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, uptime, write_json  # noqa: E402

STORES = {"shards": ("s.shards", {}), "lmdb": ("s.lmdb", {}), "hdf5": ("s.h5", {}),
          "hdf5 lzf": ("lzf.h5", {"compression": "lzf"})}
TARGET_OWN, TARGET_SHARDS = 0.85, 0.8


def photo_like(n: int, size: int, seed: int = 0) -> np.ndarray:
    """(n, size, size, 3) uint8: a colour gradient per image plus noise (compresses as photos do)."""
    rng = np.random.default_rng(seed)
    y, x = np.linspace(0, 1, size)[:, None], np.linspace(0, 1, size)[None, :]
    out = np.empty((n, size, size, 3), np.uint8)
    for i in range(n):
        a, b, c = rng.random(3)
        base = np.stack([a * y + b * x, b * y + c * x, c * y + a * x], -1) * 200
        out[i] = np.clip(base + rng.normal(0, 12, (size, size, 3)), 0, 255)
    return out


def build(root: Path, n: int, names: list[str]) -> dict[str, Path]:
    import dlstore

    images, labels = photo_like(n, 224), np.arange(n) % 10
    paths = {}
    for name in names:
        file_name, options = STORES[name]
        paths[name] = root / file_name
        dlstore.convert((images, labels), paths[name], workers=0, progress=False, **options)
    return paths


def crop_flip():
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomCrop(224, padding=16), v2.RandomHorizontalFlip()])


# --- stages ------------------------------------------------------------------------------

def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def stages(path: Path, repeats: int, seed: int = 0) -> dict[str, float]:
    """Microseconds per batch of 64 of each stage (see the module doc), warm."""
    import dlstore
    from dlstore.formats.checks import check_indices
    from dlstore.transforms import compiled

    rng = np.random.default_rng(seed)
    fused, plain = dlstore.open_dataset(path, transform=crop_flip()), dlstore.open_dataset(path)
    reader = fused.reader
    idx = rng.permutation(len(fused))[:64]
    for _ in range(3):
        fused.get_batch(idx)
        plain.get_batch(idx)
    out = np.empty((64, 3, 224, 224), np.uint8)
    tops, lefts, flips = rng.integers(0, 33, 64), rng.integers(0, 33, 64), rng.random(64) < 0.5
    copies = reader.get_many(idx.tolist())
    kernel = (lambda: compiled.crop_flip(copies, out, tops, lefts, flips, (16, 16, 16, 16), 0))
    row = {"index check": _median_us(lambda: check_indices(reader.path, idx, reader.count), repeats),
           "lookup (_extents)": _median_us(lambda: reader._extents(idx), repeats)}
    willneed = reader.willneed
    reader.willneed = True
    row["advice (warm: probe only)"] = _median_us(lambda: reader._advise_batch(idx), repeats)
    reader.willneed = willneed
    row["copy (get_many)"] = _median_us(lambda: reader.get_many(idx.tolist()), repeats)
    row["crop kernel on copies"] = _median_us(kernel, repeats)
    located = reader.sample_addresses(idx) if hasattr(reader, "sample_addresses") else None
    if located is not None:
        addresses = located[0]
        row["addresses (sample_addresses)"] = _median_us(lambda: reader.sample_addresses(idx), repeats)
        row["crop kernel in place"] = _median_us(
            lambda: compiled.crop_flip_at(addresses, reader.shape, out, tops, lefts, flips, (16, 16, 16, 16), 0),
            repeats)
    row["get_batch (reader, static)"] = _median_us(lambda: reader.get_batch(idx, out=out), repeats)
    row["dataset get_batch, static"] = _median_us(lambda: plain.get_batch(idx), repeats)
    row["dataset get_batch, crop+flip"] = _median_us(lambda: fused.get_batch(idx), repeats)
    row["read path"] = getattr(reader, "read_path", "in place" if located is not None else "native")
    del located
    return row


def run_stages(paths: dict[str, Path], repeats: int) -> dict:
    print(f"stages: one batch of 64, warm, median us of {repeats} calls; {uptime()}", flush=True)
    table = {name: stages(path, repeats) for name, path in paths.items()}
    names = list(next(iter(table.values())))
    print(f"{'stage':32s}" + "".join(f"{n:>12s}" for n in table))
    for stage in names:
        cells = [table[n].get(stage, "-") for n in table]
        print(f"{stage:32s}" + "".join(f"{c:>12,.0f}" if isinstance(c, float) else f"{c:>12s}" for c in cells))
    return {"load_after": os.getloadavg(), "table": table}


# --- lab -------------------------------------------------------------------------------------

def epoch_rate(ds, workers: int, epochs: int, seed: int) -> float:
    import torch

    import dlstore

    loader = dlstore.loader(ds, batch_size=64, shuffle=True, num_workers=workers, persistent_workers=workers > 0,
                            generator=torch.Generator().manual_seed(seed))
    for _ in loader:          # warm: workers started, buffers, numba's kernel
        break
    n, start = 0, time.perf_counter()
    for e in range(epochs):
        loader.set_epoch(e)
        for images, _ in loader:
            n += len(images)
    return n / (time.perf_counter() - start)


def run_lab(paths: dict[str, Path], rounds: int, epochs: int, workers: list[int]) -> dict:
    import dlstore

    sets = {(name, tf): dlstore.open_dataset(path, transform=crop_flip() if tf == "crop+flip" else None)
            for name, path in paths.items() for tf in ("static", "crop+flip")}
    cells = [(name, tf, w) for (name, tf) in sets for w in workers]
    runs: dict[str, list[dict]] = {f"{n}|{t}|{w}": [] for n, t, w in cells}
    for cell in cells:
        epoch_rate(sets[cell[:2]], cell[2], 1, 0)       # warm-up: page cache, handles, kernels
    for r in range(rounds):
        order = list(cells)
        random.Random(r).shuffle(order)
        for name, tf, w in order:
            load = os.getloadavg()[0]
            rate = epoch_rate(sets[(name, tf)], w, epochs, r)
            runs[f"{name}|{tf}|{w}"].append({"rate": rate, "load1": load, "round": r})
        print(f"round {r + 1}/{rounds}; {uptime()}", flush=True)
    summary = {}
    print(f"\n{'format':10s}{'workers':>8s}{'static/s':>11s}{'crop+flip/s':>13s}{'cf/static':>11s}"
          f"{'cf/shards cf':>14s}{'load':>11s}")
    for name in paths:
        for w in workers:
            static, cf = runs[f"{name}|static|{w}"], runs[f"{name}|crop+flip|{w}"]
            shards = runs[f"shards|crop+flip|{w}"] if "shards" in paths else cf
            own = statistics.median(c["rate"] / s["rate"] for c, s in zip(cf, static))
            vs = statistics.median(c["rate"] / s["rate"] for c, s in zip(cf, shards))
            loads = [x["load1"] for x in static + cf]
            summary[f"{name}|{w}"] = {"static": statistics.median(x["rate"] for x in static),
                                      "crop_flip": statistics.median(x["rate"] for x in cf),
                                      "crop_flip_over_static": own, "crop_flip_over_shards": vs,
                                      "load1": [min(loads), max(loads)]}
            s = summary[f"{name}|{w}"]
            print(f"{name:10s}{w:>8d}{s['static']:>11,.0f}{s['crop_flip']:>13,.0f}{own:>11.2f}{vs:>14.2f}"
                  f"{min(loads):>6.1f}-{max(loads):.1f}")
    return {"runs": runs, "summary": summary}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per timed cell")
    parser.add_argument("--stage-repeats", type=int, default=200)
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--parts", default="stages,lab")
    parser.add_argument("--formats", default=",".join(STORES))
    parser.add_argument("--dir", default=None, help="where the stores go (default: a temporary folder)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gather.json"))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    parts = args.parts.split(",")
    result = {"benchmark": "gather", "machine": machine_info(), "args": vars(args), "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="dlstore-gather-", dir=args.dir) as tmp:
        paths = build(Path(tmp), args.images, args.formats.split(","))
        if "stages" in parts:
            result["stages"] = run_stages(paths, args.stage_repeats)
        if "lab" in parts:
            lab_paths = {k: v for k, v in paths.items() if k != "hdf5 lzf"}
            result["lab"] = run_lab(lab_paths, args.rounds, args.epochs, [int(w) for w in args.workers.split(",")])
    result["uptime_after"] = uptime()
    print(f"wrote {write_json(args.out, result)}; {uptime()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
