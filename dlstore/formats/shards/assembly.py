"""A distributed conversion's shards parts, assembled into one store on rank 0.

Every part's data files are renamed into the staged store (no copy) under rank-prefixed names;
labels, sums, targets, the variable-shape index and the provenance are concatenated.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ...sources.origins import Origins
from ..integrity import SUMS_ALGORITHM, SUMS_DTYPE
from ..synced import fsync_dir, save_npy_synced
from ..targets import read_shards
from .reader import ShardReader, read_manifest


def assemble_parts(parts: list[Path], staged: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Move every part's data files into ``staged`` (renames, no copy); concatenate labels/index."""
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
