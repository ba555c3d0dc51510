"""``dlstore demo``: make a small image folder, convert it, read it back against ImageFolder.

With ``--dir`` the demo writes only into a folder it made: DIR must be new, empty, or
one an earlier demo wrote (it records what it wrote in ``DIR/.dlstore-demo.json``:
every image's size and mtime, and the sha256 of the store's manifest). A folder of
the user's, under any of the names the demo uses, is refused, never written into or
converted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import click

from ..errors import ArgumentError, DlstoreError
from .common import fail, say

BATCH = 64
ROUNDS = 5


@click.command()
@click.option("--dir", "workdir", type=click.Path(file_okay=False), default=None,
              help="Where to write the demo folder and store, kept afterwards: a new or empty folder, or "
                   "one an earlier demo wrote (default: a temporary folder, removed at the end).")
@click.option("--images", type=click.IntRange(min=5), default=300, show_default=True, help="Number of demo images.")
@click.option("--workers", type=int, default=None, help="Decode processes (default: usable CPUs).")
def demo(workdir, images, workers):
    """Generate a small image folder, convert it, read it back, and compare with ImageFolder."""
    try:
        if workdir is None:
            with tempfile.TemporaryDirectory(prefix="dlstore-demo-") as tmp:
                store = _demo(DemoDir(Path(tmp)), images, workers)
            # the folder is gone: name a command that keeps one, not a path that no longer exists
            click.echo(f"next: dlstore demo --dir DIR keeps the images and the store (this run's {store.name} "
                       "was in a temporary folder, now removed); then dlstore info DIR/demo.shards")
        else:
            store = _demo(DemoDir.claim(Path(workdir)), images, workers)
            click.echo(f"next: dlstore info {store}")
    except KeyboardInterrupt:
        click.echo("interrupted: nothing half-written was kept", err=True)
        sys.exit(130)
    except (DlstoreError, ValueError, OSError) as exc:
        fail(exc)


class DemoDir:
    """The demo's work folder, and what an earlier demo recorded writing there (``RECORD``)."""

    RECORD = ".dlstore-demo.json"

    def __init__(self, root: Path, record: dict | None = None):
        self.root = root
        self.record = record if record is not None else {}
        self.images = root / "images"
        self.store = root / "demo.shards"

    @classmethod
    def claim(cls, root: Path) -> DemoDir:
        """``root`` if it is new, empty or an earlier demo's; ArgumentError naming what is the user's otherwise."""
        if not root.exists():
            root.mkdir(parents=True)
            return cls(root)
        try:
            record = json.loads((root / cls.RECORD).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            record = None
        if isinstance(record, dict):
            return cls(root, record)
        names = sorted(os.listdir(root))
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise ArgumentError(f"--dir {root}: holds {shown}, and no {cls.RECORD} of an earlier dlstore demo; "
                                "demo writes only into a folder it made: give a new or empty folder")
        return cls(root)

    def _refuse(self, path: Path, why: str) -> ArgumentError:
        return ArgumentError(f"{path}: {why}; demo never writes into or converts what it did not write: give "
                             f"another --dir, or move {path} away")

    def images_kept(self, classes: int, per_class: int) -> bool:
        """True if ``images/`` holds an earlier demo's images of this size, unchanged; False if absent or
        an earlier demo's others (removed here); ArgumentError if it is not an earlier demo's."""
        if not os.path.lexists(self.images):
            return False
        recorded = self.record.get("images")
        if not self.images.is_dir() or self.images.is_symlink() or recorded != _listing(self.images):
            raise self._refuse(self.images, "not the image folder an earlier dlstore demo wrote here"
                               if recorded else "exists, and dlstore demo did not write it")
        if set(recorded) == _demo_names(classes, per_class):
            return True
        shutil.rmtree(self.images)
        return False

    def write_images(self, classes: int, per_class: int) -> None:
        """Write the demo images to ``images/`` (absent), aside first and renamed: whole and recorded, or absent."""
        from ..sources.demo import make_image_folder

        staging = Path(tempfile.mkdtemp(prefix=".dlstore-demo-images-", dir=self.root))
        try:
            make_image_folder(staging, classes=classes, per_class=per_class)
            self.record["images"] = _listing(staging)
            self.save()
            staging.rename(self.images)
        finally:
            if staging.exists():
                shutil.rmtree(staging)

    def check_store(self) -> bool:
        """True if ``demo.shards`` is the store an earlier demo wrote (to be replaced), False if absent."""
        if not os.path.lexists(self.store):
            return False
        if self.record.get("store") is None or self.record["store"] != _manifest_digest(self.store):
            raise self._refuse(self.store, "exists, and dlstore demo did not write it (or it changed since)")
        return True

    def store_written(self) -> None:
        self.record["store"] = _manifest_digest(self.store)
        self.save()

    def save(self) -> None:
        tmp = self.root / (self.RECORD + ".tmp")
        tmp.write_text(json.dumps(self.record, sort_keys=True), encoding="utf-8")
        os.replace(tmp, self.root / self.RECORD)


def _demo_names(classes: int, per_class: int) -> set[str]:
    """The entries of the demo's image folder, as ``_listing`` names them."""
    return {f"class_{c:02d}/" for c in range(classes)} | \
        {f"class_{c:02d}/img_{i:04d}.jpg" for c in range(classes) for i in range(per_class)}


def _listing(folder: Path) -> dict[str, list[int]]:
    """Every entry under ``folder`` (links not followed): ``"rel/path": [size, mtime_ns]`` for a file
    or link, ``"rel/folder/": []`` for a folder (an empty one is a class to ImageFolder)."""
    out: dict[str, list[int]] = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(folder).as_posix()
            if path.is_dir() and not path.is_symlink():
                out[rel + "/"] = []
            else:
                st = path.lstat()
                out[rel] = [st.st_size, st.st_mtime_ns]
    return out


def _manifest_digest(store: Path) -> str | None:
    try:
        return hashlib.sha256((store / "manifest.json").read_bytes()).hexdigest()
    except OSError:
        return None


def _demo(workdir: DemoDir, images: int, workers: int | None) -> Path:
    import torch
    from torch.utils.data import DataLoader
    from torchvision import datasets
    from torchvision.transforms import v2

    from ..conversion import convert as run_convert
    from ..data import loader, open_dataset
    from ..tools.epochs import load_note, time_epochs

    classes = 5
    per_class = max(1, images // classes)
    folder, store = workdir.images, workdir.store
    static = "resize=144,center_crop=128"
    replace = workdir.check_store()
    if workdir.images_kept(classes, per_class):
        click.echo(f"1. keeping the {classes * per_class} synthetic JPEGs in {folder} (an earlier dlstore demo "
                   "wrote them; unchanged since)")
    else:
        click.echo(f"1. writing {classes * per_class} synthetic 500x375 JPEGs in {classes} classes to {folder}")
        t0 = time.perf_counter()
        workdir.write_images(classes, per_class)
        click.echo(f"   done in {time.perf_counter() - t0:.1f} s")

    click.echo(f"2. dlstore convert {folder} {store} --static {static}")
    result = run_convert(folder, store, static=static, workers=workers, overwrite=replace, log=say)
    workdir.store_written()
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
