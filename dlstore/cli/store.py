"""Commands on one store: convert, info, show, verify."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from .. import formats
from ..errors import DlstoreError
from .common import fail, say, sigterm_as_interrupt


@click.command()
@click.argument("src", type=click.Path(exists=True))
@click.argument("dst", type=click.Path())
@click.option("--root", type=click.Path(exists=True, file_okay=False), default=None,
              help="For a list file SRC: the folder its paths are relative to (default: the list's folder).")
@click.option("--format", "fmt", type=click.Choice(formats.names()), default=None,
              help="Store format (default: from DST's suffix: .shards, .lmdb, .h5).")
@click.option("--static", "static", default="", show_default=False,
              help='Static transforms run once per image, e.g. "resize=256,center_crop=224" or "resize_max=512".')
@click.option("--workers", type=int, default=None, help="Decode processes (default: usable CPUs).")
@click.option("--overwrite", is_flag=True,
              help="Replace an existing store at DST: only a store dlstore wrote, holding exactly what dlstore "
                   "wrote (never a folder, file, dataset, attribute or key of yours).")
@click.option("--overwrite-damaged", is_flag=True,
              help="As --overwrite, and also replace a store of ours that differs from its seal (damaged) "
                   "with nothing dlstore can name as added.")
@click.option("--on-error", type=click.Choice(["fail", "skip"]), default="fail", show_default=True,
              help="What to do with a file that cannot be decoded.")
@click.option("--shard-size", type=str, default="1GiB", show_default=True,
              help="Target size of each data file (shards format), e.g. 256MiB.")
@click.option("--resume", is_flag=True,
              help="Continue an interrupted conversion to DST from its last completed unit, once the source "
                   "files it already converted are checked unchanged (size, mtime, content hash).")
@click.option("--exif-transpose", is_flag=True,
              help="Apply EXIF orientation when decoding (torchvision does not; off by default).")
@click.option("--max-pixels", type=click.IntRange(min=1), default=None,
              help="Refuse images with more pixels (default: PIL's decompression-bomb limit, ~89.5M).")
@click.option("--compression", type=click.Choice(["none", "lzf", "gzip"]), default="none", show_default=True,
              help="Per-sample compression of an hdf5 store (lzf: fast; gzip: smaller, readable everywhere).")
@click.option("--encoding", type=click.Choice(["raw", "jpeg", "png"]), default="raw", show_default=True,
              help="Store samples as uint8 arrays (raw) or re-encoded after the static transforms.")
@click.option("--quality", type=click.IntRange(1, 100), default=90, show_default=True,
              help="JPEG quality with --encoding jpeg.")
@click.option("--mode", type=click.Choice(["RGB", "L"]), default=None,
              help="Convert every image to this PIL mode (default: a folder is RGB; a list keeps its files' "
                   "one mode, RGB when grayscale and colour mix).")
@click.option("--class-order", type=click.Choice(["imagefolder", "natural"]), default="imagefolder",
              show_default=True,
              help="Order of a folder's classes, which fixes the labels: imagefolder (sorted names, as torchvision: "
                   "c1, c10, c2) or natural (as timm: c1, c2, c10, case ignored).")
@click.option("--masks", type=click.Path(exists=True, file_okay=False), default=None,
              help="A folder of segmentation masks paired with the image folder SRC by relative path and stem "
                   "(images/a/x.jpg <-> masks/a/x.png): each sample an image and its mask, transformed together.")
@click.option("--mask-dtype", type=click.Choice(["uint8", "uint16"]), default="uint8", show_default=True,
              help="How masks are stored: uint16 for classes above 255.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def convert(src, dst, root, fmt, static, workers, overwrite, overwrite_damaged, on_error, shard_size, resume,
            exif_transpose, max_pixels, compression, encoding, quality, mode, class_order, masks, mask_dtype, quiet):
    """Convert SRC into store DST.

    SRC is an image folder (ImageFolder layout) or a CSV / JSON-lines list of
    path,label rows (paths relative to --root), or image,mask rows; with --masks,
    a folder of images whose masks lie in the --masks folder.
    """
    from ..conversion import convert as run_convert
    from ..sources.decode import DEFAULT_MAX_PIXELS

    sigterm_as_interrupt()
    from ..conversion.distributed import env_world_size, init_from_env

    # Under torchrun (WORLD_SIZE > 1) every rank runs this command: join a gloo group, convert a part each.
    rank = int(os.environ.get("RANK", "0")) if env_world_size() > 1 else 0
    try:
        started_group = init_from_env()
    except (RuntimeError, ValueError) as exc:
        fail(RuntimeError(f"cannot join the torchrun process group ({exc})"))
    options = {}
    if compression != "none":
        name = fmt or formats.SUFFIXES.get(Path(dst).suffix.lower())
        if name is None or compression not in formats.get_format(name).compressions:
            fail(ValueError(f"--compression {compression} applies to hdf5 stores only; "
                             f"use a .h5 DST or --format hdf5, or leave --compression out"))
        options["compression"] = compression
    try:
        result = run_convert(src, dst, store_format=fmt, static=static, workers=workers,
                             overwrite="damaged" if overwrite_damaged else overwrite,
                             on_error=on_error, shard_size=shard_size, resume=resume, **options,
                             exif_transpose=exif_transpose, max_pixels=max_pixels or DEFAULT_MAX_PIXELS,
                             encoding=encoding, quality=quality, root=root, mode=mode, class_order=class_order,
                             masks=masks, mask_dtype=mask_dtype, distributed=env_world_size() > 1,
                             progress=not quiet, log=say)
    except KeyboardInterrupt:
        click.echo(f"interrupted: stopped the workers; {dst} was not written", err=True)
        sys.exit(130)
    except (DlstoreError, ValueError, OSError) as exc:
        if env_world_size() > 1:
            say(f"error: [rank {rank}] {exc}")
            sys.exit(2)
        fail(exc)
    finally:
        if started_group:
            _leave_group()
    if rank == 0:
        click.echo(str(result))


def _leave_group() -> None:
    """Leave the process group together, then destroy it. The rendezvous store lives in rank 0's
    process: a rank still tearing its gloo group down when rank 0 exits aborts ("terminate called
    without an active exception", SIGABRT, seen in CI). The ranks normally arrive together (the
    conversion ends with a collective exchange). Rank 0 waits at most 30 s for a missing rank; the
    others wait for rank 0 and leave at once if it died. A second Ctrl-C skips the wait."""
    import datetime

    import torch.distributed as dist

    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    except (RuntimeError, KeyboardInterrupt):
        pass
    dist.destroy_process_group()


@click.command()
@click.argument("store", type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest and a summary as one JSON object.")
def info(store, as_json):
    """Describe STORE: samples, classes, shape, static transforms, size, skipped files."""
    from ..conversion.job import disk_usage
    from ..data import open_dataset
    from ..transforms.static import describe
    from ..units import human_bytes

    try:
        ds = open_dataset(store)
    except (DlstoreError, ValueError, OSError) as exc:
        fail(exc)
    m = ds.manifest
    size = disk_usage(Path(store))
    virtual = m["layout"].get("virtual") if formats.get_format(m["format"]).keeps_parts else None
    if virtual and (Path(store).parent / virtual["folder"]).is_dir():  # per-rank files of a torchrun conversion
        size += disk_usage(Path(store).parent / virtual["folder"])
    raw = getattr(ds.reader, "raw", ds.reader)   # (an encoded store's records: what its reader reads)
    layout = raw.sample_layout()
    gatherable = layout.read_path == "in place" and raw.shape is not None
    if as_json:
        import json

        import numpy as np

        counts = np.bincount(np.asarray(ds.reader.labels, dtype=np.int64) + 1, minlength=len(ds.classes) + 1)
        summary = {"store": str(store), "format": m["format"], "samples": m["count"], "bytes": size,
                   "shape": list(ds.shape) if ds.shape else None, "static": describe(m["static"]),
                   "classes": len(ds.classes), "per_class": {name: int(counts[i + 1])
                                                             for i, name in enumerate(ds.classes)},
                   "class_order": m.get("class_order"), "skipped": len(m["source"].get("skipped", [])),
                   "provenance": (m["layout"].get("provenance") or {}).get("kind"),
                   "targets": m.get("targets"), "masks": (m.get("fields") or {}).get("mask"),
                   "read_path": layout.read_path,
                   "read_path_reason": layout.reason, "gatherable": gatherable, "in_order": layout.in_order}
        click.echo(json.dumps({"summary": summary, "manifest": m}, indent=1, sort_keys=True, ensure_ascii=False))
        return
    shape = "x".join(map(str, ds.shape)) if ds.shape else "variable (per-sample shapes)"
    source = m["source"]
    click.echo(f"store     {store}")
    click.echo(f"format    {m['format']} (layout version {m['format_version']})")
    click.echo(f"samples   {m['count']}")
    if ds.classes:
        counts = {}
        for t in ds.targets:
            counts[t] = counts.get(t, 0) + 1
        shown = ", ".join(f"{name} ({counts.get(i, 0)})" for i, name in enumerate(ds.classes[:10]))
        more = f", ... {len(ds.classes) - 10} more" if len(ds.classes) > 10 else ""
        click.echo(f"classes   {len(ds.classes)}: {shown}{more}")
        click.echo(f"order     {_class_order(m)}")
    elif "targets" in m:
        click.echo(f"targets   {m['count']} x {m['targets']['shape'][0]} {m['targets']['dtype']} "
                   "(a target vector per sample, no classes)")
    elif ds.fields is not None:
        fields = ds.fields
        click.echo(f"masks     {fields.mask_dtype}, one per image (a segmentation store: its records hold the "
                   f"image's {fields.channels} channel(s), then the mask's {fields.planes} plane(s))")
    else:
        click.echo("classes   none (unlabelled, label -1)")
    encoding = m["sample"]["encoding"]
    if m["sample"].get("quality"):
        encoding += f" (quality {m['sample']['quality']})"
    record = "" if ds.fields is None else f" (records {'x'.join(map(str, ds.record_shape or []))} with the mask)" \
        if ds.record_shape else ""
    click.echo(f"sample    {shape} {m['sample']['dtype']} {m['sample']['layout']}, encoding {encoding}{record}")
    click.echo(f"static    {describe(m['static'])}")
    order = {True: "in index order", False: "not in index order (consecutive samples lie apart in the file: "
             "block shuffle reads them as random reads)", None: "order unknown"}[layout.in_order]
    kept = "gatherable (each sample one uncompressed run of bytes at a known offset)" if gatherable else (
        "not gatherable" + (" (samples of varying size)" if raw.shape is None else ""))
    click.echo(f"layout    {kept}, {order}")
    click.echo(f"reads     {layout.read_path}: {layout.reason}")
    click.echo(f"size      {human_bytes(size)} ({size / max(m['count'], 1):,.0f} B/sample)")
    unit = "files" if source.get("kind", "folder") in ("folder", "list", "folder pairs", "pair list") else "items"
    click.echo(f"source    {source.get('root')} ({source.get('files')} {unit}, {source.get('kind', 'folder')})")
    skipped = source.get("skipped", [])
    click.echo(f"skipped   {len(skipped)}")
    for entry in skipped[:20]:
        name = entry["path"] if "path" in entry else f"item {entry.get('index')}"
        click.echo(f"  {name}: {entry.get('reason')}")


def _class_order(manifest: dict) -> str:
    """The info line of a store's class order."""
    from ..sources.class_order import DESCRIPTIONS

    order = manifest.get("class_order")
    if order is None:
        return "not recorded (converted by an older dlstore, or not from a folder)"
    return f"{order} ({DESCRIPTIONS.get(order, 'a rule this dlstore does not know')})"


