"""Conversion rate by source kind: an in-memory array, a torchvision-style dataset, an ImageFolder.

One CIFAR-shaped uint8 array (default 50,000 x 32x32x3, pixels random from a fixed
seed, labels ``i % 10``) is converted three ways, all in this process:

* ``array``: ``dlstore.convert((images, labels), ...)``;
* ``dataset``: a tiny map-style Dataset returning ``(PIL image, label)`` from the
  same array, as ``torchvision.datasets.CIFAR10`` does (``FakeData`` draws a random
  image per item, far slower than the conversion it would measure);
* ``folder`` (the baseline, what users did before): the same images written out as
  an ImageFolder of PNGs, then that folder converted. Its rate is given for the
  convert alone and for write + convert.

With ``--repeats R`` the three run in turn R times (interleaved) and the median
rate is reported. The three stores are checked bit-identical (the folder store's
order is ImageFolder's, mapped back to array indices through its provenance,
``ds.samples``). A warm-up on 256 images of each kind comes first. Peak RSS
(``resource.getrusage``) is read after each kind: the parent's growth over the
baseline (array allocated, warm-up done) shows that no full copy of the source is
held; the array itself is ``images.nbytes``. The largest child is the largest
worker process (or any earlier child of this process).

    python benchmarks/convert_sources.py [--samples 50000] [--workers 2] [--format shards]
        [--repeats 1] [--out benchmarks/results/convert_sources.json]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, write_json

import dlstore

SUFFIX = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}


class ArrayImages(torch.utils.data.Dataset):
    """(PIL image, label) per item from an (N, H, W, 3) uint8 array, like torchvision's CIFAR10."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images, self.labels = images, labels
        self.classes = [f"class_{c}" for c in range(int(labels.max()) + 1)]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[Image.Image, int]:
        return Image.fromarray(self.images[i], "RGB"), int(self.labels[i])


