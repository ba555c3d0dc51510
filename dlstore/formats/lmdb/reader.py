"""The lmdb Reader and its manifest (layout: ``layout.py``)."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from ...errors import (
    ArgumentError,
    StoreCorruptError,
)
from ...sources.origins import Origins
from .environment import data_file, shared
from ..inplace import IN_PLACE, NATIVE, map_file, views
from ..integrity import (
    SUMS_DTYPE,
    check_sidecar_seal,
)
from ..manifest import loads as load_manifest_text
from ..manifest import validate
from ..pins import StorePin, check_identity
from ..readahead import Extents, advise, choose_willneed, mapping_base, readahead_default
from ..reader import StoreReader
from ..targets import read_lmdb
from .layout import (
    FORMAT,
    FORMAT_VERSION,
    INT_DTYPE,
    KEY_DIGITS,
    LABELS_KEY,
    MANIFEST_KEY,
    SHAPES_KEY,
    sample_key,
)
from .pages import LAYOUT_KNOWN, parse_leaf, walk

def _env_folder(path: str | os.PathLike) -> Path:
    """The environment folder, also when given its ``data.mdb`` (as format detection allows)."""
    path = Path(path)
    return path.parent if path.name == "data.mdb" and path.is_file() else path


def _get_required(txn: lmdb.Transaction, key: bytes, path: Path) -> bytes:
    value = txn.get(key)
    if value is None:
        raise StoreCorruptError(f"{path}: key {key.decode()} is missing: not a complete dlstore LMDB store")
    return bytes(value)


def check_seal(path: str | os.PathLike) -> tuple[Path, str | None]:
    """(data file, None if its seal ``data.mdb.sha256`` matches, else the problem or "unsealed")."""
    data = _env_folder(path) / "data.mdb"
    return data, check_sidecar_seal(data)


def read_manifest(path: Path) -> dict[str, Any]:
    """The validated manifest of the LMDB store at ``path``."""
    path = _env_folder(path)
    try:
        with shared(path, readahead=False).begin() as txn:
            text = _get_required(txn, MANIFEST_KEY, path)
    except lmdb.Error as exc:
        raise StoreCorruptError(f"{path / 'data.mdb'}: damaged: LMDB reports {exc}") from exc
    return load_manifest_text(text, f"{path} (key {MANIFEST_KEY.decode()})")


def _lmdb_errors_as_damage(method):
    """LMDB's own errors while reading a published store (MDB_CORRUPTED, MDB_PAGE_NOTFOUND,
    a bad page type, ...) mean a damaged file: raise them as StoreCorruptError naming it."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except _DAMAGE as exc:     # other lmdb errors (readers full, map resized, ...) are not damage
            raise StoreCorruptError(f"{self.path / 'data.mdb'}: damaged: LMDB reports {exc}; run dlstore verify, "
                                    "then convert the store again or restore a copy") from exc
    return wrapper


# LMDB errors that mean the file's contents are wrong (BadChecksumError: not in py-lmdb 1.4)
_DAMAGE = tuple(getattr(lmdb, name) for name in (
    "CorruptedError", "PageNotFoundError", "BadValsizeError", "InvalidError", "VersionMismatchError",
    "IncompatibleError", "BadChecksumError", "PanicError", "NotFoundError") if hasattr(lmdb, name))


