"""Two dlstore trees read the same stores, interleaved: did a change move the read rates?

Issue 38 reshaped the loader (one ``Loader``, loader-owned batch memory, per-batch seeds)
without meaning to change its speed. This script measures the loader configurations whose
spelling is the same in 0.2 and 0.3 (the default back-end, worker processes through the ring,
the GPU-resident loader on the CPU) in both trees, in fresh processes, alternating the order
every round, so a change in the machine's load falls on both. For each configuration it prints
the median samples/s of each tree, the ratio of the medians and the median of the per-round
ratios (after / before, measured a few seconds apart), and writes JSON.

    python benchmarks/before_after.py --before /path/to/old/tree --after /path/to/new/tree \\
        [--images 600] [--rounds 5] [--seconds 2] [--out benchmarks/results/before_after.json]

The stores are written once, by the ``after`` tree (the store format did not change), into
``--workdir``, and read warm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import uptime, write_json  # noqa: E402

# One configuration: how the dataset is opened and how the loader is built, in code valid for both
# trees (0.2's dlstore.loader and 0.3's take these keywords alike).
CONFIGS = {
    "shards static, default loader": ("s.shards", "None", "dict()"),
    "shards crop+flip, default loader": ("s.shards", "CROP_FLIP", "dict()"),
    "lmdb crop+flip, default loader": ("s.lmdb", "CROP_FLIP", "dict()"),
    "hdf5 crop+flip, default loader": ("s.h5", "CROP_FLIP", "dict()"),
    "shards crop+flip, 2 workers (ring)": ("s.shards", "CROP_FLIP", "dict(num_workers=2, persistent_workers=True)"),
    "jpeg lmdb RandomResizedCrop, default loader": ("j.lmdb", "RRC", "dict()"),
    "shards crop+flip + normalise, device=cpu": ("s.shards", "FLOAT", "dict(device='cpu')"),
}

MEASURE = r"""
import json, sys, time, torch
from torchvision.transforms import v2
import dlstore
torch.set_num_threads(1)
CROP_FLIP = v2.Compose([v2.RandomCrop(224, padding=4), v2.RandomHorizontalFlip()])
RRC = v2.Compose([v2.RandomResizedCrop(224), v2.RandomHorizontalFlip()])
FLOAT = v2.Compose([*CROP_FLIP.transforms, v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.25] * 3)])
path, transform, options, seconds = sys.argv[1], eval(sys.argv[2]), eval(sys.argv[3]), float(sys.argv[4])
ds = dlstore.open_dataset(path, transform=transform)
loader = dlstore.loader(ds, 64, shuffle=True, **options)
for _ in loader:       # warm-up epoch: workers, kernels, page faults
    pass
n, start = 0, time.perf_counter()
while time.perf_counter() - start < seconds:
    for images, _ in loader:
        n += len(images)
print(json.dumps({"samples_per_s": n / (time.perf_counter() - start)}))
"""


def _run(tree: str, args: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", MEASURE, *args], env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.splitlines()[-1])["samples_per_s"]


def _stores(after: str, workdir: Path, images: int) -> None:
    code = (
        "import sys, dlstore; from dlstore.sources.demo import make_image_folder\n"
        "root = sys.argv[1]; n = int(sys.argv[2])\n"
        "src = make_image_folder(root + '/images', classes=5, per_class=n // 5, size=(375, 500))\n"
        "for name in ('s.shards', 's.lmdb', 's.h5'):\n"
        "    dlstore.convert(src, root + '/' + name, static='resize=256,center_crop=224', progress=False)\n"
        "dlstore.convert(src, root + '/j.lmdb', static='resize=256', encoding='jpeg', progress=False)\n")
    subprocess.run([sys.executable, "-c", code, str(workdir), str(images)], env=dict(os.environ, PYTHONPATH=after),
                   check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the old tree (its dlstore package)")
    parser.add_argument("--after", required=True, help="the new tree")
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--only", default="", help="keep the configurations whose name contains this")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "before_after.json"))
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dlstore-before-after-"))
    load = {"before": uptime()}
    print(f"load: {load['before']}", flush=True)
    if not (workdir / "j.lmdb").exists():
        _stores(args.after, workdir, args.images)
    configs = {k: v for k, v in CONFIGS.items() if args.only in k}
    trees = {"before": args.before, "after": args.after}
    rates: dict[str, dict[str, list[float]]] = {k: {"before": [], "after": []} for k in configs}
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for name, (store, transform, options) in configs.items():
            for side in order:
                rates[name][side].append(_run(trees[side], [str(workdir / store), transform, options,
                                                            str(args.seconds)]))
        print(f"round {r + 1}/{args.rounds} done ({uptime()})", flush=True)
    load["after"] = uptime()
    rows = {}
    print(f"\n{'configuration':48s} {'before':>10s} {'after':>10s} {'ratio':>7s} {'paired':>7s}")
    for name, got in rates.items():
        before, after = statistics.median(got["before"]), statistics.median(got["after"])
        paired = statistics.median(a / b for a, b in zip(got["after"], got["before"]))
        rows[name] = {"before": got["before"], "after": got["after"], "ratio_of_medians": after / before,
                      "paired_ratio": paired}
        print(f"{name:48s} {before:10,.0f} {after:10,.0f} {after / before:6.2f}x {paired:6.2f}x")
    print(f"\nload: {load['after']}")
    write_json(args.out, {"trees": trees, "images": args.images, "rounds": args.rounds, "seconds": args.seconds,
                          "load": load, "configurations": {k: list(v) for k, v in configs.items()}, "rows": rows,
                          "created": time.strftime("%Y-%m-%d %H:%M:%S")})


if __name__ == "__main__":
    main()