def peak_rss_mb() -> dict[str, float]:
    """Peak resident set size so far (Linux reports KiB): this process, and its largest child."""
    return {"self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def write_folder(images: np.ndarray, labels: np.ndarray, root: Path) -> None:
    for c in np.unique(labels):
        (root / f"class_{c}").mkdir(parents=True, exist_ok=True)
    for i, (img, label) in enumerate(zip(images, labels)):
        Image.fromarray(img, "RGB").save(root / f"class_{label}" / f"{i:06d}.png")


def stored(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sample of a store as one (N, C, H, W) tensor, and the labels."""
    ds = dlstore.open_dataset(path)
    batch, labels = ds.read_batch(list(range(len(ds))))
    # A store without a recorded fixed shape (dataset, folder sources) returns a list.
    return (torch.stack(batch) if isinstance(batch, list) else batch), labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=50_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--format", default="shards", choices=sorted(SUFFIX))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "convert_sources.json"))
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (args.samples, 32, 32, 3), dtype=np.uint8)
    labels = (np.arange(args.samples) % 10).astype(np.int64)
    suffix = SUFFIX[args.format]
    options = {"workers": args.workers, "progress": False, "overwrite": True}
    with tempfile.TemporaryDirectory() as tmp:
        # Warm-up: imports and first-call costs (torchvision, the codecs) are paid here, not by
        # whichever kind runs first, and are not counted as memory held by a conversion.
        warm = slice(0, min(256, args.samples))
        dlstore.convert((images[warm], labels[warm]), Path(tmp) / f"a{suffix}", **options)
        dlstore.convert(ArrayImages(images[warm], labels[warm]), Path(tmp) / f"d{suffix}", **options)
        write_folder(images[warm], labels[warm], Path(tmp) / "f")
        dlstore.convert(Path(tmp) / "f", Path(tmp) / f"f{suffix}", **options)
        stored(Path(tmp) / f"a{suffix}")
    rss = {"baseline": peak_rss_mb()}
    rates: dict[str, list[float]] = {"array": [], "dataset": [], "folder (convert)": [],
                                     "folder (write + convert)": [], "png write": []}

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        dst = {kind: tmp_path / f"{kind}{suffix}" for kind in ("array", "dataset", "folder")}
        for repeat in range(args.repeats):
            start = time.perf_counter()
            dlstore.convert((images, labels), dst["array"], **options)
            rates["array"].append(args.samples / (time.perf_counter() - start))
            rss["after array"] = peak_rss_mb()

            start = time.perf_counter()
            dlstore.convert(ArrayImages(images, labels), dst["dataset"], **options)
            rates["dataset"].append(args.samples / (time.perf_counter() - start))
            rss["after dataset"] = peak_rss_mb()

            folder = tmp_path / f"folder{repeat}"
            start = time.perf_counter()
            write_folder(images, labels, folder)
            written = time.perf_counter()
            dlstore.convert(folder, dst["folder"], **options)
            done = time.perf_counter()
            rates["png write"].append(args.samples / (written - start))
            rates["folder (convert)"].append(args.samples / (done - written))
            rates["folder (write + convert)"].append(args.samples / (done - start))
            rss["after folder"] = peak_rss_mb()

        # Bit-identity: array and dataset stores in source order; the folder store in
        # ImageFolder's order, mapped back to array indices by its provenance (file names).
        want = torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2)))
        checks, first, shapes = {}, {}, {}
        for kind, path in dst.items():
            batch, got_labels = stored(path)
            ds = dlstore.open_dataset(path)
            first[kind] = repr(ds.samples[0])
            shapes[kind] = None if ds.shape is None else list(ds.shape)
            if kind == "folder":
                order = [int(Path(str(p)).stem) for p, _ in ds.samples]
            else:
                order = list(range(args.samples))
            checks[kind] = bool(torch.equal(batch, want[order])
                                and np.array_equal(got_labels.numpy(), labels[order]))
            del batch
        sizes = {kind: sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir()
                 else path.stat().st_size for kind, path in dst.items()}

    median = {kind: statistics.median(r) for kind, r in rates.items()}
    base = median["folder (write + convert)"]
    store_of = {"array": "array", "dataset": "dataset", "folder (convert)": "folder",
                "folder (write + convert)": "folder"}
    print(f"{args.samples} images 32x32x3, format {args.format}, workers {args.workers}, "
          f"repeats {args.repeats}; input array {images.nbytes / 2**20:.1f} MiB")
    print(f"{'source kind':<26}{'images/s':>10}{'vs folder':>11}  {'bit-identical':<14}ds.samples[0]")
    for kind, store in store_of.items():
        print(f"{kind:<26}{median[kind]:>10.0f}{median[kind] / base:>10.2f}x  "
              f"{'yes' if checks[store] else 'NO':<14}{first[store]}")
    print(f"(PNG writing alone: {median['png write']:.0f} images/s; fixed shape recorded by each store: "
          + ", ".join(f"{kind} {shape}" for kind, shape in shapes.items()) + ")")
    print("peak RSS MiB (self / largest child): " + ", ".join(
        f"{stage} {v['self']:.0f} / {v['children']:.0f}" for stage, v in rss.items()))

    write_json(args.out, {
        "machine": machine_info(),
        "config": {"samples": args.samples, "shape": [32, 32, 3], "workers": args.workers,
                   "format": args.format, "repeats": args.repeats,
                   "dataset": "map-style Dataset returning (PIL image, label) from the array",
                   "input_array_mib": images.nbytes / 2**20},
        "rates": {kind: {"median": median[kind], "runs": r} for kind, r in rates.items()},
        "ratio_vs_folder_write_convert": {kind: median[kind] / base for kind in store_of},
        "bit_identical": checks,
        "samples0": first,
        "store_bytes": sizes,
        "store_shape": shapes,
        "peak_rss_mib": rss,
    })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
