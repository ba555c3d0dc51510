"""Storage formats benchmarked on a given disk: ``dlstore bench``.

One run answers "which format should I use on *this* machine and *this*
disk?". In a work folder on the disk under test it writes an image folder (the
built-in demo, or a subset copied from the user's folder), converts it to each
format, measures the disk's raw sequential read bandwidth, then reads every
store (through ``dlstore.loader`` with the ``backend`` asked for) and the image
folder (through torchvision ``ImageFolder`` with the same static transforms,
decoded per sample, and torch's DataLoader: the baseline) in random and
sequential order, for each ``num_workers`` value, with a cold and a warm page cache.

Cold cache without root: before each cold run the store's files are fsynced
and dropped from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``
(``/proc/sys/vm/drop_caches`` as well when running as root and asked to), and
the eviction is verified: ``mincore`` over a fresh ``mmap`` of every file gives
the fraction of its pages still resident, which the report records for every
run. Pages mapped by a live process cannot be dropped, so each run opens its
store after the eviction, and the DataLoader's workers map the files themselves.
Warm: before each warm run its store's files are read whole and measured the same way; a
run that did not start in the intended state is reported as not verified.

Timing (``reading``): every run builds a fresh loader. Its workers start, then wait at a
gate until all of them are up; the clock starts when the gate opens, so worker
start-up (reported separately) is not counted as reading. Runs are interleaved
in rounds (every cell once per round), so a noisy neighbour slows all formats
alike; the spread over rounds is reported.

Library code returns a :class:`BenchReport`; the CLI prints it and writes
``report.json``, ``report.md`` and, with matplotlib installed, ``report.png``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from .options import WARM_RESIDENT_MIN, Variant
from .probes import (
    COLD_RESIDENT_MAX,
    disk_bandwidth,
    disk_info,
    load_average,
    machine_info,
    run_stats,
    store_files,
)
from .reading import imagefolder_dataset, read_once
from .report import BenchReport, recommend
from .settings import BenchSettings

# steady-state rates need this many batches per worker beyond each worker's first
STEADY_MIN_BATCHES = 8


def run_bench(src: str | os.PathLike | None = None, *, progress: bool = True, log: Callable[[str], None] | None = None,
              **options: Any) -> BenchReport:
    """Benchmark storage formats on the disk holding ``workdir``.

    The steps: the settings parsed and checked (:meth:`BenchSettings.parse`, before anything is
    written), the image folder written (``prepare``), the disk's raw bandwidth measured, every
    store converted (``convert``), every cell read in rounds (``measure``), the runs summarised
    into a :class:`BenchReport` (``summarise``).

    Args:
        src: an image folder (ImageFolder layout), or None for the built-in demo images.
        progress: show a tqdm progress bar.
        log: called with one-line notes while running.
        **options: the keyword arguments of :meth:`BenchSettings.parse`: ``workdir``, ``formats``,
            ``static``, ``workers``, ``batch_size``, ``cache``, ``orders``, ``samples``, ``repeats``,
            ``quality``, ``convert_workers``, ``disk_test_bytes``, ``drop_caches``, ``keep``, ``backend``.

    Raises:
        ArgumentError: an invalid setting (unknown format, spec without a fixed size, a store as SRC, ...).
        PermissionError: ``drop_caches`` without root.
        SourceError: ``src`` is not a usable image folder.
    """
    settings = BenchSettings.parse(src, **options)
    log = log or (lambda message: None)
    notes: list[str] = []
    with _work_folder(settings) as work, _one_torch_thread(), _progress_bar(settings, progress) as bar:
        load_start = load_average()
        images = work / "images"
        bar.set_postfix_str("images")
        data = prepare(settings, images, log)
        bar.update()
        bar.set_postfix_str("raw disk bandwidth")
        disk = disk_bandwidth(work, size=settings.disk_test_bytes, drop_caches=settings.drop_caches)
        bar.update()
        if not disk["cold_verified"]:
            notes.append(f"the raw disk test file stayed {max(disk['resident_after_eviction']):.0%} resident after "
                         "eviction: its bandwidth may be the page cache's (a filesystem that ignores "
                         "posix_fadvise, e.g. tmpfs); try --drop-caches as root")
        stores, paths = convert(settings, images, work, data, bar=bar, log=log)
        runs = measure(settings, paths, images, bar=bar)
    return summarise(settings, work, runs, data=data, disk=disk, stores=stores, notes=notes, load_start=load_start)


@contextlib.contextmanager
def _work_folder(settings: BenchSettings) -> Iterator[Path]:
    """A new ``dlstore-bench-*`` folder in ``workdir``, removed at the end unless kept."""
    settings.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dlstore-bench-", dir=settings.workdir))
    try:
        yield work
    finally:
        if not settings.keep:
            shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    # One intra-op thread, as in DataLoader workers: on a small shared machine more threads
    # spin at barriers in the batch copy and slow the main-process (num_workers=0) runs.
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _progress_bar(settings: BenchSettings, progress: bool) -> Iterator[Any]:
    from tqdm.auto import tqdm

    steps = 2 + sum(v.is_store for v in settings.variants) + len(settings.cells) * settings.repeats
    bar = tqdm(total=steps, desc="dlstore bench", unit="step", disable=not progress, dynamic_ncols=True, leave=False)
    try:
        yield bar
    finally:
        bar.close()


# --------------------------------------------------------------------------- the steps


def prepare(settings: BenchSettings, folder: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Write the image folder read by the bench (on the disk under test); describe it."""
    from ...sources.demo import make_image_folder
    from ...sources.folder import scan

    src, samples = settings.src, settings.samples
    if src is None:
        classes = min(8, samples)
        per_class = -(-samples // classes)
        make_image_folder(folder, classes=classes, per_class=per_class)
        # exactly `samples` images: drop the last image of as many classes as there are too many
        for c in range(classes * per_class - samples):
            (folder / f"class_{c:02d}" / f"img_{per_class - 1:04d}.jpg").unlink()
        described = {"source": "built-in demo (synthetic 500x375 JPEGs, quality 90)"}
    else:
        source = scan(src)
        chosen = source.samples
        if samples and samples < len(chosen):
            # spread evenly over the folder so every class keeps its share
            picks = np.unique(np.linspace(0, len(chosen) - 1, samples).round().astype(np.int64))
            chosen = [chosen[int(i)] for i in picks]
        root = Path(source.root)
        for path, _ in chosen:
            rel = Path(path).relative_to(root)
            if not source.labelled:  # ImageFolder needs class folders: one for all
                rel = Path("unlabelled") / rel
            target = folder / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        if len(chosen) < len(source):
            log(f"using {len(chosen)} of the {len(source)} images of {src} (--samples), copied to {folder}")
        described = {"source": str(Path(src).resolve())}
    files = store_files(folder)
    scanned = scan(folder)
    described.update(samples=len(scanned), classes=len(scanned.classes), files=len(files),
                     bytes=sum(f.stat().st_size for f in files), folder=str(folder))
    return described


def convert(settings: BenchSettings, images: Path, work: Path, data: dict[str, Any], *, bar: Any,
            log: Callable[[str], None]) -> tuple[dict[str, dict[str, Any]], dict[str, Path]]:
    """Convert ``images`` to every store variant; (per-name store facts, per-name path to read)."""
    from ...conversion.pool import decode_sample

    # Decode one image here first: imports and kernel set-up are then paid before the timed
    # conversions (and inherited by forked decode workers), not by whichever format goes first.
    decode_sample(str(store_files(images)[0]), settings.spec)
    stores: dict[str, dict[str, Any]] = {}
    paths: dict[str, Path] = {}
    for v in settings.variants:
        if not v.is_store:
            paths[v.name] = images
            stores[v.name] = {"format": "imagefolder", "encoding": "source files", "path": str(images),
                              "bytes": data["bytes"], "files": data["files"], "convert": None}
            continue
        bar.set_postfix_str(f"convert {v.name}")
        paths[v.name], stores[v.name] = _convert_one(settings, v, images, work, log)
        bar.update()
    for st in stores.values():
        st["bytes_per_sample"] = st["bytes"] / data["samples"]
        st["size_vs_source"] = st["bytes"] / data["bytes"]
    return stores, paths


def _convert_one(settings: BenchSettings, v: Variant, images: Path, work: Path,
                 log: Callable[[str], None]) -> tuple[Path, dict[str, Any]]:
    from ...conversion.job import disk_usage
    from ...conversion.local import convert as convert_store
    from ...formats import get_format

    dst = work / f"bench-{v.name.replace('+', '-')}{get_format(v.format).suffixes[0]}"
    options: dict[str, Any] = {}
    if v.encoding != "raw":
        options["encoding"] = v.encoding
        if v.encoding == "jpeg":
            options["quality"] = settings.quality
    result = convert_store(images, dst, store_format=v.format, static=settings.spec, workers=settings.convert_workers,
                           overwrite=True, progress=False, log=log, **options)
    store = {"format": v.format, "encoding": v.encoding, "path": str(dst), "bytes": disk_usage(dst),
             "files": len(store_files(dst)),
             "convert": {"seconds": result.seconds, "images_per_s": result.rate, "workers": result.workers, "runs": 1}}
    if v.encoding == "jpeg":
        store["quality"] = settings.quality
    return dst, store


def measure(settings: BenchSettings, paths: dict[str, Path], images: Path, *,
            bar: Any) -> dict[tuple, list[dict[str, Any]]]:
    """Every cell once per round, ``repeats`` rounds per cache state; cell -> its runs."""
    from ...data.stores import open_dataset

    files = {name: store_files(p) for name, p in paths.items()}

    def opener(v: Variant) -> Callable[[], Any]:
        if v.is_store:
            return lambda: open_dataset(paths[v.name])
        return lambda: imagefolder_dataset(images, settings.spec)

    # Fetch one sample of each in this process: lazily imported modules (numpy's, torchvision's)
    # are then loaded before DataLoader workers fork, so no worker's first batch pays for them.
    for v in settings.variants:
        warm_up = opener(v)()
        if v.is_store:
            warm_up.get_batch([0])
        else:
            warm_up[0]
        del warm_up
    gc.collect()
    cells = settings.cells
    runs: dict[tuple, list[dict[str, Any]]] = {cell: [] for cell in cells}
    for c in settings.caches:
        for r in range(settings.repeats):
            for cell in (x for x in cells if x[3] == c):
                v, o, w, _ = cell
                bar.set_postfix_str(f"{c} {v.name} {o} workers={w} round {r + 1}/{settings.repeats}")
                runs[cell].append(read_once(opener(v), files[v.name], store=v.is_store, cache=c, order=o, workers=w,
                                            batch_size=settings.batch_size, seed=r,
                                            drop_caches=settings.drop_caches, backend=settings.backend))
                bar.update()
    return runs


def summarise(settings: BenchSettings, work: Path, runs: dict[tuple, list[dict[str, Any]]], *,
              data: dict[str, Any], disk: dict[str, Any], stores: dict[str, dict[str, Any]], notes: list[str],
              load_start: float | None) -> BenchReport:
    """The report: per-cell statistics, the machine, the recommendation, and notes on what the
    numbers cannot be trusted for (cells not in their cache state, a busy machine)."""
    from ..._system import usable_cpus

    reads = _read_rows(runs, stores, disk, settings.variants)
    unverified = [f"{r['format']} {r['order']} workers={r['workers']}" for r in reads if not r["verified"]]
    if unverified:
        notes.append(f"{len(unverified)} cell(s) did not start in the intended cache state (see 'resident'), "
                     f"e.g. {unverified[0]}: for warm, the data may not fit in the page cache; for cold, the "
                     "filesystem may ignore posix_fadvise (try --drop-caches as root)")
    load = {"start": load_start, "end": load_average()}
    busiest = max((x for x in load.values() if x is not None), default=None)
    usable = usable_cpus()
    if busiest is not None and busiest > usable:
        notes.append(f"the machine was busy (1-minute load average up to {busiest:.1f} on {usable} usable CPU(s)): "
                     "other processes shared the CPUs, so rates are lower and spreads wider than on an idle machine")
    machine = machine_info()
    machine["disk"] = disk_info(settings.workdir)
    recommendation = recommend(reads, [v.name for v in settings.variants], settings.orders, settings.caches,
                               machine["disk"])
    return BenchReport(machine=machine, settings=dict(settings.to_json(work), load_average_1min=load), data=data,
                       disk=disk, stores=stores, reads=reads, recommendation=recommendation, notes=notes,
                       created=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def _steady(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """samples/s after every worker's first batch (which pays opening the store, first-touch
    page faults and shared-memory set-up once per epoch with non-persistent workers).

    None unless every run has at least ``STEADY_MIN_BATCHES`` batches per worker beyond those:
    batches prefetched while the first ones were made arrive at once and would inflate a
    rate taken over a few batches.
    """
    rates = []
    for r in runs:
        skip = max(r["workers"], 1)
        if len(r["batch_s"]) - skip < STEADY_MIN_BATCHES * skip:
            return None
        seconds = sum(r["batch_s"][skip:])
        rates.append(sum(r["batch_sizes"][skip:]) / seconds if seconds > 0 else math.inf)
    return run_stats(rates)


def _read_rows(runs: dict[tuple, list[dict[str, Any]]], stores: dict[str, dict[str, Any]], disk: dict[str, Any],
               variants: list[Variant]) -> list[dict[str, Any]]:
    reads = []
    disk_mb = disk["read_mb_s"]["median"]
    for (v, order, workers, cache), rs in runs.items():
        if not rs:
            continue
        per_sample = stores[v.name]["bytes_per_sample"]
        rates = [r["samples"] / r["seconds"] if r["seconds"] > 0 else math.inf for r in rs]
        gaps_ms = np.array([g for r in rs for g in r["batch_s"]]) * 1e3
        resident = [r["resident"] for r in rs]
        verified = max(resident) <= COLD_RESIDENT_MAX if cache == "cold" else min(resident) >= WARM_RESIDENT_MIN
        row: dict[str, Any] = {
            "format": v.name, "order": order, "workers": workers, "cache": cache, "backend": rs[0]["backend"],
            "samples": rs[0]["samples"], "batches": len(rs[0]["batch_s"]), "repeats": len(rs),
            "samples_per_s": run_stats(rates),
            "mb_per_s": run_stats([x * per_sample / 1e6 for x in rates]),
            "batch_latency_ms": {"p50": float(np.percentile(gaps_ms, 50)), "p95": float(np.percentile(gaps_ms, 95)),
                                 "max": float(gaps_ms.max()), "batches": int(len(gaps_ms))},
            "steady_samples_per_s": _steady(rs),
            "seconds": [r["seconds"] for r in rs], "startup_s": run_stats([r["startup_s"] for r in rs]),
            "resident_at_start": resident, "verified": verified,
            "disk_fraction": None, "vs_imagefolder": None, "vs_imagefolder_runs": None,
        }
        if cache == "cold" and disk_mb > 0:
            row["disk_fraction"] = row["mb_per_s"]["median"] / disk_mb
        base = runs.get((Variant("imagefolder"), order, workers, cache))
        if base:
            base_rates = [r["samples"] / r["seconds"] for r in base]
            row["vs_imagefolder"] = row["samples_per_s"]["median"] / statistics.median(base_rates)
            row["vs_imagefolder_runs"] = [a / b for a, b in zip(rates, base_rates)]  # same round, same load
        reads.append(row)
    return reads