class LmdbReader(StoreReader):
    """Reads samples of an LMDB store in place, from a map of ``data.mdb``.

    Every value is one run of bytes in ``data.mdb``, whatever order its keys were written in:
    in its leaf page, or in consecutive overflow pages. Its place is read from the B-tree's
    leaf pages (``_extents``, once per leaf, never a lookup per value), and a batch is gathered
    from this reader's own map of the file at those places (``inplace.py``): one pass, the
    fused crop reading the values where they lie (``sample_addresses``), ``get_many`` handing
    out views. That is safe because a published store is never written again (a conversion
    writes a new one and renames it in place: this reader's map keeps the old file). Where a
    page does not read as LMDB lays it out, or a value's size is not the sample's, the values
    are looked up in a transaction and copied out (``read_path`` says which path it takes).

    Args:
        path: the ``.lmdb`` folder.
        manifest: the already-read manifest (read from the store if None).
        readahead: OS readahead on the data file; default: True if the file is smaller than half
            the memory, else False (``readahead.readahead_default``). Readers of one store in one
            process share one environment (py-lmdb allows a single open per process); the first
            one's setting applies.
        willneed: before each batch is copied out, posix_fadvise(WILLNEED) each of its values'
            pages in ``data.mdb`` (found from their B-tree nodes, see ``_extents``), so a cold batch has all
            its reads in flight at once (see ``readahead.py``); None: on only for a store that
            cannot stay cached.
        in_place: False reads every value through a transaction (``read_path`` "native"): what
            the reader falls back to where the pages cannot be read.
    """

    format = FORMAT
    _handles = ("_env", "_map_base", "_data", "_table_lock")

    @_lmdb_errors_as_damage
    def __init__(self, path: str | os.PathLike, manifest: dict[str, Any] | None = None, *,
                 readahead: bool | None = None, willneed: bool | None = None, in_place: bool = True):
        self.path = _env_folder(path)
        data = data_file(self.path)
        self._pin = StorePin(self.path)   # before reading any of it; held while this reader lives: see common
        self._identity = self._pin.identity
        self.readahead = readahead_default(data.stat().st_size) if readahead is None else bool(readahead)
        self._env: lmdb.Environment | None = None
        self._map_base: int | None = None
        self._data: np.ndarray | None = None      # this reader's own map of data.mdb (in place)
        self._page_bytes = self._file_bytes = 0
        # (offsets, lengths), each (count,): where each value found so far lies in data.mdb (offset
        # -1: not yet). One attribute, set once: the loader's threads call _extents concurrently.
        self._values: tuple[np.ndarray, np.ndarray] | None = None
        self._pid: int | None = None
        self.sums = None   # SampleSums once enable_sample_check() ran (check="sample")
        if not isinstance(in_place, bool):
            raise ArgumentError(f"in_place must be True or False, got {in_place!r}")
        if not in_place:
            self.read_path, self.read_path_reason = NATIVE, "in place turned off (reader option in_place=False)"
        elif not LAYOUT_KNOWN:
            self.read_path, self.read_path_reason = NATIVE, "LMDB's pages are read in place on 64-bit " \
                                                            "little-endian machines only"
        else:
            self.read_path, self.read_path_reason = IN_PLACE, "each value read from a map of data.mdb at its " \
                "place in the B-tree's leaf pages"
        # Metadata lives in the environment: open, read, let go (nothing held open if this process forks next).
        env = shared(self.path, self.readahead)
        with env.begin() as txn:
            if manifest is None:
                manifest = load_manifest_text(_get_required(txn, MANIFEST_KEY, self.path),
                                              f"{self.path} (key {MANIFEST_KEY.decode()})")
            validate(manifest, str(self.path), format=FORMAT, max_format_version=FORMAT_VERSION)
            self.manifest = manifest
            self.count: int = manifest["count"]
            layout = manifest["layout"]
            self.kind = layout.get("kind")
            if layout.get("key_digits", KEY_DIGITS) != KEY_DIGITS:
                raise StoreCorruptError(f"{self.path}: unsupported key width {layout.get('key_digits')!r}")
            self.labels = self._int_array(txn, LABELS_KEY, (self.count,))
            self.targets = read_lmdb(txn, self.path, manifest)   # (N, K), or None: int labels only
            if self.kind == "fixed":
                self.shape: tuple[int, int, int] | None = tuple(manifest["sample"]["shape"])
                self.shapes = None
            elif self.kind == "variable":
                self.shape = None
                self.shapes = self._int_array(txn, SHAPES_KEY, (self.count, 3))
                if (self.shapes <= 0).any():
                    raise StoreCorruptError(f"{self.path}: {SHAPES_KEY.decode()} holds non-positive sizes")
            else:
                raise StoreCorruptError(f"{self.path}: unknown LMDB layout kind {self.kind!r}")
            if self.count and txn.get(sample_key(self.count - 1)) is None:
                raise StoreCorruptError(f"{self.path}: the manifest declares {self.count} samples but key "
                                        f"{sample_key(self.count - 1).decode()} is missing")
        del env, txn
        self.willneed = choose_willneed(willneed, self.count, data.stat().st_size / max(1, self.count))

    def _int_array(self, txn: lmdb.Transaction, key: bytes, shape: tuple[int, ...]) -> np.ndarray:
        raw = _get_required(txn, key, self.path)
        expected = int(np.prod(shape)) * INT_DTYPE.itemsize
        if len(raw) != expected:
            raise StoreCorruptError(f"{self.path}: key {key.decode()} holds {len(raw)} bytes, expected "
                                    f"{expected} (int64 {shape})")
        return np.frombuffer(raw, dtype=INT_DTYPE).astype(np.int64).reshape(shape)

    def _open(self) -> None:
        self._env = shared(self.path, self.readahead)
        check_identity(self.path, self._identity)   # after the open: the old store's file, or this raises
        # where this process maps data.mdb (the environment maps it whole, from byte 0, at its open):
        # what finding a value's extent needs, for willneed and for prefetch
        self._map_base = mapping_base(self.path / "data.mdb")
        # the pages the open transaction's snapshot can hold, from the environment itself (the
        # path may already name a replacing store, or none, between an overwrite's renames)
        self._table_lock = threading.Lock()
        self._page_bytes = self._env.stat()["psize"]
        self._file_bytes = (self._env.info()["last_pgno"] + 1) * self._page_bytes
        if self._map_base is None:
            self._native("LMDB's map of data.mdb is not found in /proc/self/maps")
        if self.read_path == IN_PLACE:
            self._data = map_file(self.path / "data.mdb", self.readahead)
            check_identity(self.path, self._identity)   # the map's open, by name

    @_lmdb_errors_as_damage
    def _load_sums(self, spec: dict[str, Any]) -> np.ndarray:
        self._ensure_open()
        with self._env.begin() as txn:
            raw = _get_required(txn, str(spec.get("key")).encode(), self.path)
        if len(raw) != 4 * self.count:
            raise StoreCorruptError(f"{self.path}: key {spec.get('key')} holds {len(raw)} bytes, expected "
                                    f"{4 * self.count} (uint32 ({self.count},))")
        return np.frombuffer(raw, dtype=SUMS_DTYPE)

    def _sample_file(self, i: int) -> Path:
        return self.path / "data.mdb"

    def origins(self) -> Origins | None:
        """Where each sample came from; None for a store converted before provenance was kept."""
        spec = self.manifest["layout"].get("provenance")
        if spec is None:
            return None
        dtypes = {"indices": np.int64, "offsets": np.int64, "blob": np.uint8}
        self._ensure_open()
        with self._env.begin() as txn:
            arrays = {name: np.frombuffer(_get_required(txn, str(key).encode(), self.path),
                                          dtype=INT_DTYPE if name != "blob" else np.uint8).astype(dtypes.get(name, np.uint8))
                      for name, key in dict(spec.get("keys", {})).items()}
        return Origins.from_arrays(spec.get("kind"), arrays, str(self.path), count=self.count)

    def _shape_of(self, i: int) -> tuple[int, int, int]:
        if self.shape is not None:
            return self.shape
        c, h, w = self.shapes[i]
        return int(c), int(h), int(w)

    def _value(self, txn: lmdb.Transaction, i: int, nbytes: int) -> memoryview:
        value = txn.get(sample_key(i))
        if value is None or len(value) != nbytes:
            found = "missing" if value is None else f"{len(value)} bytes, expected {nbytes}"
            raise StoreCorruptError(f"{self.path}: sample {i} (key {sample_key(i).decode()}) is {found}")
        return value

    def _native(self, why: str) -> None:
        """From now on, look values up (``read_path`` "native"), for the reason ``why``."""
        if self.read_path == IN_PLACE:
            self.read_path, self.read_path_reason = NATIVE, why

    def _in_place(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(this reader's map of data.mdb, each value's offset), or None where the values are
        looked up: in place off, a page that does not parse, or a value whose size is not its
        sample's (a missing value has size 0): the lookup that follows names it."""
        data = self._data
        if data is None or self.read_path != IN_PLACE or not len(indices):
            return None
        extents = self._extents(indices)
        if extents is None:
            return None
        expected = (int(np.prod(self.shape)) if self.shape is not None
                    else np.prod(self.shapes[indices], axis=1))
        if not (extents.length == expected).all():
            return None
        return data, extents.offset

    @_lmdb_errors_as_damage
    def _read(self, i: int) -> np.ndarray:
        """Sample ``i``: a view of the map (copy-on-write) in place, else a fresh array."""
        placed = self._in_place(np.array([i], dtype=np.int64))
        if placed is not None:
            return views(*placed, [self._shape_of(i)])[0]
        with self._env.begin(buffers=True) as txn:
            return self._copy(txn, i)

    @_lmdb_errors_as_damage
    def _read_many(self, indices: list[int]) -> list[np.ndarray]:
        # In place: views of the map, as the shards reader hands out (a collate's copy is then
        # the only one); else looked up in one transaction, each sample its own array.
        placed = self._in_place(np.asarray(indices, dtype=np.int64))
        if placed is not None:
            return views(*placed, [self._shape_of(i) for i in indices])
        with self._env.begin(buffers=True) as txn:
            return [self._copy(txn, i) for i in indices]

    @_lmdb_errors_as_damage
    def _read_batch(self, indices: np.ndarray, out: np.ndarray) -> None:
        """The native batch (the base class gathers it in place where ``_in_place`` allows)."""
        flat = out.reshape(len(indices), -1)
        nbytes = flat.shape[1]
        with self._env.begin(buffers=True) as txn:
            for k, i in enumerate(indices.tolist()):
                flat[k] = np.frombuffer(self._value(txn, i, nbytes), dtype=np.uint8)

    @_lmdb_errors_as_damage
    def _extents(self, indices: np.ndarray) -> Extents | None:
        """Each value's bytes in data.mdb, read from the B-tree's leaf pages, never from the value.

        py-lmdb's ``get`` faults the whole value in before it returns (its "preload"), and any
        lookup reads the header page of a big value: finding a cold batch by lookups would read
        its samples one page fault at a time before any advice. Instead the first lookup that
        lands in a leaf page parses the whole leaf (``_parse_leaf``) and keeps the extent of
        every sample it holds: one lookup per leaf (a hundred samples or more) per reader.
        None (no advice) where a page does not read as LMDB's layout says.
        """
        if self._map_base is None or not LAYOUT_KNOWN:
            return None
        if self._values is None:
            with self._table_lock:
                if self._values is None:
                    self._values = (self._walk() if len(indices) > 1 else None) or \
                        (np.full(self.count, -1, dtype=np.int64), np.zeros(self.count, dtype=np.int64))
        offsets, lengths = self._values
        missing = offsets[indices] < 0
        unknown = np.unique(indices[missing]).tolist() if missing.any() else []
        if unknown:
            with self._env.begin(buffers=True) as txn:
                cursor = txn.cursor()
                for i in unknown:
                    if offsets[i] >= 0:            # found in a leaf parsed for an earlier one
                        continue
                    if not cursor.set_key(sample_key(i)):
                        offsets[i], lengths[i] = 0, 0   # missing: the read that follows says so
                        continue
                    at = np.frombuffer(cursor.key(), dtype=np.uint8).__array_interface__["data"][0]
                    if not self._parse_leaf(at, offsets, lengths) or offsets[i] < 0:
                        self._native(f"a leaf page of data.mdb (holding key {sample_key(i).decode()}) does not "
                                     "read as LMDB's page layout says")
                        return None
        return Extents([self.path / "data.mdb"], np.zeros(len(indices), dtype=np.int64),
                       offsets[indices], lengths[indices])

    def _walk(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Every sample's extent at once, read from the whole tree (``pages.walk``: each level's
        pages advised together, then decoded as arrays); None where a page does not read as
        LMDB's layout says (the values are then found one leaf at a time)."""
        data = self.path / "data.mdb"
        mem = np.frombuffer((ctypes.c_uint8 * self._file_bytes).from_address(self._map_base), dtype=np.uint8)
        page = self._page_bytes

        def ahead(pgnos: np.ndarray) -> None:
            advise(Extents([data], np.zeros(len(pgnos), dtype=np.int64), pgnos * page, page))

        return walk(mem, page, self.count, KEY_DIGITS, ahead)

    def _parse_leaf(self, at: int, offsets: np.ndarray, lengths: np.ndarray) -> bool:
        """Record the extent of every sample in the leaf page holding the address ``at`` (one
        lookup's leaf); False where the page is not a leaf as LMDB lays it out."""
        base, page = self._map_base, self._page_bytes
        if not base <= at < base + self._file_bytes:
            return False                               # not a view into the map
        start = (at - base) // page * page
        return parse_leaf(ctypes.string_at(base + start, page), start, self.count, KEY_DIGITS,
                          self._file_bytes, offsets, lengths)

    def _copy(self, txn: lmdb.Transaction, i: int) -> np.ndarray:
        shape = self._shape_of(i)
        # The memoryview points into the map and is valid only inside the transaction.
        value = self._value(txn, i, shape[0] * shape[1] * shape[2])
        return np.frombuffer(value, dtype=np.uint8).reshape(shape).copy()
