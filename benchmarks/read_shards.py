"""Read throughput: torchvision ImageFolder vs the dlstore shards Dataset, same static transforms.

Generates a folder of ImageNet-sized JPEGs (500x375), converts it with
``resize=256,center_crop=224``, then reads both through a DataLoader (batch 64,
random order, num_workers=0) in the same process and prints samples/s and the
ratio. Target (issue 2): shards >= 100x ImageFolder.

    python benchmarks/read_shards.py [--images 300] [--out benchmarks/results/read_shards.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.transforms import v2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, repeat, write_json  # noqa: E402

import dlstore  # noqa: E402
from dlstore.sources.demo import make_image_folder  # noqa: E402


def epoch(dataset) -> int:
    loader = DataLoader(dataset, batch_size=64, shuffle=True, num_workers=0)
    return sum(len(y) for _, y in loader)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "read_shards.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="dlstore-bench-") as tmp:
        folder = make_image_folder(Path(tmp) / "images", classes=10, per_class=args.images // 10)
        t0 = time.perf_counter()
        result = dlstore.convert(folder, Path(tmp) / "s.shards", static="resize=256,center_crop=224",
                                 progress=False)
        convert_s = time.perf_counter() - t0
        reference = datasets.ImageFolder(str(folder), transform=v2.Compose(
            [v2.Resize(256), v2.CenterCrop(224), v2.PILToTensor()]))
        shards = dlstore.open_dataset(Path(tmp) / "s.shards")
        base = repeat(lambda: epoch(reference), repeats=max(2, args.repeats // 2), warmup=0)
        fast = repeat(lambda: epoch(shards), repeats=args.repeats, warmup=1)

    ratio = fast["median"] / base["median"]
    print(f"{'loader (batch 64, shuffled, workers 0)':42s} {'samples/s':>12s} {'min':>10s} {'max':>10s}")
    for name, r in (("torchvision ImageFolder + same transforms", base), ("dlstore shards", fast)):
        print(f"{name:42s} {r['median']:12,.0f} {r['min']:10,.0f} {r['max']:10,.0f}")
    print(f"ratio shards / ImageFolder: {ratio:,.1f}x (target >= 100x: {'met' if ratio >= 100 else 'NOT met'})")
    print(f"conversion: {result.count} images in {convert_s:.1f} s ({result.count / convert_s:,.0f}/s, "
          f"{result.workers} workers)")
    path = write_json(args.out, {
        "benchmark": "read_shards", "machine": machine_info(),
        "data": {"images": result.count, "source_size": [375, 500], "static": "resize=256,center_crop=224",
                 "sample_bytes": 3 * 224 * 224},
        "imagefolder": base, "shards": fast, "ratio": ratio, "convert_seconds": convert_s,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
