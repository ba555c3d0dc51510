"""The hdf5 Reader and its manifest (layout: ``layout.py``)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ...errors import (
    ArgumentError,
    StoreCorruptError,
    StoreNotFoundError,
)
from ...sources.origins import Origins
from ..checks import library_errors_as_damage
from ..inplace import IN_PLACE, NATIVE, inside, map_file, views
from ..integrity import userblock_seal
from ..manifest import loads as load_manifest_text
from ..manifest import validate
from ..pins import StorePin, check_identity
from ..readahead import Extents, choose_willneed, readahead_default
from ..reader import StoreReader
from ..targets import read_hdf5
from .opening import open_readonly
from .virtual import check_virtual_sources, hold_virtual_sources
from .layout import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_ATTR,
    MAX_CHUNK_CACHE,
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
    """Reads samples of an HDF5 store: in place from a map of the file where /images allows it,
    else through h5py into fresh uint8 arrays.

    In place (``read_path``): a fixed-shape /images whose chunks are uncompressed and hold whole
    samples (dlstore writes one per chunk), or stored contiguously, has every sample at a known
    offset of the file, read once per reader from the chunk index (``_sample_table``); a batch
    is gathered from a map of the file (``inplace.py``). Anything else (filtered chunks, chunks
    that split a sample, a chunk never written, variable-length samples, a virtual dataset)
    reads through h5py, and ``read_path_reason`` says why.

    Args:
        path: the ``.h5`` file.
        manifest: the already-read manifest (read from the store if None).
        chunk_cache_bytes: HDF5 chunk cache per open file (``rdcc_nbytes``); default:
            0 for fixed-shape stores of one sample per chunk, two chunks where a chunk holds
            several (read natively, in file order, each chunk decoded once), all pointer chunks
            (<= 64 MiB) for variable-shape stores (see the module doc).
        willneed: before each batch is read, posix_fadvise(WILLNEED) each of its samples' chunks
            (fixed-shape stores in one file), so a cold batch has all its reads in flight at once
            (see ``readahead.py``); None: on only for a store that cannot stay cached.
        readahead: OS readahead on the map of the file (in place); default: on where the file
            fits in half the memory (``readahead.readahead_default``).
        in_place: False reads every sample through h5py (``read_path`` "native").
    """

    format = FORMAT
    _handles = ("_file", "_images", "_data", "_table_lock")

    def __init__(self, path: str | os.PathLike, manifest: dict[str, Any] | None = None, *,
                 chunk_cache_bytes: int | None = None, willneed: bool | None = None,
                 readahead: bool | None = None, in_place: bool = True):
        self.path = Path(path)
        self._file: h5py.File | None = None
        self._images: h5py.Dataset | None = None
        self._data: np.ndarray | None = None      # a map of the file (in place)
        self._pid: int | None = None
        if not isinstance(in_place, bool):
            raise ArgumentError(f"in_place must be True or False, got {in_place!r}")
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
                # samples per chunk (a contiguous dataset: one sample per place)
                self._rows = images.chunks[0] if images.chunks is not None else 1
            elif self.kind == "variable":
                self.shape = None
                if images.shape != (self.count,) or h5py.check_vlen_dtype(images.dtype) != np.uint8:
                    raise StoreCorruptError(f"{self.path}: /images holds {images.dtype} {images.shape}, manifest "
                                            f"expects vlen uint8 ({self.count},)")
                self.shapes = self._int_dataset(f, "shapes", (self.count, 3))
                if (self.shapes <= 0).any():
                    raise StoreCorruptError(f"{self.path}: /shapes holds non-positive sizes")
                self._direct = False
                self._rows = 1
            else:
                raise StoreCorruptError(f"{self.path}: unknown HDF5 layout kind {self.kind!r}")
            self.read_path, self.read_path_reason = _choose_path(images, self.shape, in_place)
        if chunk_cache_bytes is None:
            if self.kind == "variable":
                chunk_cache_bytes = min(MAX_POINTER_CACHE, 16 * self.count + (1 << 20))
            else:
                chunk_cache_bytes = 0 if self._rows == 1 else min(2 * self._rows * int(np.prod(self.shape)),
                                                                  MAX_CHUNK_CACHE)
        self.chunk_cache_bytes = int(chunk_cache_bytes)
        file_bytes = self.path.stat().st_size
        self.willneed = choose_willneed(willneed, self.count, file_bytes / max(1, self.count))
        self.readahead = readahead_default(file_bytes) if readahead is None else bool(readahead)
        # (offsets, lengths), each (count,): in place each sample's bytes, else its chunk's
        # (offset -1: never written); read once per reader (see _sample_table)
        self._table: tuple[np.ndarray, np.ndarray] | None = None

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
        if self.read_path == IN_PLACE:
            self._data = map_file(self.path, self.readahead)
        self._table_lock = threading.Lock()
        check_identity(self.path, self._identity)   # after the opens: the old store's file, or this raises

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
        """Each sample's bytes (in place) or chunk in the .h5 file (fixed shapes, not a virtual
        dataset: a store's parts' files are not advised)."""
        if self.kind != "fixed" or self._images.is_virtual:
            return None
        offsets, lengths = self._sample_table()
        return Extents([self.path], np.zeros(len(indices), dtype=np.int64), offsets[indices], lengths[indices])

    def _in_place(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        data = self._data
        if data is None or self.read_path != IN_PLACE or not len(indices):
            return None
        offsets, _ = self._sample_table()
        return (data, offsets[indices]) if self.read_path == IN_PLACE else None

    def _sample_table(self) -> tuple[np.ndarray, np.ndarray]:
        """(offset, bytes) of each sample in the file, read once per reader on first use: its own
        bytes where it is read in place, else its chunk's (-1, 0: a chunk never written). The
        chunk index is read in one call per chunk (``chunk_iter``, ~1-4 us each), where a lookup
        per sample costs ~100 us. A layout that turns out not to allow the in-place read (a
        chunk never written or of an unexpected size) switches this reader to h5py's reads."""
        table = self._table
        if table is not None:
            return table
        with self._table_lock:
            if self._table is None:
                with library_errors_as_damage(self.path):
                    start, size, mask = self._chunk_places()
                self._table = self._place_samples(start, size, mask)
            return self._table

    def _chunk_places(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(byte offset, stored bytes, filter mask) of each sample's chunk; (-1, 0, 0) for one
        never written (a contiguous dataset: each sample its own place)."""
        start = np.full(self.count, -1, dtype=np.int64)
        size, mask = np.zeros(self.count, dtype=np.int64), np.zeros(self.count, dtype=np.int64)
        ident, rows = self._images.id, self._rows
        sample_bytes = int(np.prod(self.shape))
        if self._images.chunks is None:
            first = ident.get_offset()
            if first is not None:
                start[:] = first + np.arange(self.count, dtype=np.int64) * sample_bytes
                size[:] = sample_bytes
            return start, size, mask

        recorded = self._recorded_offsets(sample_bytes)
        if recorded is not None:
            start[:] = recorded
            size[:] = sample_bytes
            return start, size, mask

        def record(info: Any) -> None:
            row = info.chunk_offset[0]
            if 0 <= row < self.count:
                stop = min(row + rows, self.count)
                start[row:stop], size[row:stop], mask[row:stop] = info.byte_offset, info.size, info.filter_mask

        if hasattr(ident, "chunk_iter"):   # (h5py built on HDF5 >= 1.14)
            ident.chunk_iter(record)
        else:
            for k in range(ident.get_num_chunks()):
                record(ident.get_chunk_info(k))
        return start, size, mask

    def _recorded_offsets(self, sample_bytes: int) -> np.ndarray | None:
        """The samples' offsets the writer recorded (``layout["offsets"]``, one uncompressed
        sample per chunk), where 33 samples spread over the store read through the chunk index
        (``read_direct_chunk``) equal the bytes at their recorded offsets (a file rewritten by
        another tool, h5repack say, has its chunks elsewhere); else None."""
        name = self.manifest["layout"].get("offsets")
        ident = self._images.id
        if (name is None or self.count == 0 or self._rows != 1 or self._images.chunks is None
                or self._data is None or not hasattr(ident, "read_direct_chunk")):
            return None
        dataset = self._file.get(str(name))
        if not isinstance(dataset, h5py.Dataset) or dataset.shape != (self.count,) or dataset.dtype.kind != "i":
            return None
        offsets = dataset[()].astype(np.int64)
        if not inside(offsets, sample_bytes, len(self._data)):
            return None
        for i in np.unique(np.linspace(0, self.count - 1, 33).astype(np.int64)).tolist():
            filter_mask, chunk = ident.read_direct_chunk((i, 0, 0, 0))
            at = int(offsets[i])
            if filter_mask or len(chunk) != sample_bytes or self._data[at:at + sample_bytes].tobytes() != chunk:
                return None
        return offsets

    def _place_samples(self, start: np.ndarray, size: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The table of ``_sample_table`` from the chunks' places; sets ``read_path`` native where
        the chunks do not hold every sample whole at the place the index gives."""
        if self.read_path == IN_PLACE:
            sample_bytes = int(np.prod(self.shape))
            chunk_bytes = sample_bytes * self._rows
            row = np.arange(self.count, dtype=np.int64) % self._rows
            offsets = start + row * sample_bytes
            why = None
            if (start < 0).any():
                why = f"the chunk of sample {int(np.argmax(start < 0))} was never written (h5py reads its fill value)"
            elif (size != chunk_bytes).any() or mask.any():
                bad = int(np.argmax((size != chunk_bytes) | (mask != 0)))
                why = f"the chunk of sample {bad} holds {int(size[bad])} bytes, not {chunk_bytes} raw ones"
            elif not inside(offsets, sample_bytes, len(self._data)):
                why = "a chunk lies past the end of the file (truncated?)"
            if why is None:
                return offsets, np.full(self.count, sample_bytes, dtype=np.int64)
            self.read_path, self.read_path_reason = NATIVE, why
        return start, size

    def _read_fixed(self, i: int, out: np.ndarray) -> None:
        """Sample ``i`` into ``out`` (a C-contiguous (C, H, W) uint8 array)."""
        try:
            if self._direct:
                try:
                    mask, data = self._images.id.read_direct_chunk((i, 0, 0, 0), out=out.reshape(-1))
                except (OSError, KeyError, RuntimeError):
                    # a chunk never written (HDF5 reads its fill value), or damage: h5py's own read says which
                    out[...] = self._images[i]
                    return
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
        """Sample ``i``: a view of the map (copy-on-write) in place, else a fresh, writable array."""
        if self.shape is None:
            return self._read_variable(i)
        placed = self._in_place(np.array([i], dtype=np.int64))
        if placed is not None:
            return views(*placed, [self.shape])[0]
        out = np.empty(self.shape, dtype=np.uint8)
        self._read_fixed(i, out)
        return out

    def _read_many(self, indices: list[int]) -> list[np.ndarray]:
        placed = self._in_place(np.asarray(indices, dtype=np.int64)) if self.shape is not None else None
        if placed is not None:   # views of the map, as the shards reader hands out
            return views(*placed, [self.shape] * len(indices))
        out: list[np.ndarray | None] = [None] * len(indices)
        for k in sorted(range(len(indices)), key=indices.__getitem__):   # in file order
            out[k] = self._read(indices[k])
        return out

    def _read_batch(self, indices: np.ndarray, out: np.ndarray) -> None:
        for k in np.argsort(indices, kind="stable").tolist():   # in file order
            self._read_fixed(int(indices[k]), out[k])


