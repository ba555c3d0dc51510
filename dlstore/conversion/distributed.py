"""Distributed conversion on ``torch.distributed``: every rank converts a part, rank 0 assembles.

``dlstore.convert`` calls ``convert_distributed`` when it runs inside an
initialised process group of more than one rank (``torchrun --nproc-per-node P
-m dlstore convert SRC DST``: the CLI initialises a gloo group from torchrun's
environment). The destination's folder must be on a filesystem every rank sees.

Phases (each ends with a status exchange: an ``all_gather_object`` over a gloo
group, so every rank learns whether every other rank succeeded)::

    0. rank 0    checks DST, takes its lock, scans SRC once, and hands each rank a
                 contiguous range of the file list (scatter; ranges differ by <= 1 file)
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
             together (the mapping uses a relative path).
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
naming the failing rank and its error), and rank 0 removes the work folder: no
store, complete-looking or not, is left at ``DST``. Resuming is not supported
for distributed conversions.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import (
    ArgumentError,
    ConversionInterrupted,
    DistributedError,
    StoreExistsError,
)
from ..formats._common import (
    DestinationLock,
    _fsync_dir,
    check_destination,
    publish,
    remove_path,
    save_npy_synced,
    staging_path,
    write_synced,
)
from ..formats._integrity import SUMS_ALGORITHM, SUMS_DTYPE, seal_sidecar
from ..formats.manifest import dumps
from .job import ConvertResult, _feed, _finish, disk_usage, manifest_for

DEFAULT_TIMEOUT_S = 2 * 3600  # a collective may wait this long for the slowest rank (scan, conversion)
_CHECK_EVERY = 256


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
    """The shared folder where ranks write their parts (removed when the conversion ends)."""
    return dst.with_name(f".{dst.name}.dlstore-dist")


def hdf5_parts_path(dst: Path) -> Path:
    """Folder holding the per-rank files of a distributed HDF5 store (next to the store)."""
    return dst.with_name(f"{dst.name}.parts")


def _part_name(rank: int, suffix: str) -> str:
    return f"part-{rank:05d}{suffix}"


@dataclass
class _Status:
    rank: int
    error: str | None = None  # "ExcType: message" of a failure
    aborted: bool = False  # stopped because another rank failed
    count: int = 0
    skipped: list[dict[str, Any]] | None = None
    labels_seen: list[int] | None = None  # [largest label, any -1]: names the classes of an unnamed source


class _Exchange:
    """Collectives over the conversion's gloo group, with failures turned into DistributedError."""

    def __init__(self, group: Any):
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, group=self.group, **kwargs)
        except RuntimeError as exc:  # gloo: timeout, or a peer that died
            raise DistributedError(
                f"rank {self.rank}: lost contact with the other ranks of the conversion ({exc}); a rank "
                "crashed or hung: see its log") from exc

    def gather(self, status: _Status) -> list[_Status]:
        out: list[Any] = [None] * self.world
        self._call(self.dist.all_gather_object, out, status)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._call(self.dist.broadcast_object_list, box, src=self._global(0))
        return box[0]

    def scatter(self, objs: list[Any] | None) -> Any:
        box: list[Any] = [None]
        self._call(self.dist.scatter_object_list, box, objs, src=self._global(0))
        return box[0]

    def _global(self, group_rank: int) -> int:
        if self.group is None or self.group is self.dist.group.WORLD:
            return group_rank
        return self.dist.get_global_rank(self.group, group_rank)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _raise_if_failed(statuses: list[_Status], rank: int, own: BaseException | None) -> None:
    """Raise on every rank if any rank failed: a rank's own error, or DistributedError for the others."""
    failed = [s for s in statuses if s.error is not None and not s.aborted]
    if not failed and not any(s.error for s in statuses):
        return
    if own is not None and not isinstance(own, DistributedError):
        raise own
    if not failed:  # only aborts (cannot happen without a first failure, but say something useful)
        failed = [s for s in statuses if s.error is not None]
    first = failed[0]
    others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
    raise DistributedError(f"rank {first.rank} of the distributed conversion failed{others}: {first.error}; "
                           f"rank {rank} stopped too and nothing was written") from own