@click.command(context_settings={"ignore_unknown_options": True})   # INDEX may be negative: -1
@click.argument("store", type=click.Path(exists=True))
@click.argument("index", type=int)
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Write the sample (as stored: after the static transforms) to this image file (.png, ...).")
def show(store, index, out):
    """Print sample INDEX of STORE: its label, class and where it came from; --out writes it as an image."""
    import numpy as np
    from PIL import Image

    from ..data import open_dataset

    try:
        ds = open_dataset(store)
        sample = ds.read(index)
    except (DlstoreError, ValueError, OSError, IndexError) as exc:
        fail(exc)
    index %= len(ds)   # in range (read checked it); a negative index counts from the end
    mask = None
    click.echo(f"sample    {index} of {len(ds)}")
    if ds.fields is not None:
        sample, mask = sample
        values, counts = np.unique(mask.numpy(), return_counts=True)
        shown = ", ".join(f"{v} ({100 * c / mask.numel():.0f}%)" for v, c in zip(values[:12], counts[:12]))
        click.echo(f"mask      classes {shown}{', ...' if len(values) > 12 else ''}")
    else:
        label = ds.targets[index]
        if isinstance(label, np.ndarray):   # a target vector
            label = label.tolist()
        name = f" ({ds.classes[label]})" if isinstance(label, int) and 0 <= label < len(ds.classes) else ""
        click.echo(f"label     {label}{name}")
    click.echo(f"shape     {'x'.join(map(str, sample.shape))} uint8 CHW")
    try:
        origin = ds.samples[index][0]
    except DlstoreError:
        origin = None
    if origin is not None:
        where = origin if ds.origins.kind == "path" else f"item {origin} of {ds.manifest['source'].get('root')}"
        click.echo(f"source    {where}")
    if out is not None:
        array = sample.numpy()
        image = Image.fromarray(array[0] if array.shape[0] == 1 else array.transpose(1, 2, 0))
        if mask is not None:
            image = _overlay(image, mask.numpy())
        try:
            image.save(out)
        except (OSError, ValueError) as exc:
            fail(exc)
        click.echo(f"wrote     {out}")


def _overlay(image, mask):
    """``image`` with ``mask``'s classes drawn over it, half opaque (class 0 and 255, background and
    ignore by convention, left clear); a class's colour as the PASCAL VOC palette gives it."""
    import numpy as np
    from PIL import Image

    classes = mask.astype(np.int64)
    colour = np.zeros((*classes.shape, 3), dtype=np.int64)
    for bit in range(8):   # VOC's palette: the class's bits spread over the channels' high bits
        for channel in range(3):
            colour[..., channel] |= ((classes >> (3 * bit + channel)) & 1) << (7 - bit)
    base = np.asarray(image.convert("RGB"), dtype=np.int64)
    drawn = (classes != 0) & (classes != 255)
    base[drawn] = (base[drawn] + colour[drawn]) // 2
    return Image.fromarray(base.astype(np.uint8))


@click.command()
@click.argument("store", type=click.Path(exists=True))
@click.option("--deep", is_flag=True, help="Also re-read every sample and check its shape.")
def verify(store, deep):
    """Check STORE's manifest and data checksums; exit 1 if anything is wrong."""
    from ..tools.verification import verify

    report = verify(store, deep=deep)
    click.echo(str(report))
    if not report.ok:
        sys.exit(1)
