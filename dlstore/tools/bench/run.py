"""Storage formats benchmarked on a given disk: ``dlstore bench``.

One run answers "which format should I use on *this* machine and *this*
disk?". In a work folder on the disk under test it writes an image folder (the
built-in demo, or a subset copied from the user's folder), converts it to each
format, measures the disk's raw sequential read bandwidth, then reads every
store (and the image folder through torchvision ``ImageFolder`` with the same
static transforms, decoded per sample: the baseline) in random and sequential
order, for each ``num_workers`` value, with a cold and a warm page cache.

Cold cache without root: before each cold run the store's files are fsynced
and dropped from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``
(``/proc/sys/vm/drop_caches`` as well when running as root and asked to), and
the eviction is verified: ``mincore`` over a fresh ``mmap`` of every file gives
the fraction of its pages still resident, which the report records for every
run. Pages mapped by a live process cannot be dropped, so each run opens its
store after the eviction, and the DataLoader's workers map the files themselves.
Warm: before each warm run its store's files are read whole and measured the same way; a
run that did not start in the intended state is reported as not verified.

Timing (``reading``): every run builds a fresh DataLoader. Its workers start, then wait at a
gate until all of them are up; the clock starts when the gate opens, so worker
start-up (reported separately) is not counted as reading. Runs are interleaved
in rounds (every cell once per round), so a noisy neighbour slows all formats
alike; the spread over rounds is reported.

Library code returns a :class:`BenchReport`; the CLI prints it and writes
``report.json``, ``report.md`` and, with matplotlib installed, ``report.png``.
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ArgumentError
from .options import (
    _SUFFIX,
    CACHE_STATES,
    DEFAULT_SAMPLES,
    DEFAULT_STATIC,
    ORDERS,
    WARM_RESIDENT_MIN,
    Variant,
    _parse_choices,
    _parse_workers,
    default_formats,
    parse_variants,
)
from .probes import (
    COLD_RESIDENT_MAX,
    DEFAULT_DISK_TEST_BYTES,
    _load_average,
    _stats,
    can_drop_caches,
    disk_bandwidth,
    disk_info,
    machine_info,
    store_files,
)
from .reading import _imagefolder, _read_once
from .report import BenchReport, _recommend

# steady-state rates need this many batches per worker beyond each worker's first
STEADY_MIN_BATCHES = 8

# --------------------------------------------------------------------------- the run


def _prepare_images(src: str | os.PathLike | None, folder: Path, samples: int,
                    log: Callable[[str], None]) -> dict[str, Any]:
    """Write the image folder read by the bench (on the disk under test); describe it."""
    from ...sources.demo import make_image_folder
    from ...sources.folder import scan

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


def _convert_all(variants: list[Variant], images: Path, work: Path, data: dict[str, Any], *,
                 spec: list[dict[str, Any]], quality: int, workers: int | None, bar: Any,
                 log: Callable[[str], None]) -> tuple[dict[str, dict[str, Any]], dict[str, Path]]:
    """Convert ``images`` to every store variant; (per-name store facts, per-name path to read)."""
    from ...conversion.job import disk_usage
    from ...conversion.local import convert
    from ...conversion.pool import decode_sample

    # Decode one image here first: imports and kernel set-up are then paid before the timed
    # conversions (and inherited by forked decode workers), not by whichever format goes first.
    decode_sample(str(store_files(images)[0]), spec)
    stores: dict[str, dict[str, Any]] = {}
    paths: dict[str, Path] = {}
    for v in variants:
        if not v.is_store:
            paths[v.name] = images
            stores[v.name] = {"format": "imagefolder", "encoding": "source files", "path": str(images),
                              "bytes": data["bytes"], "files": data["files"], "convert": None}
            continue
        bar.set_postfix_str(f"convert {v.name}")
        dst = work / f"bench-{v.name.replace('+', '-')}{_SUFFIX[v.format]}"
        options: dict[str, Any] = {}
        if v.encoding != "raw":
            options["encoding"] = v.encoding
            if v.encoding == "jpeg":
                options["quality"] = quality
        result = convert(images, dst, store_format=v.format, static=spec, workers=workers, overwrite=True,
                         progress=False, log=log, **options)
        paths[v.name] = dst
        stores[v.name] = {"format": v.format, "encoding": v.encoding, "path": str(dst), "bytes": disk_usage(dst),
                          "files": len(store_files(dst)),
                          "convert": {"seconds": result.seconds, "images_per_s": result.rate,
                                      "workers": result.workers, "runs": 1}}
        if v.encoding == "jpeg":
            stores[v.name]["quality"] = quality
        bar.update()
    for st in stores.values():
        st["bytes_per_sample"] = st["bytes"] / data["samples"]
        st["size_vs_source"] = st["bytes"] / data["bytes"]
    return stores, paths


def _measure(variants: list[Variant], cells: list[tuple], paths: dict[str, Path], images: Path, *,
             spec: list[dict[str, Any]], caches: list[str], repeats: int, batch_size: int, drop_caches: bool,
             bar: Any) -> dict[tuple, list[dict[str, Any]]]:
    """Every cell once per round, ``repeats`` rounds per cache state; cell -> its runs."""
    from ...data.stores import open_dataset

    files = {name: store_files(p) for name, p in paths.items()}

    def opener(v: Variant) -> Callable[[], Any]:
        if v.is_store:
            return lambda: open_dataset(paths[v.name])
        return lambda: _imagefolder(images, spec)

    # Fetch one sample of each in this process: lazily imported modules (numpy's, torchvision's)
    # are then loaded before DataLoader workers fork, so no worker's first batch pays for them.
    for v in variants:
        warm_up = opener(v)()
        if v.is_store:
            warm_up.get_batch([0])
        else:
            warm_up[0]
        del warm_up
    gc.collect()
    runs: dict[tuple, list[dict[str, Any]]] = {cell: [] for cell in cells}
    for c in caches:
        for r in range(repeats):
            for cell in (x for x in cells if x[3] == c):
                v, o, w, _ = cell
                bar.set_postfix_str(f"{c} {v.name} {o} workers={w} round {r + 1}/{repeats}")
                runs[cell].append(_read_once(opener(v), files[v.name], store=v.is_store, cache=c, order=o,
                                             workers=w, batch_size=batch_size, seed=r, drop_caches=drop_caches))
                bar.update()
    return runs


def run_bench(
    src: str | os.PathLike | None = None,
    *,
    workdir: str | os.PathLike | None = None,
    formats: str | Iterable[str] | None = None,
    static: Any = DEFAULT_STATIC,
    workers: str | int | Iterable[int] = (0, 2),
    batch_size: int = 64,
    cache: str | Iterable[str] = CACHE_STATES,
    orders: str | Iterable[str] = ORDERS,
    samples: int = DEFAULT_SAMPLES,
    repeats: int = 3,
    quality: int = 90,
    convert_workers: int | None = None,
    disk_test_bytes: int = DEFAULT_DISK_TEST_BYTES,
    drop_caches: bool = False,
    keep: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> BenchReport:
    """Benchmark storage formats on the disk holding ``workdir``.

    Args:
        src: an image folder (ImageFolder layout); ``samples`` of its images, spread
            over the classes, are copied into ``workdir``. None: the built-in demo
            folder (synthetic 500x375 JPEGs) is written there.
        workdir: the folder on the disk under test; the bench writes into a new
            ``dlstore-bench-*`` folder inside it (default: the system temp folder).
        formats: names such as ``"imagefolder,shards,lmdb,hdf5,shards+jpeg"``;
            ``imagefolder`` is the baseline (torchvision ``ImageFolder``, decode and
            static transforms per sample). Default: :func:`default_formats`.
        static: static transforms (spec string, op dicts or torchvision transforms);
            must fix the sample size (end with a crop) so samples can be batched.
        workers: ``num_workers`` values to measure (``"0,2"`` or ints).
        batch_size: samples per batch.
        cache: ``"cold"`` and/or ``"warm"`` page cache.
        orders: ``"random"`` and/or ``"sequential"`` sample order.
        samples: images to use (0: all of ``src``).
        repeats: timed rounds; every cell runs once per round.
        quality: JPEG quality of ``+jpeg`` variants.
        convert_workers: decode processes of the conversions (default: usable CPUs).
        disk_test_bytes: size of the raw sequential bandwidth test file.
        drop_caches: also write ``/proc/sys/vm/drop_caches`` before cold runs (root only).
        keep: keep the images and stores (default: removed at the end).
        progress: show a tqdm progress bar.
        log: called with one-line notes while running.

    Raises:
        ValueError: an invalid setting (unknown format, spec without a fixed size, ...).
        PermissionError: ``drop_caches`` without root.
        SourceError: ``src`` is not a usable image folder.
    """
    import torch
    from tqdm.auto import tqdm

    from ..._system import usable_cpus
    from ...transforms.static import describe, output_shape, parse_static

    log = log or (lambda message: None)
    variants = parse_variants(default_formats() if formats is None else formats)
    worker_values = _parse_workers(workers)
    caches = _parse_choices(cache, CACHE_STATES, "cache state")
    order_values = _parse_choices(orders, ORDERS, "order")
    spec = parse_static(static)
    if output_shape(spec) is None:
        raise ArgumentError(f"static {describe(spec)!r} leaves the sample size to the image; batching needs one size: "
                         f"end it with a crop, e.g. {DEFAULT_STATIC!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ArgumentError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ArgumentError(f"repeats must be a positive integer, got {repeats!r}")
    if samples < 0 or (src is None and samples == 0):
        raise ArgumentError(f"samples must be positive (0 means all of SRC), got {samples}")
    if drop_caches and not can_drop_caches():
        raise PermissionError("drop_caches needs root (writing /proc/sys/vm/drop_caches); without it the "
                              "bench evicts with posix_fadvise, which needs no privileges")
    base = Path(workdir) if workdir is not None else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dlstore-bench-", dir=base))
    notes: list[str] = []
    load_start = _load_average()
    threads = torch.get_num_threads()
    # One intra-op thread, as in DataLoader workers: on a small shared machine more threads
    # spin at barriers in the batch copy and slow the main-process (num_workers=0) runs.
    torch.set_num_threads(1)
    cells = [(v, o, w, c) for c in caches for v in variants for o in order_values for w in worker_values]
    stores_total = sum(v.is_store for v in variants)
    bar = tqdm(total=2 + stores_total + len(cells) * repeats, desc="dlstore bench", unit="step",
               disable=not progress, dynamic_ncols=True, leave=False)
    try:
        bar.set_postfix_str("images")
        images = work / "images"
        data = _prepare_images(src, images, samples, log)
        bar.update()
        bar.set_postfix_str("raw disk bandwidth")
        disk = disk_bandwidth(work, size=disk_test_bytes, drop_caches=drop_caches)
        bar.update()
        if not disk["cold_verified"]:
            notes.append(f"the raw disk test file stayed {max(disk['resident_after_eviction']):.0%} resident after "
                         "eviction: its bandwidth may be the page cache's (a filesystem that ignores "
                         "posix_fadvise, e.g. tmpfs); try --drop-caches as root")

        stores, paths = _convert_all(variants, images, work, data, spec=spec, quality=quality,
                                     workers=convert_workers, bar=bar, log=log)
        runs = _measure(variants, cells, paths, images, spec=spec, caches=caches, repeats=repeats,
                        batch_size=batch_size, drop_caches=drop_caches, bar=bar)
    finally:
        bar.close()
        torch.set_num_threads(threads)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)

    reads = _summarise(runs, stores, disk, variants)
    unverified = [f"{r['format']} {r['order']} workers={r['workers']}" for r in reads if not r["verified"]]
    if unverified:
        notes.append(f"{len(unverified)} cell(s) did not start in the intended cache state (see 'resident'), "
                     f"e.g. {unverified[0]}: for warm, the data may not fit in the page cache; for cold, the "
                     "filesystem may ignore posix_fadvise (try --drop-caches as root)")
    load = {"start": load_start, "end": _load_average()}
    busiest = max((x for x in load.values() if x is not None), default=None)
    usable = usable_cpus()
    if busiest is not None and busiest > usable:
        notes.append(f"the machine was busy (1-minute load average up to {busiest:.1f} on {usable} usable CPU(s)): "
                     "other processes shared the CPUs, so rates are lower and spreads wider than on an idle machine")
    names = [v.name for v in variants]
    machine = machine_info()
    machine["disk"] = disk_info(base)
    recommendation = _recommend(reads, names, order_values, caches, machine["disk"])
    settings = {
        "formats": names, "static": describe(spec), "static_spec": spec, "workers": worker_values,
        "batch_size": batch_size, "cache": caches, "orders": order_values, "samples": samples, "repeats": repeats,
        "quality": quality, "convert_workers": convert_workers, "disk_test_bytes": disk_test_bytes,
        "drop_caches": drop_caches, "eviction": "posix_fadvise+drop_caches" if drop_caches else "posix_fadvise",
        "workdir": str(work), "kept": keep, "torch_threads": 1, "load_average_1min": load,
        "reader": {"stores": "dlstore.open_dataset + dlstore.loader (one get_batch per batch)",
                   "imagefolder": "torchvision ImageFolder + static transforms + PILToTensor, DataLoader"},
        "timing": "fresh DataLoader per run; clock starts when every worker is up (start-up in startup_s)",
    }
    return BenchReport(machine=machine, settings=settings, data=data, disk=disk, stores=stores, reads=reads,
                       recommendation=recommendation, notes=notes,
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
    return _stats(rates)


def _summarise(runs: dict[tuple, list[dict[str, Any]]], stores: dict[str, dict[str, Any]], disk: dict[str, Any],
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
            "format": v.name, "order": order, "workers": workers, "cache": cache,
            "samples": rs[0]["samples"], "batches": len(rs[0]["batch_s"]), "repeats": len(rs),
            "samples_per_s": _stats(rates),
            "mb_per_s": _stats([x * per_sample / 1e6 for x in rates]),
            "batch_latency_ms": {"p50": float(np.percentile(gaps_ms, 50)), "p95": float(np.percentile(gaps_ms, 95)),
                                 "max": float(gaps_ms.max()), "batches": int(len(gaps_ms))},
            "steady_samples_per_s": _steady(rs),
            "seconds": [r["seconds"] for r in rs], "startup_s": _stats([r["startup_s"] for r in rs]),
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