def convert_distributed(group: Any, open_src: Any, dst: Path, *, module: Any, job_for: Any,
                        overwrite: bool, resume: bool, progress: bool, log: Any) -> Any:
    """Run the conversion ``dlstore.convert`` describes on every rank of ``group``; see the module doc.

    ``open_src()`` opens the source; ``job_for(source)`` builds the conversion's ``_Job`` for a
    part of it. A file listing (folder, list file) is opened by rank 0 and its parts are sent
    to the ranks; an in-memory source (dataset, arrays), which every rank was given, is only
    measured by rank 0 and each rank takes its own part of its own copy.
    Every rank returns the same ConvertResult (``workers`` is per rank).
    """
    ex = _Exchange(group)
    rank, world = ex.rank, ex.world
    if resume:
        raise ArgumentError("resume is not supported for distributed conversions; rerun without --resume")
    fmt = module.FORMAT
    work = work_path(dst)
    lock: DestinationLock | None = None
    start = time.perf_counter()
    try:
        # --- phase 0: rank 0 checks, locks, scans, hands out ranges ---------------------
        error: BaseException | None = None
        parts_msg = None
        if rank == 0:
            try:
                check_destination(dst, overwrite)
                if fmt == "hdf5" and hdf5_parts_path(dst).exists() and not overwrite:
                    raise StoreExistsError(f"{hdf5_parts_path(dst)}: already exists (parts of an HDF5 store); "
                                           "pass overwrite=True (--overwrite) to replace it")
                candidate = DestinationLock(dst)
                candidate.acquire()
                lock = candidate  # from here on this conversion owns the work and staging paths
                source = open_src()
                if source.empty_classes:
                    log(f"warning: {len(source.empty_classes)} class folder(s) hold no image and keep their "
                        f"label index: {', '.join(source.empty_classes)}")
                remove_path(work)
                (work / "parts").mkdir(parents=True)
                total = len(source)
                listing = source.origin_kind == "path"  # small and picklable: send it
                parts_msg = [(source.part(a, b) if listing else (a, b), a, total)
                             for a, b in part_ranges(total, world)]
                del source
            except Exception as exc:  # noqa: BLE001 - every failure is reported to every rank
                error = exc
        verdict = ex.broadcast(None if error is None else _describe(error))
        if verdict is not None:
            if error is not None:
                raise error
            raise DistributedError(f"rank 0 could not start the distributed conversion: {verdict}")
        part, first, total = ex.scatter(parts_msg)
        del parts_msg
        if isinstance(part, tuple):  # an in-memory source: this rank's part of its own copy
            part = open_src().part(*part)

        # --- phase 1: every rank converts its range into a part ---------------------------
        job = job_for(part)
        part_path = work / "parts" / _part_name(rank, module.SUFFIXES[0])
        status = _Status(rank)
        own: BaseException | None = None
        try:
            status.count, status.skipped = _convert_part(job, part_path, first, total, work, rank, world,
                                                         progress, dst.name, _feed, _finish)
            status.labels_seen = list(job.labels_seen)
        except BaseException as exc:  # noqa: BLE001 - reported to all ranks, then re-raised below
            own = exc
            status.error = _describe(exc)
            status.aborted = isinstance(exc, DistributedError)
            if not status.aborted:
                _mark_failed(work, rank)
        statuses = ex.gather(status)
        if own is not None and isinstance(own, (KeyboardInterrupt, SystemExit)):
            raise own
        _raise_if_failed(statuses, rank, own)

        # --- phase 2: rank 0 assembles and publishes ---------------------------------------
        result = None
        error = None
        if rank == 0:
            try:
                count = sum(s.count for s in statuses)
                skipped = [item for s in statuses for item in (s.skipped or [])]
                if count == 0:
                    from ..errors import SourceError

                    raise SourceError(f"{part.root}: no file could be converted ({len(skipped)} skipped)")
                full_job = job_for(part)  # carries root/classes/spec; samples unused below
                seen = [s.labels_seen for s in statuses if s.labels_seen]
                full_job.labels_seen[:] = [max(x[0] for x in seen), max(x[1] for x in seen)]
                parts = [work / "parts" / _part_name(r, module.SUFFIXES[0]) for r in range(world)]
                counts = [s.count for s in statuses]
                _assemble(full_job, dst, parts, counts, count, skipped, total, overwrite, _finish)
                size = disk_usage(dst)
                if fmt == "hdf5" and hdf5_parts_path(dst).exists():
                    size += disk_usage(hdf5_parts_path(dst))
                result = ConvertResult(
                    path=dst, store_format=fmt, count=count, classes=full_job.classes(), shape=job.shape,
                    static=job.spec,
                    nbytes=size, seconds=time.perf_counter() - start, workers=job.workers, skipped=skipped,
                    empty_classes=part.empty_classes)
            except Exception as exc:  # noqa: BLE001 - reported to every rank
                error = exc
        verdict = ex.broadcast(("error", _describe(error)) if error is not None else ("ok", result))
        if verdict[0] == "error":
            if error is not None:
                raise error
            raise DistributedError(f"rank 0 failed to assemble the store: {verdict[1]}; nothing was written")
        result = verdict[1]
        result.workers = job.workers
        return result
    finally:
        if lock is not None:
            remove_path(work)
            remove_path(staging_path(dst))
            lock.release()


