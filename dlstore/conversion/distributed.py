"""Distributed conversion on ``torch.distributed``: every rank converts a part, rank 0 assembles.

``dlstore.convert`` calls ``convert_distributed`` when it runs inside an
initialised process group of more than one rank (``torchrun --nproc-per-node P
-m dlstore convert SRC DST``: the CLI initialises a gloo group from torchrun's
environment). The destination's folder must be on a filesystem every rank sees.

Phases (each ends with a status exchange: an ``all_gather_object`` over a gloo
group, so every rank learns whether every other rank succeeded)::

    0. rank 0    checks DST, takes its lock, scans SRC once (checks a resumed run), and hands
                 each rank a contiguous range of the file list (scatter; ranges differ by <= 1 file)
    1. all ranks decode their range with their own worker pool into a part store
                 ``.DST.dlstore-dist/parts/part-RRRRR{.shards,.h5,.lmdb}``
    2. rank 0    assembles the parts into one store and publishes it atomically

Assembly, per format (the result reads exactly like a single-process conversion
of the same folder: same sample order, labels, sample bytes):

    shards   the parts' data files are *renamed* into the store as
             ``rankRRRRR-shard-NNNNN.npy`` (no data copy) and listed in rank
             order under one manifest; labels.npy (and index.npy) are
             concatenated. Checksums are per file, so the parts' digests carry over.
    hdf5     the parts stay as files in ``DST.parts/`` next to ``DST``; ``DST`` holds
             /labels (and /shapes) and an HDF5 *virtual dataset* /images mapping
             each part's /images in order, so plain ``h5py`` reads it with no
             dlstore code. Moving the store means moving ``DST`` and ``DST.parts``
             together (the mapping uses a relative path). HDF5 finds the parts by
             name, and an overwrite publishes the new ``DST.parts`` before the new
             ``DST``: ``DST``'s manifest records each part's own checksums, and a
             reader refuses parts that are not those (formats.hdf5.virtual.hold_virtual_sources).
    lmdb     a merge step on rank 0 copies the parts' records in order into one
             environment (LMDB has one writer at a time and no cross-environment
             view); this copies the sample data once.

The ``samples`` checksum of HDF5/LMDB stores (sha256 of every record in sample
order) cannot be combined from per-part digests, so rank 0 reads the parts back
once in order to compute it (HDF5; LMDB hashes while merging). The digests are
then identical to those of a single-process conversion.

A rank that fails (a corrupt file with ``on_error="fail"``, a full disk, ...)
drops a marker file in the shared work folder; the other ranks check for it
every 256 files and stop too, so nobody converts for hours in vain. Every rank
then raises (the failing rank its own error, the others ``DistributedError``
naming the failing rank and its error): no store, complete-looking or not, is
left at ``DST``.

Resume: each rank checkpoints its part at every unit of its writer (a data file,
a committed transaction, a written block) in ``.DST.dlstore-dist/rank-RRRRR.json``,
which also records a finished part; ``plan.json`` records the number of ranks and
the job's fingerprint. An interruption while the ranks convert (Ctrl-C, SIGTERM, a
killed rank, a full disk) keeps the work folder, and rank 0 logs where;
``resume=True`` (``--resume``) on as many ranks with the same settings continues
every part from its checkpoint (a finished part is not converted again; a part that
cannot be reopened, like an HDF5 file whose writer was killed, starts over) and gives
the store an uninterrupted run gives. Other ranks or settings are refused, naming
what differs, and the kept folder stays as it was. Nothing is kept after a failure
on the input (DecodeError, SourceError: a resume would meet it again), nor after one
while rank 0 assembles shards or HDF5 (the assembly moves the parts; LMDB's merge
copies them, so they are kept).

Paths: besides ``DST`` (and ``DST.parts``), a conversion writes only in
``.DST.dlstore-dist`` and ``.DST.dlstore-tmp``, while rank 0 holds ``DST``'s lock.
``overwrite`` replaces a ``DST.parts`` only if it holds nothing but ``part-NNNNN.h5``
files (the parts of a store); any other path there is refused, named.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ArgumentError, DistributedError, SourceChangedError, SourceError
from .assemble import (
    assemble,
    check_parts_folder,
    hdf5_parts_path,
    remove_with_siblings,
)
from .destination import check_destination, remove_path, staging_path
from .job import ConvertResult, disk_usage, feed_writer, finish_writer
from .lock import DestinationLock
from .parts import PLAN, convert_part, keep_for_resume, resumable, write_json
from .ranks import (
    Exchange,
    RankStatus,
    describe_error,
    failed_ranks,
    mark_failed,
    raise_if_failed,
)

DEFAULT_TIMEOUT_S = 2 * 3600  # a collective may wait this long for the slowest rank (scan, conversion)


def env_world_size() -> int:
    """WORLD_SIZE set by torchrun (1 when not launched by a distributed launcher)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def init_from_env(timeout_s: float | None = None) -> bool:
    """Initialise a gloo process group from torchrun's environment variables.

    Does nothing (returns False) outside a multi-process launch or when a group
    is already initialised. ``timeout_s`` bounds every collective, that is how
    long a rank waits for the slowest one at the end of a phase; default:
    ``DLSTORE_DIST_TIMEOUT`` seconds from the environment, else 2 hours.

    Returns:
        True if this call initialised the group (the caller destroys it).
    """
    if env_world_size() <= 1 or "MASTER_ADDR" not in os.environ:
        return False
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if timeout_s is None:
        timeout_s = float(os.environ.get("DLSTORE_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return True


def active_group(distributed: bool | None) -> Any | None:
    """The process group to convert with, or None for a single-process conversion.

    Only ``distributed=True`` converts collectively, and requires an initialised group
    of 2+ ranks; None (the default) and False convert in this process alone, even
    inside a group: ``if rank == 0: dlstore.convert(...)`` in a DDP script must not
    join a collective the other ranks never enter (it would wait for them until the
    group's timeout). The command line passes True under torchrun. A group whose
    backend is not gloo (e.g. NCCL in a training script) gets a gloo twin for the
    CPU-side exchanges.
    """
    if not distributed:
        return None
    dist = sys.modules.get("torch.distributed")  # an initialised group means torch is imported
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        if distributed:
            raise ArgumentError("distributed=True needs an initialised torch.distributed process group of 2+ "
                             "ranks (launch with torchrun, or call torch.distributed.init_process_group)")
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def part_ranges(n: int, world: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of ``n`` files for ``world`` ranks, sizes differing by <= 1."""
    return [(r * n // world, (r + 1) * n // world) for r in range(world)]


def work_path(dst: Path) -> Path:
    """The shared folder where ranks write their parts (removed when the conversion ends, kept for --resume)."""
    return dst.with_name(f".{dst.name}.dlstore-dist")


def _part_name(rank: int, suffix: str) -> str:
    return f"part-{rank:05d}{suffix}"


def convert_distributed(group: Any, open_src: Any, dst: Path, *, store_format: Any, job_for: Any,
                        overwrite: bool, resume: bool, progress: bool, log: Any) -> Any:
    """Run the conversion ``dlstore.convert`` describes on every rank of ``group``; see the module doc.

    ``open_src()`` opens the source; ``job_for(source)`` builds the conversion's ``Job`` for a
    part of it. A file listing (folder, list file) is opened by rank 0 and its parts are sent
    to the ranks; an in-memory source (dataset, arrays), which every rank was given, is only
    measured by rank 0 and each rank takes its own part of its own copy. ``resume`` continues
    the interrupted conversion kept in the work folder (same ranks, same settings).
    Every rank returns the same ConvertResult (``workers`` is per rank).
    """
    run = _RankRun(Exchange(group), dst, store_format, work_path(dst), log)
    keep = False
    try:
        part, first, total, resumed = _hand_out_parts(run, open_src, job_for, overwrite, resume)
        job = _convert_part(run, job_for(part), first, total, resumed, progress)
        result = _assemble_on_rank0(run, part, job, job_for, total, overwrite)
        result.workers = job.workers
        return result
    except BaseException as exc:
        if run.lock is not None and run.stage != "check":
            keep = keep_for_resume(run.work, run.stage, store_format, exc, run.statuses)
            if keep:
                log(f"partial conversion kept in {run.work}; run the same command with --resume on "
                    f"{run.ex.world} ranks to continue")
        raise
    finally:
        if run.lock is not None:
            if run.stage != "check" and not keep:  # (check: this run has not touched the work folder)
                remove_path(run.work)
            if run.stage in ("assemble", "done"):  # (before: it may hold an interrupted single-process run)
                remove_with_siblings(staging_path(dst))
            run.lock.release()


@dataclass
class _RankRun:
    """One rank's distributed conversion: what its phases share."""

    ex: Exchange
    dst: Path
    store_format: Any   # the formats.protocol.Format written
    work: Path
    log: Any
    lock: DestinationLock | None = None   # rank 0, once it holds the destination
    stage: str = "check"  # then "convert", "assemble", "done": what rank 0 keeps for --resume depends on it
    statuses: list[RankStatus] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)


def _hand_out_parts(run: _RankRun, open_src: Any, job_for: Any, overwrite: bool,
                    resume: bool) -> tuple[Any, int, int, bool]:
    """Phase 0: rank 0 checks, locks, scans and hands out ranges; every rank gets
    (its part of the source, the part's first index, the source's length, whether it resumes)."""
    ex, dst, work, log = run.ex, run.dst, run.work, run.log
    error: BaseException | None = None
    parts_msg = None
    if ex.rank == 0:
        try:
            check_destination(dst, overwrite, log)
            candidate = DestinationLock(dst, log)
            candidate.acquire()
            run.lock = candidate  # from here on this conversion owns the work and staging paths
            if run.store_format.keeps_parts:
                check_parts_folder(dst, overwrite)
            source = open_src()
            if source.empty_classes:
                log(f"warning: {len(source.empty_classes)} class folder(s) hold no image and keep their "
                    f"label index: {', '.join(source.empty_classes)}")
            total = len(source)
            plan = json.loads(json.dumps({"ranks": ex.world, "job": job_for(source).fingerprint()}))
            resumed = resume and resumable(work, plan, dst, log)
            if not resumed:
                remove_path(work)
                (work / "parts").mkdir(parents=True)
                write_json(work / PLAN, plan)
            run.stage = "convert"
            for r in failed_ranks(work):  # (markers of the interrupted run)
                (work / f"FAILED-rank-{r:05d}").unlink()
            listing = source.origin_kind == "path"  # small and picklable: send it
            parts_msg = [(source.part(a, b) if listing else (a, b), a, total, resumed)
                         for a, b in part_ranges(total, ex.world)]
            del source
        except Exception as exc:  # noqa: BLE001 - every failure is reported to every rank
            error = exc
    verdict = ex.broadcast(None if error is None else describe_error(error))
    if verdict is not None:
        if error is not None:
            raise error
        raise DistributedError(f"rank 0 could not start the distributed conversion: {verdict}")
    part, first, total, resumed = ex.scatter(parts_msg)
    del parts_msg
    if isinstance(part, tuple):  # an in-memory source: this rank's part of its own copy
        part = open_src().part(*part)
    return part, first, total, resumed


def _convert_part(run: _RankRun, job: Any, first: int, total: int, resumed: bool, progress: bool) -> Any:
    """Phase 1: every rank converts its range into a part; every rank learns how every rank fared
    (and raises if one failed). Returns this rank's job."""
    ex, work = run.ex, run.work
    part_path = work / "parts" / _part_name(ex.rank, run.store_format.suffixes[0])
    status = RankStatus(ex.rank)
    own: BaseException | None = None
    try:
        status.count, status.skipped, status.resumed = convert_part(
            job, part_path, first, total, work, ex.rank, ex.world, progress, run.dst.name, feed_writer,
            finish_writer, resume=resumed, log=run.log)
        status.labels_seen = list(job.labels_seen)
    except BaseException as exc:  # noqa: BLE001 - reported to all ranks, then re-raised below
        own = exc
        status.error = describe_error(exc)
        status.aborted = isinstance(exc, DistributedError)
        status.bad_input = isinstance(exc, SourceError) and not isinstance(exc, SourceChangedError)
        if not status.aborted:
            mark_failed(work, ex.rank)
    run.statuses = ex.gather(status)
    if own is not None and isinstance(own, (KeyboardInterrupt, SystemExit)):
        raise own
    raise_if_failed(run.statuses, ex.rank, own)
    return job


def _assemble_on_rank0(run: _RankRun, part: Any, job: Any, job_for: Any, total: int, overwrite: bool) -> ConvertResult:
    """Phase 2: rank 0 assembles the parts and publishes the store; every rank gets its ConvertResult."""
    ex, dst, statuses, fmt = run.ex, run.dst, run.statuses, run.store_format
    run.stage = "assemble"
    result = None
    error = None
    if ex.rank == 0:
        try:
            count = sum(s.count for s in statuses)
            skipped = [item for s in statuses for item in (s.skipped or [])]
            if count == 0:
                raise SourceError(f"{part.root}: no file could be converted ({len(skipped)} skipped)")
            full_job = job_for(part)  # carries root/classes/spec; samples unused below
            seen = [s.labels_seen for s in statuses if s.labels_seen]
            full_job.labels_seen[:] = [max(x[0] for x in seen), max(x[1] for x in seen)]
            parts = [run.work / "parts" / _part_name(r, fmt.suffixes[0]) for r in range(ex.world)]
            counts = [s.count for s in statuses]
            assemble(full_job, dst, parts, counts, count, skipped, total, overwrite, finish_writer)
            run.stage = "done"
            size = disk_usage(dst)
            if fmt.keeps_parts and hdf5_parts_path(dst).exists():
                size += disk_usage(hdf5_parts_path(dst))
            result = ConvertResult(
                path=dst, store_format=fmt.name, count=count, classes=full_job.classes(), shape=job.shape,
                static=job.spec,
                nbytes=size, seconds=time.perf_counter() - run.start, workers=job.workers, skipped=skipped,
                empty_classes=part.empty_classes, resumed=sum(s.resumed for s in statuses),
                masks=None if job.fields is None else job.fields.mask_dtype)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = exc
    verdict = ex.broadcast(("error", describe_error(error)) if error is not None else ("ok", result))
    if verdict[0] == "error":
        if error is not None:
            raise error
        raise DistributedError(f"rank 0 failed to assemble the store: {verdict[1]}; nothing was written")
    return verdict[1]


