"""Provenance: where each sample of a store came from, held compactly.

A sample comes from a path (relative to the source's root: folders, list files)
or from an index (datasets, arrays). ``Origins`` holds one or the other for
every sample, as plain arrays each format stores natively:

    kind "index"   indices  int64 (N,)        sample i came from item indices[i]
    kind "path"    offsets  int64 (N + 1,)    path i is blob[offsets[i]:offsets[i + 1]],
                   blob     uint8 (bytes,)    the relative paths, UTF-8 (os.fsencode), concatenated

~8 bytes per sample plus the path bytes, like ``SampleList`` (a list of str
would cost ~100 bytes per sample).
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..errors import SampleIndexError, StoreCorruptError

KINDS = ("index", "path")


class Origins(Sequence):
    """The origin (relative path or source index) of every sample; see the module doc."""

    def __init__(self, kind: str, *, indices: np.ndarray | None = None, offsets: np.ndarray | None = None,
                 blob: bytes | np.ndarray | None = None):
        self.kind = kind
        if kind == "index":
            self.indices = np.asarray(indices, dtype=np.int64)
            self._n = len(self.indices)
        else:
            self.offsets = np.asarray(offsets, dtype=np.int64)
            self.blob = bytes(blob) if not isinstance(blob, bytes) else blob
            self._n = len(self.offsets) - 1

    @classmethod
    def build(cls, kind: str, values: Iterable[str | int]) -> Origins:
        if kind == "index":
            return cls(kind, indices=np.frombuffer(array("q", values), dtype=np.int64).copy())
        blob, ends = bytearray(), array("q", [0])
        for path in values:
            blob += os.fsencode(path)
            ends.append(len(blob))
        return cls(kind, offsets=np.frombuffer(ends, dtype=np.int64).copy(), blob=bytes(blob))

    @classmethod
    def from_arrays(cls, kind: Any, arrays: dict[str, np.ndarray], where: str, *,
                    count: int | None = None) -> Origins:
        """From what a store of ``count`` samples holds, checked (damage raises StoreCorruptError)."""
        origins = cls._from_arrays(kind, arrays, where)
        if count is not None and len(origins) != count:
            raise StoreCorruptError(f"{where}: provenance of {len(origins)} samples, expected {count}")
        return origins

    @classmethod
    def _from_arrays(cls, kind: Any, arrays: dict[str, np.ndarray], where: str) -> Origins:
        missing = {"index": ("indices",), "path": ("offsets", "blob")}.get(kind, ())
        if any(arrays.get(name) is None for name in missing):
            raise StoreCorruptError(f"{where}: provenance {kind} arrays missing (expected {', '.join(missing)})")
        if kind == "index":
            indices = arrays["indices"]
            if indices.dtype != np.int64 or indices.ndim != 1:
                raise StoreCorruptError(f"{where}: provenance indices are {indices.dtype} {indices.shape}, "
                                        "expected int64 (N,)")
            return cls(kind, indices=indices)
        if kind != "path":
            raise StoreCorruptError(f"{where}: unknown provenance kind {kind!r} (index, path)")
        offsets, blob = arrays["offsets"], np.asarray(arrays["blob"], dtype=np.uint8).reshape(-1)
        if (offsets.dtype != np.int64 or offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0
                or offsets[-1] != len(blob) or np.any(np.diff(offsets) < 0)):
            raise StoreCorruptError(f"{where}: provenance offsets do not index the path blob")
        return cls(kind, offsets=offsets, blob=blob.tobytes())

    def arrays(self) -> dict[str, np.ndarray]:
        if self.kind == "index":
            return {"indices": self.indices}
        return {"offsets": self.offsets, "blob": np.frombuffer(self.blob, dtype=np.uint8)}

    @classmethod
    def concat(cls, parts: Sequence[Origins]) -> Origins:
        kind = parts[0].kind
        if kind == "index":
            return cls(kind, indices=np.concatenate([p.indices for p in parts]))
        offsets, base = [np.zeros(1, np.int64)], 0
        for p in parts:
            offsets.append(p.offsets[1:] + base)
            base += len(p.blob)
        return cls(kind, offsets=np.concatenate(offsets), blob=b"".join(p.blob for p in parts))

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int | slice) -> Any:  # type: ignore[override]
        if isinstance(i, slice):   # a list, as slicing ImageFolder.samples gives
            return [self[k] for k in range(*i.indices(self._n))]
        i = _as_index(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise SampleIndexError(f"sample {i} out of range for {self._n} samples")
        if self.kind == "index":
            return int(self.indices[i])
        return os.fsdecode(self.blob[int(self.offsets[i]):int(self.offsets[i + 1])])

    def __repr__(self) -> str:
        return f"Origins({self._n} {self.kind}es)" if self.kind == "index" else f"Origins({self._n} paths)"


def _as_index(i: Any) -> int:
    if isinstance(i, bool) or not hasattr(i, "__index__"):
        raise TypeError(f"sample indices must be integers or slices, not {type(i).__name__}")
    return i.__index__()


class OriginPairs(Sequence):
    """``(origin, target)`` per sample, as ``ImageFolder.samples``: paths joined to ``root``, or indices.

    Built on demand from compact ``Origins`` and int64 labels: no list of tuples is held. The
    target is an int, or for a store of target vectors ((N, K) ``labels``) a tuple of K numbers.
    Slicing gives a list of pairs, as slicing ``ImageFolder.samples`` does.
    """

    def __init__(self, origins: Origins, labels: np.ndarray, root: str | None):
        self.origins, self.labels = origins, labels
        self._prefix = os.path.join(root, "") if origins.kind == "path" and root else ""

    def __len__(self) -> int:
        return len(self.origins)

    def __getitem__(self, i: int | slice) -> Any:  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        i = _as_index(i)
        origin = self.origins[i]   # (checks the range; negative indices count from the end)
        label = self.labels[i + len(self) if i < 0 else i]
        target = int(label) if np.ndim(label) == 0 else tuple(label.tolist())
        return (self._prefix + origin if self._prefix else origin), target

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"OriginPairs({len(self)} samples, {self.origins.kind})"
