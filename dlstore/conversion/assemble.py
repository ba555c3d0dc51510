"""Assembly of a distributed conversion's parts on rank 0 (see ``distributed`` for the phases).

Per format: a shards store gets its parts' data files renamed into it under one manifest; an
HDF5 store maps its parts (moved to ``DST.parts``) with a virtual dataset; LMDB parts are merged
into one environment. The store reads exactly like a single-process conversion's.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArgumentError, ConversionInterrupted, StoreExistsError
from ..formats.integrity import SUMS_ALGORITHM, SUMS_DTYPE, seal_sidecar
from ..formats.manifest import dumps
from ..formats.synced import save_npy_synced, write_synced
from .destination import fsync_dir, publish, remove_path, staging_path
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
    hold their parts open: see formats.integrity.hold_virtual_sources)."""
    parts = hdf5_parts_path(dst)
    if parts.is_dir() and not parts.is_symlink() and all(_PART_FILE.fullmatch(n) for n in os.listdir(parts)):
        remove_path(parts)


# --- assembly on rank 0 ---------------------------------------------------------------------

def assemble(job: Any, dst: Path, parts: list[Path], counts: list[int], count: int,
              skipped: list[dict[str, str]], total: int, overwrite: bool, finish: Any) -> None:
    staged = staging_path(dst)
    remove_with_siblings(staged)
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
    from ..formats.targets import read_shards
    from ..sources.origins import Origins

    staged.mkdir()
    files: list[dict[str, Any]] = []
    checksums: dict[str, str] = {}
    labels, indexes, sums, targets = [], [], [], []
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
        targets.append(read_shards(part, m))
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
    if targets[0] is not None:   # target vectors: one (N, K) array, as a single writer saves it
        checksums["targets.npy"] = save_npy_synced(staged / "targets.npy", np.concatenate(targets))
        layout_out["targets"] = "targets.npy"
    layout_out["sample_sums"] = {"algorithm": SUMS_ALGORITHM, "file": "crc32.npy"}
    merged = Origins.concat(origins)
    files = {name: f"provenance-{name}.npy" for name in merged.arrays()}
    for name, values in merged.arrays().items():
        checksums[files[name]] = save_npy_synced(staged / files[name], values)
    layout_out["provenance"] = {"kind": merged.kind, "files": files}
    fsync_dir(staged)
    return layout_out, checksums


def _assemble_hdf5(parts: list[Path], counts: list[int], staged: Path,
                   dst: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Write the main file: /labels, /shapes, and /images as a virtual dataset over the parts."""
    import h5py

    from ..formats.hdf5 import LIBVER, VLEN_CHUNK
    from ..formats.hdf5_open import open_readonly
    from ..formats.targets import digest, read_hdf5
    from ..sources.origins import Origins

    origins = []

    folder = hdf5_parts_path(dst).name
    samples = hashlib.sha256()
    labels, shapes, sums, targets = [], [], [], []
    layout: dict[str, Any] = {}
    sources = []
    part_checksums = []
    n = 0
    for part, expected in zip(parts, counts):
        with open_readonly(part) as f:
            m = json.loads(f.attrs["dlstore"])
            part_checksums.append(m["checksums"]["files"])
            layout = m["layout"]
            images = f["images"]
            k = images.shape[0]
            if k != expected:
                raise ConversionInterrupted(f"{part}: holds {k} samples, its rank reported {expected}")
            labels.append(f["labels"][()])
            targets.append(read_hdf5(f, part, m))
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
        if targets[0] is not None:   # the parts' layout names /targets and its hash already
            all_targets = np.concatenate(targets)
            f.create_dataset("targets", data=all_targets)
            checksums["targets"] = digest(all_targets)
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
    # each part's own checksums: a reader checks that the part it opens by name is this store's (an
    # overwrite publishes its parts under the same names before its main file: integrity.hold_virtual_sources)
    layout["virtual"] = {"folder": folder, "parts": [{"file": p.name, "count": c, "checksums": s}
                                                     for p, c, s in zip(parts, counts, part_checksums)]}
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
    try:
        publish(staged, dst, overwrite)
    except BaseException:  # put everything back: the old store keeps its parts
        os.replace(final, parts_dir)
        if old.exists():
            os.replace(old, final)
        raise
    remove_path(old)


def _merge_lmdb(job: Any, parts: list[Path], staged: Path, count: int, skipped: list[dict[str, str]],
                total: int, finish: Any) -> None:
    """Copy the parts' records in order into one environment at ``staged`` (the documented merge step)."""
    from ..formats.lmdb import LmdbReader
    from ..formats.targets import TargetRows
    from ..sources.origins import Origins

    writer = job.module.Writer(staged, shape=job.record_shape, **job.options)
    origins = []
    if job.targets is not None:   # the merged store's rows: every part's, in order (finish writes them)
        job.targets = TargetRows(job.targets.length, job.targets.dtype)
    try:
        for part in parts:
            reader = LmdbReader(part, readahead=True)
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
