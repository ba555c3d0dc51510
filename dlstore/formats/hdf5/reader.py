"""The hdf5 Reader and its manifest (layout: ``layout.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ...errors import (
    StoreCorruptError,
    StoreNotFoundError,
)
from ...sources.origins import Origins
from ..checks import library_errors_as_damage
from ..hdf5_open import open_readonly
from ..integrity import (
    check_virtual_sources,
    hold_virtual_sources,
    userblock_seal,
)
from ..manifest import loads as load_manifest_text
from ..manifest import validate
from ..pins import StorePin, check_identity
from ..readahead import Extents, choose_willneed
from ..reader import StoreReader
from ..targets import read_hdf5
from .layout import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_ATTR,
    MAX_POINTER_CACHE,
    VLEN_CHUNK,
)


def _open_file(path: Path, **cache: Any) -> h5py.File:
    try:
        return open_readonly(path, **cache)
    except FileNotFoundError:
        raise StoreNotFoundError(f"{path}: no such store") from None
    except OSError as exc:
        raise StoreCorruptError(f"{path}: not a readable HDF5 file ({exc})") from exc


check_seal = userblock_seal   # (the file, None if its user-block seal matches, else the problem or "unsealed")


def _manifest_from(f: h5py.File, path: Path) -> dict[str, Any]:
    if MANIFEST_ATTR not in f.attrs:
        raise StoreCorruptError(f"{path}: no root attribute {MANIFEST_ATTR!r}: not a complete dlstore HDF5 store")
    text = f.attrs[MANIFEST_ATTR]
    if not isinstance(text, (str, bytes)):
        raise StoreCorruptError(f"{path}: root attribute {MANIFEST_ATTR!r} is not a string")
    return load_manifest_text(text, f"{path} (attribute {MANIFEST_ATTR})")


def read_manifest(path: Path) -> dict[str, Any]:
    """The validated manifest of the HDF5 store at ``path``."""
    path = Path(path)
    with _open_file(path) as f, library_errors_as_damage(path):
        return _manifest_from(f, path)


class Hdf5Reader(StoreReader):
    """Reads samples of an HDF5 store into fresh uint8 arrays.

    Args:
        path: the ``.h5`` file.
        manifest: the already-read manifest (read from the store if None).
        chunk_cache_bytes: HDF5 chunk cache per open file (``rdcc_nbytes``); default:
            0 for fixed-shape stores, all pointer chunks (<= 64 MiB) for variable-shape
            stores (see the module doc).
        willneed: before each batch is read, posix_fadvise(WILLNEED) each of its samples' chunks
            (fixed-shape stores in one file), so a cold batch has all its reads in flight at once
            (see ``readahead.py``); None: on only for a store that cannot stay cached.
    """

    format = FORMAT
    _handles = ("_file", "_images")

    def __init__(self, path: str | os.PathLike, manifest: dict[str, Any] | None = None, *,
                 chunk_cache_bytes: int | None = None, willneed: bool | None = None):
        self.path = Path(path)
        self._file: h5py.File | None = None
        self._images: h5py.Dataset | None = None
        self._pid: int | None = None
        self._pin = StorePin(self.path)   # before reading any of it; held while this reader lives: see common
        self._identity = self._pin.identity
        self.sums = None   # SampleSums once enable_sample_check() ran (check="sample")
        # Read the metadata and close again: no HDF5 handle is held here if this process forks workers next.
        with _open_file(self.path) as f, library_errors_as_damage(self.path):
            if manifest is None:
                manifest = _manifest_from(f, self.path)
            validate(manifest, str(self.path), format=FORMAT, max_format_version=FORMAT_VERSION)
            self.manifest = manifest
            self.count: int = manifest["count"]
            layout = manifest["layout"]
            self.kind = layout.get("kind")
            images = self._dataset(f, "images")
            if images.is_virtual:
                check_virtual_sources(self.path, images)
            self.labels = self._int_dataset(f, "labels", (self.count,))
            self.targets = read_hdf5(f, self.path, manifest)   # (N, K), or None: int labels only
            if self.kind == "fixed":
                self.shape: tuple[int, int, int] | None = tuple(manifest["sample"]["shape"])
                self.shapes = None
                if images.dtype != np.uint8 or images.shape != (self.count, *self.shape):
                    raise StoreCorruptError(f"{self.path}: /images holds {images.dtype} {images.shape}, manifest "
                                            f"expects uint8 {(self.count, *self.shape)}")
                self._direct = (images.chunks == (1, *self.shape)
                                and images.id.get_create_plist().get_nfilters() == 0)
            elif self.kind == "variable":
                self.shape = None
                if images.shape != (self.count,) or h5py.check_vlen_dtype(images.dtype) != np.uint8:
                    raise StoreCorruptError(f"{self.path}: /images holds {images.dtype} {images.shape}, manifest "
                                            f"expects vlen uint8 ({self.count},)")
                self.shapes = self._int_dataset(f, "shapes", (self.count, 3))
                if (self.shapes <= 0).any():
                    raise StoreCorruptError(f"{self.path}: /shapes holds non-positive sizes")
                self._direct = False
            else:
                raise StoreCorruptError(f"{self.path}: unknown HDF5 layout kind {self.kind!r}")
        if chunk_cache_bytes is None:
            chunk_cache_bytes = 0 if self.kind == "fixed" else min(MAX_POINTER_CACHE, 16 * self.count + (1 << 20))
        self.chunk_cache_bytes = int(chunk_cache_bytes)
        self.willneed = choose_willneed(willneed, self.count, self.path.stat().st_size / max(1, self.count))
        self._chunk_offsets: np.ndarray | None = None   # file offset of each sample's bytes (see _extents)

    def _dataset(self, f: h5py.File, name: str) -> h5py.Dataset:
        obj = f.get(name)
        if not isinstance(obj, h5py.Dataset):
            raise StoreCorruptError(f"{self.path}: dataset /{name} is missing: not a complete dlstore HDF5 store")
        return obj

    def _int_dataset(self, f: h5py.File, name: str, shape: tuple[int, ...]) -> np.ndarray:
        ds = self._dataset(f, name)
        if ds.dtype.kind not in "iu" or ds.shape != shape:
            raise StoreCorruptError(f"{self.path}: /{name} holds {ds.dtype} {ds.shape}, expected int64 {shape}")
        return ds[()].astype(np.int64)

    def _open(self) -> None:
        if self.chunk_cache_bytes > 0:
            chunk = VLEN_CHUNK * 16 if self.kind == "variable" else max(1, int(np.prod(self.shape)))
            fitting = max(1, self.chunk_cache_bytes // chunk)
            cache = {"rdcc_nbytes": self.chunk_cache_bytes, "rdcc_nslots": _next_prime(min(100 * fitting, 1 << 22)),
                     "rdcc_w0": 1.0}
        else:
            cache = {"rdcc_nbytes": 0, "rdcc_nslots": 1, "rdcc_w0": 1.0}
        self._file = _open_file(self.path, **cache)
        with library_errors_as_damage(self.path):
            self._images = self._file["images"]
            if self._images.is_virtual:   # every part held open from here on (see integrity)
                hold_virtual_sources(self.path, self._images, self.manifest["layout"])
        check_identity(self.path, self._identity)   # after the open: the old store's file, or this raises

    def _load_sums(self, spec: dict[str, Any]) -> np.ndarray:
        with _open_file(self.path) as f, library_errors_as_damage(self.path):   # (a replaced store's sums: no mix)
            return self._dataset(f, str(spec.get("dataset")))[()]

    def origins(self) -> Origins | None:
        """Where each sample came from; None for a store converted before provenance was kept."""
        spec = self.manifest["layout"].get("provenance")
        if spec is None:
            return None
        with _open_file(self.path) as f, library_errors_as_damage(self.path):
            group = f.get("provenance")
            arrays = {name: group[name][()] for name in group} if isinstance(group, h5py.Group) else {}
        check_identity(self.path, self._identity)
        return Origins.from_arrays(spec.get("kind"), arrays, str(self.path), count=self.count)

    def _extents(self, indices: np.ndarray) -> Extents | None:
        """Each sample's chunk in the .h5 file (fixed shapes, not a virtual dataset: a store's parts'
        files are not advised). The chunk index is read once per reader, on first use: one call per
        chunk (``chunk_iter``, ~1-4 us each), where a lookup per sample costs ~100 us."""
        if self.kind != "fixed" or self._images.is_virtual:
            return None
        if self._chunk_offsets is None:
            self._chunk_offsets = self._chunk_table()
        offsets, lengths = self._chunk_offsets[:, 0][indices], self._chunk_offsets[:, 1][indices]
        return Extents([self.path], np.zeros(len(indices), dtype=np.int64), offsets, lengths)

    def _chunk_table(self) -> np.ndarray:
        """(byte offset, bytes) of every sample's chunk; (-1, 0) for one never written."""
        table = np.zeros((self.count, 2), dtype=np.int64)
        table[:, 0] = -1
        ident = self._images.id
        with library_errors_as_damage(self.path):
            if self._images.chunks is None:   # contiguous (not what dlstore writes, but plain HDF5 may be)
                start, size = ident.get_offset(), int(np.prod(self.shape))
                if start is not None:
                    table[:, 0] = start + np.arange(self.count, dtype=np.int64) * size
                    table[:, 1] = size
                return table

            def record(info: Any) -> None:
                row = info.chunk_offset[0]
                if 0 <= row < self.count:
                    table[row] = info.byte_offset, info.size
            if hasattr(ident, "chunk_iter"):   # (h5py built on HDF5 >= 1.14)
                ident.chunk_iter(record)
        return table

    def _read_fixed(self, i: int, out: np.ndarray) -> None:
        """Sample ``i`` into ``out`` (a C-contiguous (C, H, W) uint8 array)."""
        try:
            if self._direct:
                mask, data = self._images.id.read_direct_chunk((i, 0, 0, 0), out=out.reshape(-1))
                if mask != 0 or len(data) != out.size:
                    raise StoreCorruptError(f"{self.path}: chunk of sample {i} holds {len(data)} bytes "
                                            f"(filter mask {mask}), expected {out.size} raw bytes")
            else:
                out[...] = self._images[i]
        except (OSError, KeyError, RuntimeError) as exc:
            raise StoreCorruptError(f"{self.path}: cannot read sample {i} ({exc})") from exc

    def _read_variable(self, i: int) -> np.ndarray:
        c, h, w = (int(v) for v in self.shapes[i])
        try:
            flat = self._images[i]
        except (OSError, KeyError, RuntimeError) as exc:
            raise StoreCorruptError(f"{self.path}: cannot read sample {i} ({exc})") from exc
        if flat.size != c * h * w:
            if self.sums is not None:   # (get checks the sums of what it returns) damage is named as such
                self.sums.check(i, flat)
            raise StoreCorruptError(f"{self.path}: sample {i} holds {flat.size} bytes, /shapes says {c}x{h}x{w}")
        return flat.reshape(c, h, w)

    def _read(self, i: int) -> np.ndarray:
        """Sample ``i`` as a fresh, writable array."""
        if self.shape is None:
            return self._read_variable(i)
        out = np.empty(self.shape, dtype=np.uint8)
        self._read_fixed(i, out)
        return out

    def _read_many(self, indices: list[int]) -> list[np.ndarray]:
        out: list[np.ndarray | None] = [None] * len(indices)
        for k in sorted(range(len(indices)), key=indices.__getitem__):   # in file order
            out[k] = self._read(indices[k])
        return out

    def _read_batch(self, indices: np.ndarray, out: np.ndarray) -> None:
        for k in np.argsort(indices, kind="stable").tolist():   # in file order
            self._read_fixed(int(indices[k]), out[k])


def _next_prime(n: int) -> int:
    # HDF5 hashes chunks into rdcc_nslots slots: a prime count spreads them (h5py docs)
    n = max(2, n)
    while any(n % d == 0 for d in range(2, int(n ** 0.5) + 1)):
        n += 1
    return n
