"""Target vectors: a fixed-length numeric target per sample, next to (not instead of) the labels.

A store converted from targets of K numbers per sample (multi-label 0/1 vectors,
regression values) holds them as one (N, K) array, in each format's native place;
its ``labels`` are then all -1 and its ``classes`` empty::

    manifest "targets"       {"dtype": "int64" | "float32", "shape": [K]}
    shards                   targets.npy             (N, K), layout["targets"] = "targets.npy"
    HDF5                     dataset /targets        (N, K), layout["targets"] = "targets"
    LMDB                     key b"__targets__"      the (N, K) array as .npy bytes,
                                                     layout["targets_key"] = "__targets__"

The shards file is covered by the manifest's per-file sha256 like every other
file; for LMDB and HDF5 ``checksums.files["targets"]`` is the sha256 of the array's
little-endian bytes (and the whole-file seal covers it too). Stores without
target vectors have none of these keys: their layout is unchanged.

Integers (and booleans) are stored as int64, floats as float32.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import StoreCorruptError

DTYPES = ("int64", "float32")
LMDB_KEY = b"__targets__"
HASHED = "the (N, K) target vectors as little-endian bytes of their dtype"   # layout["hashed"]["targets"]
PARTIAL_SUFFIX = ".targets"   # beside a conversion's progress.json: rows of the written samples


def describe(targets: np.ndarray) -> dict[str, Any]:
    """The manifest's ``targets`` entry for an (N, K) array."""
    return {"dtype": str(targets.dtype), "shape": [int(targets.shape[1])]}


def digest(targets: np.ndarray) -> str:
    """sha256 of the array's little-endian bytes (LMDB, HDF5 ``checksums.files["targets"]``)."""
    values = np.ascontiguousarray(targets, dtype=targets.dtype.newbyteorder("<"))
    return hashlib.sha256(values.tobytes()).hexdigest()


def npy_bytes(targets: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(targets, dtype=targets.dtype.newbyteorder("<")), allow_pickle=False)
    return buf.getvalue()


def check(values: Any, manifest: dict[str, Any], where: str) -> np.ndarray:
    """``values`` as the (N, K) array the manifest describes, or StoreCorruptError."""
    spec = manifest["targets"]
    expected = (manifest["count"], spec["shape"][0])
    arr = np.asarray(values)
    if arr.dtype.kind not in "iuf" or arr.dtype.itemsize != np.dtype(spec["dtype"]).itemsize \
            or arr.dtype.kind != np.dtype(spec["dtype"]).kind or arr.shape != expected:
        raise StoreCorruptError(f"{where}: targets hold {arr.dtype} {arr.shape}, the manifest expects "
                                f"{spec['dtype']} {expected}")
    return np.ascontiguousarray(arr, dtype=spec["dtype"])


def from_npy(data: bytes, manifest: dict[str, Any], where: str) -> np.ndarray:
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exc:
        raise StoreCorruptError(f"{where}: targets are not a readable .npy array ({type(exc).__name__}: "
                                f"{exc})") from exc
    return check(arr, manifest, where)


def read_shards(path: Path, manifest: dict[str, Any]) -> np.ndarray | None:
    """The targets of a shards store (None: it has none)."""
    if "targets" not in manifest:
        return None
    name = manifest["layout"].get("targets")
    if not isinstance(name, str) or os.path.basename(name) != name or not name:
        raise StoreCorruptError(f"{path}: the manifest declares targets but names no targets file")
    try:
        data = (path / name).read_bytes()
    except FileNotFoundError:
        raise StoreCorruptError(f"{path / name}: missing targets file named in the manifest") from None
    return from_npy(data, manifest, str(path / name))


def read_hdf5(f: Any, path: Path, manifest: dict[str, Any]) -> np.ndarray | None:
    """The targets of an open HDF5 store (None: it has none)."""
    if "targets" not in manifest:
        return None
    name = manifest["layout"].get("targets")
    obj = f.get(name) if isinstance(name, str) else None
    if obj is None or not hasattr(obj, "dtype") or obj.dtype.kind not in "iuf":
        raise StoreCorruptError(f"{path}: the manifest declares targets but /{name} is not a numeric dataset")
    return check(obj[()], manifest, f"{path} (/{name})")


def read_lmdb(txn: Any, path: Path, manifest: dict[str, Any]) -> np.ndarray | None:
    """The targets of an LMDB store, read in ``txn`` (None: it has none)."""
    if "targets" not in manifest:
        return None
    key = str(manifest["layout"].get("targets_key", LMDB_KEY.decode())).encode()
    data = txn.get(key)
    if data is None:
        raise StoreCorruptError(f"{path}: the manifest declares targets but key {key.decode()} is missing")
    return from_npy(bytes(data), manifest, f"{path} (key {key.decode()})")


class WithTargets:
    """Writer mixin: ``set_targets(array)`` before ``finish``, which stores them (see the module doc)."""

    targets: np.ndarray | None = None

    def set_targets(self, targets: np.ndarray) -> None:
        """The (N, K) int64 or float32 target vectors of the N samples written."""
        self.targets = targets


class TargetRows:
    """The target vectors of the samples converted so far, in order, K values of ``dtype`` each.

    At each checkpoint ``save`` appends the rows not saved yet to a file beside the
    staging store (raw little-endian values, no header) and fsyncs it; ``restore``
    reads back the rows a checkpoint counts.
    """

    def __init__(self, length: int, dtype: Any):
        self.length = int(length)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.row_bytes = self.length * self.dtype.itemsize
        self._buf = bytearray()
        self.saved = 0

    def __len__(self) -> int:
        return len(self._buf) // self.row_bytes

    def append(self, row: np.ndarray) -> None:
        self._buf += np.ascontiguousarray(row, dtype=self.dtype).tobytes()

    def array(self) -> np.ndarray:
        return np.frombuffer(bytes(self._buf), dtype=self.dtype).reshape(-1, self.length).astype(
            self.dtype.newbyteorder("="))

    def save(self, path: Path, rows: int) -> None:
        with open(path, "ab") as f:
            f.write(self._buf[self.saved * self.row_bytes:rows * self.row_bytes])
            f.flush()
            os.fsync(f.fileno())
        self.saved = rows

    def restore(self, path: Path, rows: int) -> None:
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            data = b""
        if len(data) < rows * self.row_bytes:
            raise StoreCorruptError(f"{path}: holds {len(data) // self.row_bytes} target rows, the checkpoint "
                                    f"counts {rows}; rerun without --resume")
        self._buf = bytearray(data[:rows * self.row_bytes])
        with open(path, "r+b") as f:   # rows written after the checkpoint are dropped
            f.truncate(rows * self.row_bytes)
        self.saved = rows
