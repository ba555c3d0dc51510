"""``dlstore demo``: make a small image folder, convert it, read it back against ImageFolder."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import click

from .common import say

BATCH = 64
ROUNDS = 5


@click.command()
@click.option("--dir", "workdir", type=click.Path(file_okay=False), default=None,
              help="Where to write the demo folder and store, kept afterwards (default: a temporary "
                   "folder, removed at the end).")
@click.option("--images", type=click.IntRange(min=5), default=300, show_default=True, help="Number of demo images.")
@click.option("--workers", type=int, default=None, help="Decode processes (default: usable CPUs).")
def demo(workdir, images, workers):
    """Generate a small image folder, convert it, read it back, and compare with ImageFolder."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="dlstore-demo-") as tmp:
            store = _demo(Path(tmp), images, workers)
        # the folder is gone: name a command that keeps one, not a path that no longer exists
        click.echo(f"next: dlstore demo --dir DIR keeps the images and the store (this run's {store.name} "
                   "was in a temporary folder, now removed); then dlstore info DIR/demo.shards")
    else:
        store = _demo(Path(workdir), images, workers)
        click.echo(f"next: dlstore info {store}")


def _demo(workdir: Path, images: int, workers: int | None) -> Path:
    import torch
    from torch.utils.data import DataLoader
    from torchvision import datasets
    from torchvision.transforms import v2

    from ..conversion import convert as run_convert
    from ..data import loader, open_dataset
    from ..sources.demo import make_image_folder
    from ..tools.epochs import load_note, time_epochs

    classes = 5
    per_class = max(1, images // classes)
    folder = workdir / "images"
    store = workdir / "demo.shards"
    static = "resize=144,center_crop=128"
    click.echo(f"1. writing {classes * per_class} synthetic 500x375 JPEGs in {classes} classes to {folder}")
    t0 = time.perf_counter()
    make_image_folder(folder, classes=classes, per_class=per_class)
    click.echo(f"   done in {time.perf_counter() - t0:.1f} s")

    click.echo(f"2. dlstore convert {folder} {store} --static {static}")
    result = run_convert(folder, store, static=static, workers=workers, overwrite=True, log=say)
    click.echo("   " + str(result).replace("\n", "\n   "))

    ds = open_dataset(store)
    reference = datasets.ImageFolder(str(folder), transform=v2.Compose(
        [v2.Resize(144), v2.CenterCrop(128), v2.PILToTensor()]))
    same = all(torch.equal(ds[i][0], reference[i][0]) and ds[i][1] == reference[i][1]
               for i in (0, len(ds) // 2, len(ds) - 1))
    loaders = {"torchvision ImageFolder + same transforms": DataLoader(reference, batch_size=BATCH, shuffle=True),
               "dlstore.loader over the store": loader(ds, BATCH, shuffle=True)}
    click.echo(f"3. reading epochs (batch {BATCH}, shuffled, in this process: no worker processes): the first "
               f"alone, then {ROUNDS} interleaved rounds")
    before = load_note()
    rates = time_epochs(loaders, rounds=ROUNDS)
    note = load_note() or before
    click.echo(f"   {'':42s} {'first epoch':>12s} {'median':>10s} {'range':>19s}  samples/s")
    for name, r in rates.items():
        low, high = r.spread
        click.echo(f"   {name:42s} {r.first:>12,.0f} {r.median:>10,.0f} {f'{low:,.0f}-{high:,.0f}':>19s}")
    base, ours = rates.values()
    click.echo(f"   speed-up: {ours.median / base.median:,.0f}x (medians; first epochs: "
               f"{ours.first / base.first:,.0f}x, which pays imports, opening and first page faults)")
    if note:
        click.echo(f"   note: {note}")
    click.echo(f"   pixels and labels identical to ImageFolder on checked samples: {'yes' if same else 'NO'}")
    if not same:
        sys.exit(1)
    return store