def _convert_part(job: Any, part_path: Path, first: int, total: int, work: Path, rank: int, world: int,
                  progress: bool, name: str, feed: Any, finish: Any) -> tuple[int, list[dict[str, str]]]:
    """Convert ``job.source`` (this rank's range) into the part store ``part_path``."""
    from tqdm.auto import tqdm

    def check() -> None:
        failed = _failed_ranks(work)
        if failed:
            raise DistributedError(f"rank {failed[0]} failed; rank {rank} stopped converting")

    skipped: list[dict[str, str]] = []
    writer = job.module.Writer(part_path, shape=job.record_shape, **job.options)
    try:
        with tqdm(total=len(job.source), unit="img", dynamic_ncols=True, disable=not progress or rank != 0,
                  desc=f"convert {name} [rank {rank}/{world}: files {first}..{first + len(job.source)} "
                       f"of {total}]") as bar:
            feed(job, writer, 0, skipped, bar, check=check)
        count = len(job.source) - len(skipped)
        finish(job, writer, count, skipped, files=len(job.source))
    finally:
        writer.close()
    check()
    return count, skipped


def _mark_failed(work: Path, rank: int) -> None:
    try:
        (work / f"FAILED-rank-{rank:05d}").touch()
    except OSError:
        pass  # the status exchange still reports the failure; the marker only stops others early


def _failed_ranks(work: Path) -> list[int]:
    try:
        names = os.listdir(work)
    except OSError:
        return []
    return sorted(int(n[len("FAILED-rank-"):]) for n in names if n.startswith("FAILED-rank-"))


# --- assembly on rank 0 ---------------------------------------------------------------------

def _assemble(job: Any, dst: Path, parts: list[Path], counts: list[int], count: int,
              skipped: list[dict[str, str]], total: int, overwrite: bool, finish: Any) -> None:
    staged = staging_path(dst)
    remove_path(staged)
    fmt = job.module.FORMAT
    if fmt == "shards":
        layout, checksums = _assemble_shards(parts, staged)
    elif fmt == "hdf5":
        layout, checksums = _assemble_hdf5(parts, counts, staged, dst)
    elif fmt == "lmdb":
        _merge_lmdb(job, parts, staged, count, skipped, total, finish)
        publish(staged, dst, overwrite)
        return
    else:  # pragma: no cover - every registered format is handled above
        raise ArgumentError(f"distributed conversion does not know how to assemble {fmt!r} stores")

    manifest = manifest_for(job, count=count, skipped=skipped, files=total, checksums=checksums, layout=layout)
    if fmt == "shards":
        write_synced(staged / "manifest.json", dumps(manifest).encode("utf-8"))
        seal_sidecar(staged / "manifest.json")
        publish(staged, dst, overwrite)
    else:
        import h5py

        with h5py.File(staged, "r+") as f:
            f.attrs["dlstore"] = dumps(manifest)
        with open(staged, "rb+") as f:
            os.fsync(f.fileno())
        _publish_hdf5(parts[0].parent, staged, dst, overwrite)




