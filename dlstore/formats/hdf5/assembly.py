"""A distributed conversion's HDF5 parts, mapped into one store on rank 0.

The main file holds ``/labels``, ``/crc32``, ``/shapes``, ``/targets`` and the provenance, and
``/images`` as a virtual dataset over the parts, which stay in a folder beside the store.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ...errors import ConversionInterrupted
from ...sources.origins import Origins
from ..integrity import SUMS_DTYPE
from ..targets import digest, read_hdf5
from .layout import LIBVER, VLEN_CHUNK
from .opening import open_readonly


def assemble_parts(parts: list[Path], counts: list[int], staged: Path,
                   folder: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Write the main file: /labels, /shapes, and /images as a virtual dataset over the parts,
    which lie in the folder ``folder`` beside it."""
    origins = []
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
    # overwrite publishes its parts under the same names before its main file: virtual.hold_virtual_sources)
    layout["virtual"] = {"folder": folder, "parts": [{"file": p.name, "count": c, "checksums": s}
                                                     for p, c, s in zip(parts, counts, part_checksums)]}
    return layout, checksums
