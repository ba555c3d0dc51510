"""``dlstore bench``: which store format is fastest on this disk."""

from __future__ import annotations

import sys

import click

from ..errors import DlstoreError
from .common import STORE_BACKENDS, fail, parse_bytes, renamed, say, sigterm_as_interrupt


@click.command()
@click.argument("src", required=False, type=click.Path(exists=True))
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
@renamed("--num-workers", "the list of DataLoader num_workers values")
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--backend", type=click.Choice(STORE_BACKENDS), default="auto", show_default=True,
              help="dlstore.loader's back-end for reading the stores: threads (--num-workers 0 only), ring "
                   "(worker processes writing into shared memory; --num-workers 1 or more), dataloader, or "
                   "auto (its own choice per num_workers value). ImageFolder is read by torch's DataLoader.")
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
def bench(src, workdir, formats, static, workers, batch_size, backend, cache, orders, samples, repeats, quality,
          convert_workers, disk_test_size, drop_caches, keep, out, quiet):
    """Benchmark storage formats on a disk: which one to use on this machine.

    Converts SRC (default: a built-in demo folder of synthetic JPEGs) to each
    format under --dir, measures the disk's raw sequential read bandwidth, and
    reads every store and the image folder itself (torchvision ImageFolder with
    the same static transforms) in random and sequential order, per num_workers
    value, with a cold (evicted, verified with mincore) and a warm page cache.
    """
    from ..tools.bench import run_bench

    sigterm_as_interrupt()
    try:
        report = run_bench(src, workdir=workdir, formats=formats, static=static, workers=workers,
                           batch_size=batch_size, backend=backend, cache=cache, orders=orders, samples=samples,
                           repeats=repeats, quality=quality, convert_workers=convert_workers,
                           disk_test_bytes=parse_bytes(disk_test_size), drop_caches=drop_caches, keep=keep,
                           progress=not quiet, log=say)
        written = report.write(out)
    except KeyboardInterrupt:
        click.echo("interrupted: the bench folder under --dir was removed (unless --keep)", err=True)
        sys.exit(130)
    except (DlstoreError, ValueError, OSError) as exc:
        fail(exc)
    click.echo(report.table())
    if keep:
        click.echo(f"kept the images and stores in {report.settings['workdir']}")
    click.echo("wrote " + ", ".join(str(p) for p in written.values()))