def _assemble_shards(parts: list[Path], staged: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Move every part's data files into ``staged`` (renames, no copy); concatenate labels/index."""
    from ..formats.shards import ShardReader, read_manifest
    from ..sources.origins import Origins

    staged.mkdir()
    files: list[dict[str, Any]] = []
    checksums: dict[str, str] = {}
    labels, indexes, sums = [], [], []
    kind = per_shard = None
    origins = []
    for r, part in enumerate(parts):
        m = read_manifest(part)
        origins.append(ShardReader(part, m).origins())
        layout = m["layout"]
        kind = layout["kind"]
        per_shard = layout.get("per_shard", per_shard)
        entries = layout["shards"] if kind == "fixed" else layout["files"]
        if kind == "variable":
            index = np.load(part / layout["index"], allow_pickle=False)
            index[:, 0] += len(files)
            indexes.append(index)
        labels.append(np.load(part / layout["labels"], allow_pickle=False))
        sums.append(np.load(part / layout["sample_sums"]["file"], allow_pickle=False))
        for entry in entries:
            name = f"rank{r:05d}-{entry['file']}"
            os.replace(part / entry["file"], staged / name)
            files.append({"file": name, "count": int(entry["count"])})
            checksums[name] = m["checksums"]["files"][entry["file"]]
    layout_out: dict[str, Any] = {"labels": "labels.npy", "kind": kind, "ranks": len(parts)}
    if kind == "fixed":
        layout_out.update(per_shard=per_shard, shards=files)
    else:
        checksums["index.npy"] = save_npy_synced(staged / "index.npy", np.concatenate(indexes).astype(np.int64))
        layout_out.update(files=files, index="index.npy")
    checksums["labels.npy"] = save_npy_synced(staged / "labels.npy", np.concatenate(labels).astype(np.int64))
    checksums["crc32.npy"] = save_npy_synced(staged / "crc32.npy", np.concatenate(sums).astype(SUMS_DTYPE))
    layout_out["sample_sums"] = {"algorithm": SUMS_ALGORITHM, "file": "crc32.npy"}
    merged = Origins.concat(origins)
    files = {name: f"provenance-{name}.npy" for name in merged.arrays()}
    for name, values in merged.arrays().items():
        checksums[files[name]] = save_npy_synced(staged / files[name], values)
    layout_out["provenance"] = {"kind": merged.kind, "files": files}
    _fsync_dir(staged)
    return layout_out, checksums


def _assemble_hdf5(parts: list[Path], counts: list[int], staged: Path,
                   dst: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Write the main file: /labels, /shapes, and /images as a virtual dataset over the parts."""
    import h5py

    from ..formats.hdf5 import LIBVER, VLEN_CHUNK
    from ..sources.origins import Origins

    origins = []

    folder = hdf5_parts_path(dst).name
    samples = hashlib.sha256()
    labels, shapes, sums = [], [], []
    layout: dict[str, Any] = {}
    sources = []
    n = 0
    for part, expected in zip(parts, counts):
        with h5py.File(part, "r", locking=False) as f:
            m = json.loads(f.attrs["dlstore"])
            layout = m["layout"]
            images = f["images"]
            k = images.shape[0]
            if k != expected:
                raise ConversionInterrupted(f"{part}: holds {k} samples, its rank reported {expected}")
            labels.append(f["labels"][()])
            sums.append(f[layout["sample_sums"]["dataset"]][()])
            group = f["provenance"]
            origins.append(Origins.from_arrays(layout["provenance"]["kind"], {k: group[k][()] for k in group},
                                               str(part)))
            variable = layout["kind"] == "variable"
            if variable:
                shapes.append(f["shapes"][()])
            step = 4096 if variable else max(1, (64 << 20) // max(1, int(np.prod(images.shape[1:]))))
            for a in range(0, k, step):
                block = images[a:a + step]
                if variable:
                    for record in block:
                        samples.update(np.ascontiguousarray(record).data)
                else:
                    samples.update(np.ascontiguousarray(block).data)
            if k:
                sources.append((n, k, f"{folder}/{part.name}", images.shape, images.dtype))
            n += k
    variable = layout["kind"] == "variable"
    dtype = h5py.vlen_dtype(np.uint8) if variable else np.uint8
    shape = (n,) if variable else (n, *sources[0][3][1:])
    vlayout = h5py.VirtualLayout(shape=shape, dtype=dtype)
    for a, k, name, part_shape, _ in sources:
        vlayout[a:a + k] = h5py.VirtualSource(name, "images", shape=part_shape, dtype=dtype)
    all_labels = np.concatenate(labels).astype("<i8")
    all_sums = np.concatenate(sums).astype(SUMS_DTYPE)
    checksums = {"samples": samples.hexdigest(), "labels": hashlib.sha256(all_labels.tobytes()).hexdigest(),
                 "crc32": hashlib.sha256(all_sums.tobytes()).hexdigest()}
    with h5py.File(staged, "w", libver=LIBVER) as f:
        f.create_virtual_dataset("images", vlayout)
        f.create_dataset("labels", data=all_labels)
        f.create_dataset("crc32", data=all_sums)
        if variable:
            all_shapes = np.concatenate(shapes).astype("<i8").reshape(-1, 3)
            f.create_dataset("shapes", data=all_shapes, chunks=(VLEN_CHUNK, 3) if n else None,
                             maxshape=(None, 3) if n else None)
            checksums["shapes"] = hashlib.sha256(all_shapes.tobytes()).hexdigest()
        merged = Origins.concat(origins)
        group = f.create_group("provenance")
        for name, values in merged.arrays().items():
            group.create_dataset(name, data=values)
    layout = dict(layout)
    layout.pop("chunks", None)
    layout["provenance"] = {"kind": merged.kind, "group": "provenance"}
    layout["virtual"] = {"folder": folder, "parts": [{"file": p.name, "count": c} for p, c in zip(parts, counts)]}
    return layout, checksums


def _publish_hdf5(parts_dir: Path, staged: Path, dst: Path, overwrite: bool) -> None:
    """Move the parts folder next to ``dst``, then publish the main file (which maps it)."""
    final = hdf5_parts_path(dst)
    old = final.with_name(f".{final.name}.dlstore-old")
    if final.exists():
        if not overwrite:
            raise StoreExistsError(f"{final}: already exists; pass overwrite=True (--overwrite) to replace it")
        remove_path(old)
        os.replace(final, old)
    os.replace(parts_dir, final)
    publish(staged, dst, overwrite)
    remove_path(old)


def _merge_lmdb(job: Any, parts: list[Path], staged: Path, count: int, skipped: list[dict[str, str]],
                total: int, finish: Any) -> None:
    """Copy the parts' records in order into one environment at ``staged`` (the documented merge step)."""
    from ..formats.lmdb import LmdbReader
    from ..sources.origins import Origins

    writer = job.module.Writer(staged, shape=job.record_shape, **job.options)
    origins = []
    try:
        for part in parts:
            reader = LmdbReader(part, readahead=True)
            origins.append(reader.origins())
            for lo in range(0, len(reader), 1024):
                hi = min(len(reader), lo + 1024)
                for sample, label in zip(reader.get_many(list(range(lo, hi))), reader.labels[lo:hi].tolist()):
                    writer.add(sample, label)
            del reader
        finish(job, writer, count, skipped, files=total, origins=Origins.concat(origins))
    finally:
        writer.close()
