"""The ``dlstore`` command line. The CLI prints; the library returns."""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import click

from . import formats
from .errors import DlstoreError


# The library names an option both ways, ``keyword=value (--flag value)`` or ``--flag
# (keyword=value)``; on the command line only the flag means anything.
_BOTH_WAYS = re.compile(r'\b\w+=(?:"[^"]*"|[^\s()]+) \((--[\w-]+(?: [^()\s]+)?)\)|(--[\w-]+) \(\w+=[^()]*\)')


def _as_flags(text: str) -> str:
    return _BOTH_WAYS.sub(lambda m: m.group(1) or m.group(2), text)


def _say(message: str) -> None:
    click.echo(_as_flags(message), err=True)


def _fail(exc: BaseException) -> None:
    _say(f"error: {exc}")
    sys.exit(2)


def _sigterm_as_interrupt() -> None:
    """Let SIGTERM unwind like Ctrl-C, so cleanup code runs and nothing half-written stays."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def _renamed(new: str, meaning: str):
    """A hidden old option that fails naming its new name (``--workers`` means decode processes only)."""
    def refuse(ctx: click.Context, param: click.Parameter, value: object) -> None:
        if value is not None:
            raise click.UsageError(f"--workers is the decode processes of convert and demo; {meaning} is "
                                   f"{new} here", ctx=ctx)
    return click.option("--workers", "old_workers", hidden=True, expose_value=False, default=None,
                        callback=refuse)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dlstore")
def main() -> None:
    """dlstore: precomputed image stores and fast loaders for PyTorch training."""


@main.command()
@click.argument("src", type=click.Path(exists=True))
@click.argument("dst", type=click.Path())
@click.option("--root", type=click.Path(exists=True, file_okay=False), default=None,
              help="For a list file SRC: the folder its paths are relative to (default: the list's folder).")
@click.option("--format", "fmt", type=click.Choice(formats.names()), default=None,
              help="Store format (default: from DST's suffix: .shards, .lmdb, .h5).")
@click.option("--static", "static", default="", show_default=False,
              help='Static transforms run once per image, e.g. "resize=256,center_crop=224" or "resize_max=512".')
@click.option("--workers", type=int, default=None, help="Decode processes (default: usable CPUs).")
@click.option("--overwrite", is_flag=True, help="Replace an existing store at DST.")
@click.option("--on-error", type=click.Choice(["fail", "skip"]), default="fail", show_default=True,
              help="What to do with a file that cannot be decoded.")
@click.option("--shard-size", type=str, default="1GiB", show_default=True,
              help="Target size of each data file (shards format), e.g. 256MiB.")
@click.option("--resume", is_flag=True,
              help="Continue an interrupted conversion to DST from its last completed data file.")
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
@click.option("--quiet", is_flag=True, help="No progress bar.")
def convert(src, dst, root, fmt, static, workers, overwrite, on_error, shard_size, resume, exif_transpose,
            max_pixels, compression, encoding, quality, mode, quiet):
    """Convert SRC into store DST.

    SRC is an image folder (ImageFolder layout) or a CSV / JSON-lines list of
    path,label rows (paths relative to --root).
    """
    from .conversion import convert as run_convert
    from .sources.decode import DEFAULT_MAX_PIXELS

    _sigterm_as_interrupt()
    from .conversion.distributed import env_world_size, init_from_env

    # Under torchrun (WORLD_SIZE > 1) every rank runs this command: join a gloo group, convert a part each.
    rank = int(os.environ.get("RANK", "0")) if env_world_size() > 1 else 0
    try:
        started_group = init_from_env()
    except (RuntimeError, ValueError) as exc:
        _fail(RuntimeError(f"cannot join the torchrun process group ({exc})"))
    options = {}
    if compression != "none":
        if (fmt or formats.SUFFIXES.get(Path(dst).suffix.lower())) != "hdf5":
            _fail(ValueError(f"--compression {compression} applies to hdf5 stores only; "
                             f"use a .h5 DST or --format hdf5, or leave --compression out"))
        options["compression"] = compression
    try:
        result = run_convert(src, dst, store_format=fmt, static=static, workers=workers, overwrite=overwrite,
                             on_error=on_error, shard_size=parse_bytes(shard_size), resume=resume, **options,
                             exif_transpose=exif_transpose, max_pixels=max_pixels or DEFAULT_MAX_PIXELS,
                             encoding=encoding, quality=quality, root=root, mode=mode,
                             distributed=env_world_size() > 1,
                             progress=not quiet, log=_say)
    except KeyboardInterrupt:
        click.echo(f"interrupted: stopped the workers; {dst} was not written", err=True)
        sys.exit(130)
    except (DlstoreError, ValueError, OSError) as exc:
        if env_world_size() > 1:
            _say(f"error: [rank {rank}] {exc}")
            sys.exit(2)
        _fail(exc)
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


def parse_bytes(text: str) -> int:
    """``"1GiB"``, ``"256MB"``, ``"1000"`` -> bytes."""
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
             "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
             "tb": 1000**4, "tib": 1024**4}
    stripped = text.strip().lower()
    number = stripped.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = stripped[len(number):].strip()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise click.BadParameter(f"{text!r} is not a size (examples: 1GiB, 256MiB, 5000000)") from None
    if value < 1:
        raise click.BadParameter(f"{text!r}: size must be positive")
    return int(value)


@main.command()
@click.argument("store", type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest and a summary as one JSON object.")
def info(store, as_json):
    """Describe STORE: samples, classes, shape, static transforms, size, skipped files."""
    from .conversion.job import disk_usage
    from .data import open_dataset
    from .transforms.static import describe
    from .units import human_bytes

    try:
        ds = open_dataset(store)
    except (DlstoreError, ValueError, OSError) as exc:
        _fail(exc)
    m = ds.manifest
    size = disk_usage(Path(store))
    virtual = m["layout"].get("virtual") if m["format"] == "hdf5" else None
    if virtual and (Path(store).parent / virtual["folder"]).is_dir():  # per-rank files of a torchrun conversion
        size += disk_usage(Path(store).parent / virtual["folder"])
    if as_json:
        import json

        import numpy as np

        counts = np.bincount(np.asarray(ds.reader.labels, dtype=np.int64) + 1, minlength=len(ds.classes) + 1)
        summary = {"store": str(store), "format": m["format"], "samples": m["count"], "bytes": size,
                   "shape": list(ds.shape) if ds.shape else None, "static": describe(m["static"]),
                   "classes": len(ds.classes), "per_class": {name: int(counts[i + 1])
                                                             for i, name in enumerate(ds.classes)},
                   "skipped": len(m["source"].get("skipped", [])),
                   "provenance": (m["layout"].get("provenance") or {}).get("kind"),
                   "targets": m.get("targets")}
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
    elif "targets" in m:
        click.echo(f"targets   {m['count']} x {m['targets']['shape'][0]} {m['targets']['dtype']} "
                   "(a target vector per sample, no classes)")
    else:
        click.echo("classes   none (unlabelled, label -1)")
    encoding = m["sample"]["encoding"]
    if m["sample"].get("quality"):
        encoding += f" (quality {m['sample']['quality']})"
    click.echo(f"sample    {shape} {m['sample']['dtype']} {m['sample']['layout']}, encoding {encoding}")
    click.echo(f"static    {describe(m['static'])}")
    click.echo(f"size      {human_bytes(size)} ({size / max(m['count'], 1):,.0f} B/sample)")
    unit = "files" if source.get("kind", "folder") in ("folder", "list") else "items"
    click.echo(f"source    {source.get('root')} ({source.get('files')} {unit}, {source.get('kind', 'folder')})")
    skipped = source.get("skipped", [])
    click.echo(f"skipped   {len(skipped)}")
    for entry in skipped[:20]:
        name = entry["path"] if "path" in entry else f"item {entry.get('index')}"
        click.echo(f"  {name}: {entry.get('reason')}")


@main.command(context_settings={"ignore_unknown_options": True})   # INDEX may be negative: -1
@click.argument("store", type=click.Path(exists=True))
@click.argument("index", type=int)
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Write the sample (as stored: after the static transforms) to this image file (.png, ...).")
def show(store, index, out):
    """Print sample INDEX of STORE: its label, class and where it came from; --out writes it as an image."""
    import numpy as np
    from PIL import Image

    from .data import open_dataset

    try:
        ds = open_dataset(store)
        sample = ds.read(index)
    except (DlstoreError, ValueError, OSError, IndexError) as exc:
        _fail(exc)
    index %= len(ds)   # in range (read checked it); a negative index counts from the end
    label = ds.targets[index]
    if isinstance(label, np.ndarray):   # a target vector
        label = label.tolist()
    name = f" ({ds.classes[label]})" if isinstance(label, int) and 0 <= label < len(ds.classes) else ""
    click.echo(f"sample    {index} of {len(ds)}")
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
        try:
            image.save(out)
        except (OSError, ValueError) as exc:
            _fail(exc)
        click.echo(f"wrote     {out}")


@main.command()
@click.argument("store", type=click.Path(exists=True))
@click.option("--deep", is_flag=True, help="Also re-read every sample and check its shape.")
def verify(store, deep):
    """Check STORE's manifest and data checksums; exit 1 if anything is wrong."""
    from .tools.verification import verify

    report = verify(store, deep=deep)
    click.echo(str(report))
    if not report.ok:
        sys.exit(1)