def _choose_path(images: h5py.Dataset, shape: tuple[int, int, int] | None, in_place: bool) -> tuple[str, str]:
    """(``read_path``, why) from /images' properties; the chunk index may still refuse (see _place_samples)."""
    plist = images.id.get_create_plist()
    filters = [plist.get_filter(k)[3].decode(errors="replace") for k in range(plist.get_nfilters())]
    if shape is None:
        return NATIVE, "variable-length samples live in HDF5's heap: h5py reads each"
    if not in_place:
        return NATIVE, "in place turned off (reader option in_place=False)"
    if images.is_virtual:
        return NATIVE, "/images is a virtual dataset over several files: h5py reads through it"
    if filters:
        return NATIVE, f"/images chunks are filtered ({', '.join(filters)}): h5py decodes each"
    if images.chunks is not None and tuple(images.chunks[1:]) != tuple(shape):
        return NATIVE, f"/images chunks of {images.chunks} split each sample: h5py assembles it"
    if images.chunks is None:
        return IN_PLACE, "contiguous, uncompressed /images read from a map of the file"
    rows = images.chunks[0]
    return IN_PLACE, ("one uncompressed chunk per sample" if rows == 1 else
                      f"uncompressed chunks of {rows} whole samples") + ", read from a map of the file"


def _next_prime(n: int) -> int:
    # HDF5 hashes chunks into rdcc_nslots slots: a prime count spreads them (h5py docs)
    n = max(2, n)
    while any(n % d == 0 for d in range(2, int(n ** 0.5) + 1)):
        n += 1
    return n
