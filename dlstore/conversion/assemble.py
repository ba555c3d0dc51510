"""Assembly of a distributed conversion's parts on rank 0 (see ``distributed`` for the phases).

Each format says how (``formats.protocol.Format``): a shards store gets its parts' data files
renamed into it under one manifest; an HDF5 store maps its parts (moved to ``DST.parts``, beside
it) with a virtual dataset; LMDB parts are merged record by record through its Writer. The store
reads exactly like a single-process conversion's.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path
from typing import Any

from ..errors import StoreExistsError
from .destination import publish, remove_path, staging_path
from .job import manifest_for

_PART_FILE = re.compile(r"part-\d{5}\.h5")


def hdf5_parts_path(dst: Path) -> Path:
    """Folder holding the per-rank files of a distributed HDF5 store (next to the store)."""
    return dst.with_name(f"{dst.name}.parts")


def remove_with_siblings(path: Path) -> None:
    """Remove ``path`` and what a file-type writer keeps beside it (``NAME.*``)."""
    for p in [path, *path.parent.glob(glob.escape(path.name) + ".*")]:
        remove_path(p)


def check_parts_folder(dst: Path, overwrite: bool) -> None:
    """Refuse a ``DST.parts`` path that is not the parts folder of an HDF5 store: never replace a user's path."""
    parts = hdf5_parts_path(dst)
    if not (parts.exists() or parts.is_symlink()):
        return
    if not overwrite:
        raise StoreExistsError(f"{parts}: already exists (the parts of an HDF5 store?); pass overwrite=True "
                               "(--overwrite) to replace it")
    foreign = ([parts.name] if parts.is_symlink() or not parts.is_dir()
               else sorted(n for n in os.listdir(parts) if not _PART_FILE.fullmatch(n)))
    if foreign:
        raise StoreExistsError(f"{parts}: is not the parts folder of a distributed HDF5 store (it holds "
                               f"{foreign[0]}), and the store's parts go there; move it away (overwrite=True "
                               "replaces only a store's own parts)")


def remove_old_parts(dst: Path) -> None:
    """After a single-process HDF5 store replaced a distributed one at ``dst``: remove the old
    store's ``DST.parts`` folder, if it holds nothing but part files (readers of the old store
    hold their parts open: see formats.hdf5.virtual.hold_virtual_sources)."""
    parts = hdf5_parts_path(dst)
    if parts.is_dir() and not parts.is_symlink() and all(_PART_FILE.fullmatch(n) for n in os.listdir(parts)):
        remove_path(parts)


# --- assembly on rank 0 ---------------------------------------------------------------------

def assemble(job: Any, dst: Path, parts: list[Path], counts: list[int], count: int,
              skipped: list[dict[str, str]], total: int, overwrite: bool, finish: Any) -> None:
    staged = staging_path(dst)
    remove_with_siblings(staged)
    fmt = job.store_format
    if fmt.merges_parts:
        _merge_parts(job, parts, staged, count, skipped, total, finish)
        publish(staged, dst, overwrite)
        return
    layout, checksums = fmt.assemble_parts(parts, counts, staged, hdf5_parts_path(dst).name)
    manifest = manifest_for(job, count=count, skipped=skipped, files=total, checksums=checksums, layout=layout)
    fmt.write_manifest(staged, manifest)
    if fmt.keeps_parts:
        publish_with_parts(parts[0].parent, staged, dst, overwrite)
    else:
        publish(staged, dst, overwrite)


def publish_with_parts(parts_dir: Path, staged: Path, dst: Path, overwrite: bool) -> None:
    """Move the parts folder next to ``dst``, then publish the main file (which maps it)."""
    final = hdf5_parts_path(dst)
    old = final.with_name(f".{final.name}.dlstore-old")
    if final.exists():
        if not overwrite:
            raise StoreExistsError(f"{final}: already exists; pass overwrite=True (--overwrite) to replace it")
        remove_path(old)
        os.replace(final, old)
    os.replace(parts_dir, final)
    try:
        publish(staged, dst, overwrite)
    except BaseException:  # put everything back: the old store keeps its parts
        os.replace(final, parts_dir)
        if old.exists():
            os.replace(old, final)
        raise
    remove_path(old)


def _merge_parts(job: Any, parts: list[Path], staged: Path, count: int, skipped: list[dict[str, str]],
                 total: int, finish: Any) -> None:
    """Copy the parts' records in order into one store at ``staged`` through the format's Writer."""
    from ..formats.targets import TargetRows
    from ..sources.origins import Origins

    writer = job.store_format.Writer(staged, shape=job.record_shape, **job.options)
    origins = []
    if job.targets is not None:   # the merged store's rows: every part's, in order (finish writes them)
        job.targets = TargetRows(job.targets.length, job.targets.dtype)
    try:
        for part in parts:
            reader = job.store_format.merge_reader(part)
            origins.append(reader.origins())
            if job.targets is not None:
                for row in reader.targets:
                    job.targets.append(row)
            for lo in range(0, len(reader), 1024):
                hi = min(len(reader), lo + 1024)
                for sample, label in zip(reader.get_many(list(range(lo, hi))), reader.labels[lo:hi].tolist()):
                    writer.add(sample, label)
            del reader
        finish(job, writer, count, skipped, files=total, origins=Origins.concat(origins))
    finally:
        writer.close()