@main.command()
@click.option("--dir", "workdir", type=click.Path(file_okay=False), default=None,
              help="Where to write the demo folder and store (default: a temporary folder).")
@click.option("--images", type=int, default=300, show_default=True, help="Number of demo images.")
@click.option("--workers", type=int, default=None, help="Decode processes (default: usable CPUs).")
def demo(workdir, images, workers):
    """Generate a small image folder, convert it, read it back, and compare with ImageFolder."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="dlstore-demo-") as tmp:
            _demo(Path(tmp), images, workers)
    else:
        _demo(Path(workdir), images, workers)


def _demo(workdir: Path, images: int, workers: int | None) -> None:
    import torch
    from torch.utils.data import DataLoader
    from torchvision import datasets
    from torchvision.transforms import v2

    from .conversion import convert as run_convert
    from .data import open_dataset
    from .sources.demo import make_image_folder

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
    result = run_convert(folder, store, static=static, workers=workers, overwrite=True,
                         log=_say)
    click.echo("   " + str(result).replace("\n", "\n   "))

    click.echo("3. reading one epoch (batch 64, shuffled) through a DataLoader")
    ds = open_dataset(store)
    reference = datasets.ImageFolder(str(folder), transform=v2.Compose(
        [v2.Resize(144), v2.CenterCrop(128), v2.PILToTensor()]))
    same = all(torch.equal(ds[i][0], reference[i][0]) and ds[i][1] == reference[i][1]
               for i in (0, len(ds) // 2, len(ds) - 1))
    rates = {}
    for name, dataset in (("torchvision ImageFolder + same transforms", reference), ("dlstore shards", ds)):
        loader = DataLoader(dataset, batch_size=64, shuffle=True, num_workers=0)
        start = time.perf_counter()
        seen = sum(len(y) for _, y in loader)
        rates[name] = seen / (time.perf_counter() - start)
        click.echo(f"   {name:45s} {rates[name]:>10,.0f} samples/s")
    values = list(rates.values())
    click.echo(f"   speed-up: {values[1] / values[0]:,.0f}x (both single process, num_workers=0)")
    click.echo(f"   pixels and labels identical to ImageFolder on checked samples: {'yes' if same else 'NO'}")
    if not same:
        sys.exit(1)
    click.echo(f"next: dlstore info {store}")


def _check_device(device: str | None) -> None:
    if device is not None and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise click.BadParameter(f"{device!r}: no CUDA device is visible to this process; use "
                                     "--device cpu, or run on a machine with a GPU", param_hint="--device")


@main.command()
@click.argument("path", metavar="STORE_OR_FOLDER", type=click.Path(exists=True))
@click.option("--batch-size", "-b", type=click.IntRange(min=1), required=True,
              help="The batch size you train with.")
@click.option("--device", default=None,
              help="Training device (cpu, cuda, cuda:1): batches are copied there inside the timing; "
                   "pin_memory is tried only for CUDA. Default: stop at the host.")
@click.option("--budget", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds for the whole search.")
@click.option("--max-workers", type=click.IntRange(min=1), default=None,
              help="Highest num_workers to try (default: a little over the usable CPUs).")
@click.option("--static", default="",
              help='For a raw image FOLDER: static transforms applied per sample, as your current '
                   'pipeline does (e.g. "resize=256,center_crop=224"); PILToTensor follows.')
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def tune(path, batch_size, device, budget, max_workers, static, as_json):
    """Measure DataLoader settings on STORE_OR_FOLDER and recommend the fastest.

    STORE_OR_FOLDER is a dlstore store or a raw ImageFolder tree (decoded per
    sample, as torchvision does), so you can tune your current pipeline too.
    """
    import json

    from ._system import cpu_info
    from .tools.tuning import open_for_tuning
    from .tools.tuning import tune as run_tune

    _check_device(device)
    try:
        dataset = open_for_tuning(path, static=static or None)
        cpus = cpu_info()
        if not as_json:
            click.echo(f"{path}: {len(dataset)} samples, batch {batch_size}, "
                       f"device {device or 'none (host only)'}, budget {budget:g} s")
            click.echo(f"cpus: {cpus}")
        result = run_tune(dataset, batch_size, device=device, budget=budget, max_workers=max_workers,
                          cpus=cpus, log=lambda line: click.echo(line, err=True))
    except RuntimeError as exc:
        if "stack expects each tensor to be equal size" in str(exc):
            _fail(ValueError(f"{path}: samples have different sizes, so they cannot be batched; add a "
                             "size-fixing op to --static (e.g. center_crop=224)"))
        raise
    except (DlstoreError, ValueError, OSError) as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
        return
    click.echo(result.table())
    for warning in result.warnings:
        click.echo(f"warning: {warning}")
    if result.best.note:
        click.echo(f"note: {result.best.note}")
    click.echo(f"recommended ({result.speedup:.2f}x workers=0): {result.call()}")


@main.command()
@click.argument("path", metavar="STORE", type=click.Path(exists=True))
@click.option("--batch-size", "-b", type=click.IntRange(min=1), required=True)
@click.option("--num-workers", "workers", type=click.IntRange(min=0), default=None,
              help="num_workers of the DataLoader (default: min(4, usable CPUs)).")
@_renamed("--num-workers", "the DataLoader's num_workers")
@click.option("--prefetch-factor", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--pin-memory", is_flag=True, help="pin_memory=True (useful with --device cuda).")
@click.option("--steps", type=click.IntRange(min=2), default=50, show_default=True,
              help="Training steps to measure (the loader restarts if an epoch is shorter).")
@click.option("--step", "step_spec", default="conv", show_default=True,
              help="Synthetic step: conv (small conv net forward/backward), matmul:N, or sleep:MS "
                   "(an accelerator step that leaves the CPU free).")
@click.option("--device", default="cpu", show_default=True, help="Where the step runs.")
@click.option("--static", default="", help="For a raw image folder: static transforms per sample.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def profile(path, batch_size, workers, prefetch_factor, pin_memory, steps, step_spec, device, static,
            as_json):
    """Profile a training loop on STORE: time waiting for data vs time in a synthetic step."""
    import itertools
    import json

    from torch.utils.data import DataLoader

    from ._system import usable_cpus
    from .tools.profiling import TimedDataset, profile_loader, synthetic_step
    from .tools.tuning import loader_kwargs, open_for_tuning

    _check_device(device)
    workers = min(4, usable_cpus()) if workers is None else workers
    try:
        step = synthetic_step(step_spec, device=device)
        dataset = TimedDataset(open_for_tuning(path, static=static or None), max_workers=max(workers, 1))
    except (DlstoreError, ValueError, OSError) as exc:
        _fail(exc)
    kwargs = loader_kwargs(batch_size, workers, prefetch_factor=prefetch_factor, pin_memory=pin_memory)
    loader = DataLoader(dataset, shuffle=True, **kwargs)

    def batches():  # as many epochs as it takes to reach --steps
        while True:
            yield from loader

    with profile_loader(itertools.islice(batches(), steps), device=device) as p:
        for x, y in p:
            step(x, y)
    report = p.report()
    if as_json:
        stats = {kind: vars(s) for kind, s in dataset.stats().items()}
        click.echo(json.dumps({"loader": kwargs, "step": step_spec, "device": device,
                               "report": report.to_json(), "dataset_latency": stats}, indent=2))
        return
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    click.echo(f"loader    DataLoader(dataset, {args}, shuffle=True)")
    click.echo(f"step      {step_spec} on {device}")
    click.echo("per-sample fetch latency (TimedDataset, all workers):")
    click.echo("  " + dataset.report().replace("\n", "\n  "))
    click.echo(str(report))


@main.command()
@click.argument("src", required=False, type=click.Path(exists=True, file_okay=False))
@click.option("--dir", "workdir", type=click.Path(file_okay=False), default=None,
              help="A folder on the disk to test: images and stores are written (and removed) in a new "
                   "dlstore-bench-* folder inside it. Default: the system temp folder.")
@click.option("--formats", default=None,
              help="Comma-separated: imagefolder (the baseline), shards, lmdb, hdf5, each store format "
                   "optionally +jpeg or +png. Default: imagefolder,shards,lmdb,hdf5,shards+jpeg.")
@click.option("--static", default="resize=256,center_crop=224", show_default=True,
              help="Static transforms, ending with a crop (batched samples need one size).")
@click.option("--num-workers", "workers", default="0,2", show_default=True,
              help="Comma-separated DataLoader num_workers values to measure.")
@_renamed("--num-workers", "the list of DataLoader num_workers values")
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--cache", default="cold,warm", show_default=True, help="Page-cache states: cold, warm.")
@click.option("--order", "orders", default="random,sequential", show_default=True,
              help="Sample orders: random, sequential.")
@click.option("--samples", type=click.IntRange(min=0), default=256, show_default=True,
              help="Images to use (from SRC: spread over its classes; 0: all of SRC).")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed rounds (each format/order/workers/cache once per round).")
@click.option("--quality", type=click.IntRange(1, 100), default=90, show_default=True,
              help="JPEG quality of +jpeg stores.")
@click.option("--convert-workers", type=click.IntRange(min=0), default=None,
              help="Decode processes for the conversions (default: usable CPUs).")
@click.option("--disk-test-size", default="256MiB", show_default=True,
              help="Size of the file that measures the disk's raw sequential read bandwidth.")
@click.option("--drop-caches", is_flag=True,
              help="Also write /proc/sys/vm/drop_caches before cold runs (root only; posix_fadvise "
                   "eviction is always used and needs no privileges).")
@click.option("--keep", is_flag=True, help="Keep the images and stores written under --dir.")
@click.option("--out", "out", type=click.Path(file_okay=False), default="dlstore-bench-report", show_default=True,
              help="Folder for report.json, report.md and report.png (with matplotlib).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def bench(src, workdir, formats, static, workers, batch_size, cache, orders, samples, repeats, quality,
          convert_workers, disk_test_size, drop_caches, keep, out, quiet):
    """Benchmark storage formats on a disk: which one to use on this machine.

    Converts SRC (default: a built-in demo folder of synthetic JPEGs) to each
    format under --dir, measures the disk's raw sequential read bandwidth, and
    reads every store and the image folder itself (torchvision ImageFolder with
    the same static transforms) in random and sequential order, per num_workers
    value, with a cold (evicted, verified with mincore) and a warm page cache.
    """
    from .tools.bench import run_bench

    _sigterm_as_interrupt()
    try:
        report = run_bench(src, workdir=workdir, formats=formats, static=static, workers=workers,
                           batch_size=batch_size, cache=cache, orders=orders, samples=samples, repeats=repeats,
                           quality=quality, convert_workers=convert_workers,
                           disk_test_bytes=parse_bytes(disk_test_size), drop_caches=drop_caches, keep=keep,
                           progress=not quiet, log=_say)
        written = report.write(out)
    except KeyboardInterrupt:
        click.echo("interrupted: the bench folder under --dir was removed (unless --keep)", err=True)
        sys.exit(130)
    except (DlstoreError, ValueError, OSError) as exc:
        _fail(exc)
    click.echo(report.table())
    if keep:
        click.echo(f"kept the images and stores in {report.settings['workdir']}")
    click.echo("wrote " + ", ".join(str(p) for p in written.values()))


if __name__ == "__main__":  # pragma: no cover
    main()
