"""The store loader: threads vs one thread vs worker processes vs ImageFolder, as ratios in one run.

Generates ImageNet-sized JPEGs (500x375), converts them with
``resize=256,center_crop=224`` to shards, LMDB and HDF5 (raw 3x224x224 uint8)
and to a JPEG-encoded LMDB store, then measures samples/s of every
configuration below, round-robin over ``--rounds`` rounds (each configuration
runs whole epochs of batch 64 for at least ``--seconds`` per round, shuffled;
each loader is made once and iterated every epoch, as a training loop does; ImageFolder
reads every 5th image so its epoch is short too), and prints the median of each and these ratios (issue 17):

1. thread scaling: ``dlstore.loader(backend="threads", num_threads=2)`` over ``threads=1``, static
   store and crop+flip (``RandomCrop(224, padding=4)`` + ``RandomHorizontalFlip()``);
2. crop+flip over static, through the default loader;

   crop+flip runs numba's compiled kernel where numba is installed (the ``fast`` extra), and
   ``... pure`` configurations run the pure-numpy kernel (``DLSTORE_COMPILED=0``) for (1) and (2);
3. the default ``dlstore.loader`` over a plain ``ds.get_batch`` loop;
4. process workers: ``num_workers=2`` (persistent) over ``num_workers=0`` (both ``threads=0``),
   through the DataLoader (``shm_ring=False``) and through the shared-memory ring (the default), and the ring
   over the DataLoader;
5. JPEG store: the default loader (threads, batches decoded by ``torchvision.io.decode_jpeg``)
   over today's path (PIL record by record, ``threads=0``), and decode_jpeg alone (both ``threads=0``);
6. every format through the default loader over torchvision ``ImageFolder``
   (same static transforms, ``DataLoader(num_workers=0)``);
7. cold cache: not measured here (``dlstore bench`` evicts the page cache).

And the kernels alone, without the loader (``kernel ...``): the static gather
(``reader.get_batch``, one ``np.take``) against the fused crop+flip
(``functional.crop_flip_loop`` on the reader's views, or ``compiled.crop_flip_at`` on
the samples in place), whole batches on 1 and 2 threads of a pool: what (1) and (2)
would be if the loader cost nothing.

Each ratio is printed twice: the ratio of the two configurations' medians (judged against
the target), and ``paired``, the median of the per-round ratios (both sides measured
seconds apart, so a load change between rounds cancels).

Every configuration also records ``cpu/wall``: the CPU seconds this process got
per wall second (worker processes not counted). On a machine shared with other
jobs the scheduler may give the process less than one core whatever its thread
count (Linux autogroups share CPU per session, not per thread); then thread
scaling cannot show. The control says how much it can: batch-sized numpy copies
(GIL-free) on 2 threads over 1, measured in the same rounds; ratio (1) is
printed both raw and as a fraction of that ceiling. torch runs one intra-op thread, so the
thread count is the loader's alone. The stores are read right after being
written (page cache warm), so the ratios compare CPU work, not disks.

    python benchmarks/loader.py [--images 600] [--rounds 5] [--seconds 1.0] [--workdir DIR] [--only (4)]

``--only`` keeps the configurations of the ratios whose label contains it (say ``(4)``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset
from torchvision import datasets
from torchvision.transforms import v2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, write_json

import dlstore
from dlstore.sources.demo import make_image_folder
from dlstore.transforms import compiled

STATIC = "resize=256,center_crop=224"
BATCH = 64
STORES = {"shards": ("s.shards", {}), "lmdb": ("s.lmdb", {}), "hdf5": ("s.h5", {}),
          "jpeg lmdb": ("j.lmdb", {"encoding": "jpeg"})}
TARGETS = {"(1) threads 2/1 static": 1.6, "(1) threads 2/1 crop+flip": 1.6, "(2) crop+flip/static": 0.85,
           "(3) default loader/plain get_batch": 0.95, "(4) num_workers 2/0": 1.0, "(4) ring num_workers 2/0": 1.0,
           "(5) jpeg default/PIL today": 2.0,
           "(6) lmdb/ImageFolder": 50.0}


def crop_flip() -> v2.Compose:
    return v2.Compose([v2.RandomCrop(224, padding=4), v2.RandomHorizontalFlip()])


def epochs(make: Callable[[], Iterable], seconds: float) -> tuple[float, float]:
    """Whole epochs of ``make()`` until ``seconds`` pass: (samples/s, CPU s per wall s).

    Whole epochs: a loader cut short mid-epoch would be charged for the batches it had
    built ahead and never delivered (a threaded loader keeps several in flight).
    """
    n = 0
    wall, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        for _, labels in make():
            n += len(labels)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return n / wall, cpu / wall


def plain_loop(ds, generator: torch.Generator) -> Iterable:
    """What a user writes by hand: a shuffled index list, one ``get_batch`` per batch."""
    order = torch.randperm(len(ds), generator=generator).numpy()
    for s in range(0, len(order), BATCH):
        yield ds.get_batch(order[s:s + BATCH], generator=generator)


def memcpy(threads: int, batches: int = 16) -> Iterable:
    """The control: batch-sized copies between in-memory arrays (GIL-free numpy) on ``threads``
    threads. Its 2/1 ratio is the most that threads can gain on this machine right now."""
    src = np.ones((BATCH, 3, 224, 224), np.uint8)
    local = threading.local()

    def one(_):
        if not hasattr(local, "dst"):
            local.dst = np.empty_like(src)
        local.dst[...] = src
        return range(BATCH)

    with ThreadPoolExecutor(threads) as pool:
        for labels in pool.map(one, range(batches)):
            yield None, labels


def once(make: Callable[[], Iterable]) -> Callable[[], Iterable]:
    """``make()`` on the first call, the same loader afterwards: a training loop makes its loader
    once and iterates it every epoch (a new one per 10-batch epoch would charge thread start-up
    and the pipeline's fill and drain to every epoch)."""
    made: list[Iterable] = []

    def get() -> Iterable:
        if not made:
            made.append(make())
        return made[0]
    return get


def pure(make: Callable[[], Iterable]) -> Callable[[], Iterable]:
    """``make`` with the pure crop+flip kernel (``DLSTORE_COMPILED=0`` while its batches are read)."""
    def run() -> Iterable:
        os.environ["DLSTORE_COMPILED"] = "0"
        try:
            yield from make()
        finally:
            os.environ.pop("DLSTORE_COMPILED", None)
    return run


def kernel(ds, crop_flip_: bool, threads: int, generator: torch.Generator, batches: int = 16,
           compiled_: bool = False, flip_p: float = 0.5) -> Iterable:
    """``batches`` shuffled batches of ``ds`` built by the bare kernel on ``threads`` threads: the static
    gather into a reused buffer, or the fused crop (224, padding 4) + flip of the loader's crop+flip
    (the pure loop, or with ``compiled_`` numba's kernel reading the samples in place). ``flip_p=0``:
    crops only, what a store holding a mirrored copy of every sample would cost (its flips plain copies)."""
    from dlstore.transforms import compiled
    from dlstore.transforms.batch import BatchRandomCrop, BatchRandomHorizontalFlip
    from dlstore.transforms.functional import crop_flip_loop

    crop, flip = BatchRandomCrop(224, padding=4), BatchRandomHorizontalFlip(flip_p)
    c, h, w = ds.shape
    local = threading.local()
    order = torch.randperm(len(ds), generator=generator).numpy()
    starts = [s % (len(order) - BATCH) for s in range(0, batches * BATCH, BATCH)]
    params = [(crop.sample((BATCH, c, h, w), generator=generator), flip.sample((BATCH,), generator=generator))
              for _ in starts]

    def one(k):
        if not hasattr(local, "out"):
            local.out = np.empty((BATCH, c, h, w), np.uint8)
        idx = order[starts[k]:starts[k] + BATCH]
        if crop_flip_ and compiled_:
            p_crop, p_flip = params[k]
            addresses, _mapped = ds.reader.sample_addresses(idx)
            compiled.crop_flip_at(addresses, (c, h, w), local.out, p_crop["top"].numpy(), p_crop["left"].numpy(),
                                  p_flip["flip"].numpy(), crop.padding_for(h, w), 0)
        elif crop_flip_:
            p_crop, p_flip = params[k]
            crop_flip_loop(ds.reader.get_many(idx.tolist()), local.out, p_crop["top"].numpy(),
                           p_crop["left"].numpy(), p_flip["flip"].numpy(), crop.padding_for(h, w), 0)
        else:
            ds.reader.get_batch(idx, out=local.out)
        return range(BATCH)

    with ThreadPoolExecutor(threads) as pool:
        for labels in pool.map(one, range(len(starts))):
            yield None, labels


def configurations(stores: dict[str, Path], folder: Path) -> dict[str, Callable[[], Iterable]]:
    static = {name: dlstore.open_dataset(path) for name, path in stores.items()}
    aug = dlstore.open_dataset(stores["shards"], transform=crop_flip())
    pil = dlstore.open_dataset(stores["jpeg lmdb"])
    pil.reader._batch_jpeg = False          # decode with PIL, record by record, as before issue 17
    g = torch.Generator().manual_seed(0)
    imagefolder = datasets.ImageFolder(str(folder), transform=v2.Compose(
        [v2.Resize(256), v2.CenterCrop(224), v2.PILToTensor()]))
    # every 5th image: an epoch of ImageFolder fits in a measurement window
    imagefolder = Subset(imagefolder, range(0, len(imagefolder), 5))
    workers = dlstore.loader(static["shards"], BATCH, shuffle=True, num_workers=2,
                             persistent_workers=True, generator=g, backend="dataloader")   # the DataLoader path
    ring = dlstore.loader(static["shards"], BATCH, shuffle=True, num_workers=2,
                          persistent_workers=True, generator=g, backend="ring")
    ring_aug = dlstore.loader(aug, BATCH, shuffle=True, num_workers=2,
                              persistent_workers=True, generator=g, backend="ring")
    workers_aug = dlstore.loader(aug, BATCH, shuffle=True, num_workers=2,
                                 persistent_workers=True, generator=g, backend="dataloader")
    configs = {
        "memcpy threads=1": lambda: memcpy(1),
        "memcpy threads=2": lambda: memcpy(2),
        "kernel static threads=1": lambda: kernel(static["shards"], False, 1, g),
        "kernel static threads=2": lambda: kernel(static["shards"], False, 2, g),
        "kernel crop+flip threads=1": lambda: kernel(static["shards"], True, 1, g),
        "kernel crop+flip threads=2": lambda: kernel(static["shards"], True, 2, g),
        "kernel crop+flip compiled threads=1": lambda: kernel(static["shards"], True, 1, g, compiled_=True),
        "kernel crop+flip compiled threads=2": lambda: kernel(static["shards"], True, 2, g, compiled_=True),
        "kernel crop only compiled threads=1": lambda: kernel(static["shards"], True, 1, g, compiled_=True,
                                                              flip_p=0.0),
        "plain get_batch": lambda: plain_loop(static["shards"], g),
        "plain get_batch crop+flip": lambda: plain_loop(aug, g),
        "threads=1": lambda: dlstore.loader(static["shards"], BATCH, shuffle=True, backend="threads", num_threads=1, generator=g),
        "threads=2": lambda: dlstore.loader(static["shards"], BATCH, shuffle=True, backend="threads", num_threads=2, generator=g),
        "threads=1 crop+flip": lambda: dlstore.loader(aug, BATCH, shuffle=True, backend="threads", num_threads=1, generator=g),
        "threads=2 crop+flip": lambda: dlstore.loader(aug, BATCH, shuffle=True, backend="threads", num_threads=2, generator=g),
        "threads=1 crop+flip pure": pure(once(lambda: dlstore.loader(aug, BATCH, shuffle=True, backend="threads", num_threads=1, generator=g))),
        "threads=2 crop+flip pure": pure(once(lambda: dlstore.loader(aug, BATCH, shuffle=True, backend="threads", num_threads=2, generator=g))),
        "default": lambda: dlstore.loader(static["shards"], BATCH, shuffle=True, generator=g),
        "default crop+flip": lambda: dlstore.loader(aug, BATCH, shuffle=True, generator=g),
        "default crop+flip pure": pure(once(lambda: dlstore.loader(aug, BATCH, shuffle=True, generator=g))),
        "num_workers=0": lambda: dlstore.loader(static["shards"], BATCH, shuffle=True, backend="dataloader", generator=g),
        "num_workers=2": lambda: workers,
        "num_workers=2 ring": lambda: ring,
        "num_workers=0 crop+flip": lambda: dlstore.loader(aug, BATCH, shuffle=True, backend="dataloader", generator=g),
        "num_workers=2 crop+flip": lambda: workers_aug,
        "num_workers=2 ring crop+flip": lambda: ring_aug,
        "default lmdb": lambda: dlstore.loader(static["lmdb"], BATCH, shuffle=True, generator=g),
        "default hdf5": lambda: dlstore.loader(static["hdf5"], BATCH, shuffle=True, generator=g),
        "default jpeg lmdb": lambda: dlstore.loader(static["jpeg lmdb"], BATCH, shuffle=True, generator=g),
        "threads=0 jpeg lmdb": lambda: dlstore.loader(static["jpeg lmdb"], BATCH, shuffle=True, backend="dataloader",
                                                      generator=g),
        "PIL, threads=0 jpeg lmdb": lambda: dlstore.loader(pil, BATCH, shuffle=True, backend="dataloader", generator=g),
        "ImageFolder": lambda: DataLoader(imagefolder, batch_size=BATCH, shuffle=True, num_workers=0, generator=g),
    }
    # every loader made once and iterated each epoch (the kernels, loops and pure(...) run afresh)
    fresh = ("memcpy", "kernel", "plain")
    return {name: make if name.startswith(fresh) or name.endswith(" pure") else once(make)
            for name, make in configs.items()}


RATIOS = {   # name -> (numerator, denominator)
    "(1) control: memcpy threads 2/1": ("memcpy threads=2", "memcpy threads=1"),
    "(1) threads 2/1 static": ("threads=2", "threads=1"),
    "(1) threads 2/1 crop+flip": ("threads=2 crop+flip", "threads=1 crop+flip"),
    "(2) crop+flip/static": ("default crop+flip", "default"),
    "(2) crop+flip/static, plain loop": ("plain get_batch crop+flip", "plain get_batch"),
    "(1) pure: threads 2/1 crop+flip": ("threads=2 crop+flip pure", "threads=1 crop+flip pure"),
    "(2) pure: crop+flip/static": ("default crop+flip pure", "default"),
    "(2) compiled/pure crop+flip, default": ("default crop+flip", "default crop+flip pure"),
    "(1k) kernel threads 2/1 static": ("kernel static threads=2", "kernel static threads=1"),
    "(1k) kernel threads 2/1 crop+flip": ("kernel crop+flip threads=2", "kernel crop+flip threads=1"),
    "(1k) kernel threads 2/1 crop+flip compiled": ("kernel crop+flip compiled threads=2",
                                                   "kernel crop+flip compiled threads=1"),
    "(2k) kernel crop+flip/static": ("kernel crop+flip threads=1", "kernel static threads=1"),
    "(2k) kernel crop+flip compiled/static": ("kernel crop+flip compiled threads=1", "kernel static threads=1"),
    "(2k) mirrored-copy bound: crop only/crop+flip, compiled": ("kernel crop only compiled threads=1",
                                                                "kernel crop+flip compiled threads=1"),
    "(3) default loader/plain get_batch": ("default", "plain get_batch"),
    "(4) num_workers 2/0": ("num_workers=2", "num_workers=0"),
    "(4) ring num_workers 2/0": ("num_workers=2 ring", "num_workers=0"),
    "(4) ring/DataLoader num_workers=2": ("num_workers=2 ring", "num_workers=2"),
    "(4) ring num_workers 2/0 crop+flip": ("num_workers=2 ring crop+flip", "num_workers=0 crop+flip"),
    "(4) ring/DataLoader crop+flip": ("num_workers=2 ring crop+flip", "num_workers=2 crop+flip"),
    "(5) jpeg default/PIL today": ("default jpeg lmdb", "PIL, threads=0 jpeg lmdb"),
    "(5) jpeg decode_jpeg/PIL, no threads": ("threads=0 jpeg lmdb", "PIL, threads=0 jpeg lmdb"),
    "(6) shards/ImageFolder": ("default", "ImageFolder"),
    "(6) lmdb/ImageFolder": ("default lmdb", "ImageFolder"),
    "(6) hdf5/ImageFolder": ("default hdf5", "ImageFolder"),
    "(6) jpeg lmdb/ImageFolder": ("default jpeg lmdb", "ImageFolder"),
}


def prepare(root: Path, images: int) -> tuple[Path, dict[str, Path]]:
    folder = root / "images"
    if not folder.exists():
        make_image_folder(folder, classes=10, per_class=max(1, images // 10))
    stores = {}
    for name, (file, options) in STORES.items():
        path = root / file
        if not path.exists():
            dlstore.convert(folder, path, static=STATIC, progress=False, **options)
        stores[name] = path
    return folder, stores


def numba_version() -> str | None:
    try:
        import numba
    except ImportError:
        return None
    return numba.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0, help="per configuration and round")
    parser.add_argument("--workdir", type=Path, help="keep the images and stores here (reused when present)")
    parser.add_argument("--only", help="measure only the ratios whose label contains this, e.g. '(4)'")
    parser.add_argument("--out", type=Path, help="the JSON written (default: results/loader.json, or "
                        "results/loader_only.json with --only, so a partial run keeps the full one)")
    args = parser.parse_args()
    if args.out is None:
        args.out = Path(__file__).parent / "results" / ("loader_only.json" if args.only else "loader.json")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.workdir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        folder, stores = prepare(root, args.images)
        configs = configurations(stores, folder)
        if args.only:
            keep = {name for label, pair in RATIOS.items() if args.only in label for name in pair}
            configs = {name: make for name, make in configs.items() if name in keep}
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
        loads = [os.getloadavg()[0]]
        for name, make in configs.items():                 # warm-up: page cache, worker start, first epochs
            epochs(make, 0.2)
        for r in range(args.rounds):
            for name, make in configs.items():
                runs[name].append(epochs(make, args.seconds))
            loads.append(os.getloadavg()[0])
        del configs                                       # stops the persistent workers
    rate = {name: statistics.median(s for s, _ in v) for name, v in runs.items()}
    share = {name: statistics.median(c for _, c in v) for name, v in runs.items()}
    # the ratio of the medians, and the spread of the per-round ratios (same conditions within a round)
    ratios, rounds = {}, {}
    for label, (a, b) in RATIOS.items():
        if a not in runs or b not in runs:
            continue
        rounds[label] = [x[0] / y[0] for x, y in zip(runs[a], runs[b])]
        ratios[label] = {"ratio": rate[a] / rate[b], "target": TARGETS.get(label)}
    control = "(1) control: memcpy threads 2/1"
    for label in ("(1) threads 2/1 static", "(1) threads 2/1 crop+flip") if control in ratios else ():
        # what threads gained over what they could gain here: 1.0 = all of the machine's ceiling
        rounds[f"{label} / control"] = [x / c for x, c in zip(rounds[label], rounds[control])]
        ratios[f"{label} / control"] = {"ratio": ratios[label]["ratio"] / ratios[control]["ratio"], "target": None}
    for label, r in ratios.items():   # "paired": the median of the per-round ratios
        r.update(round_min=min(rounds[label]), round_max=max(rounds[label]), paired=statistics.median(rounds[label]))
    uptime = subprocess.run(["uptime"], check=False, capture_output=True, text=True).stdout.strip()
    print(f"{args.images} images, batch {BATCH}, {args.rounds} rounds x {args.seconds}s; load during the run: "
          f"{min(loads):.1f}-{max(loads):.1f} (1-min avg, {os.cpu_count()} CPUs)\n{uptime}\n")
    print(f"{'configuration':28s} {'samples/s':>10s} {'min':>8s} {'max':>8s} {'cpu/wall':>8s}")
    for name, v in runs.items():
        s = [x for x, _ in v]
        print(f"{name:28s} {rate[name]:10.0f} {min(s):8.0f} {max(s):8.0f} {share[name]:8.2f}")
    print(f"\n{'ratio':44s} {'median':>7s} {'paired':>7s} {'rounds':>13s} {'target':>7s}  met")
    for label, r in ratios.items():
        target = r["target"]
        met = "" if target is None else ("yes" if r["ratio"] >= target else "NO")
        tgt = "" if target is None else f">={target:g}"
        print(f"{label:44s} {r['ratio']:7.2f} {r['paired']:7.2f} {r['round_min']:6.2f}-{r['round_max']:<6.2f} "
              f"{tgt:>7s}  {met}")
    print("median: of each configuration's rounds, then divided; paired: the median of the per-round ratios "
          "(both sides measured seconds apart); met: judged on median")
    print("(7) cold cache, random order: not measured here (see dlstore bench)")
    path = write_json(args.out, {
        "machine": machine_info(), "load_1min": loads, "uptime": uptime, "images": args.images,
        "batch_size": BATCH, "only": args.only, "rounds": args.rounds, "seconds": args.seconds, "static": STATIC,
        "crop_flip": "RandomCrop(224, padding=4) + RandomHorizontalFlip()",
        "compiled_kernel": compiled.available(), "numba": numba_version(),
        "samples_per_s": {name: [x for x, _ in v] for name, v in runs.items()},
        "cpu_per_wall": {name: [c for _, c in v] for name, v in runs.items()},
        "median_samples_per_s": rate, "ratios": ratios})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
