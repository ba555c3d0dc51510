"""LMDB stores: one key per sample in an LMDB environment, readable with plain ``lmdb``.

On-disk layout of ``NAME.lmdb/`` (an LMDB environment folder, format version 1)::

    data.mdb, lock.mdb     the LMDB environment (one unnamed database)

    key (ASCII bytes)      value
    ---------------------  ----------------------------------------------------------
    b"0000000000"          sample 0: raw uint8 bytes in CHW order, C*H*W of them
    b"0000000001"          sample 1 ...                    (keys: index, 10 digits)
    ...
    b"__dlstore__"         the manifest, UTF-8 JSON (see dlstore.manifest)
    b"__labels__"          int64 little-endian (N,): label of sample i; -1 if unlabelled
    b"__shapes__"          int64 little-endian (N, 3): C, H, W of sample i
                           (variable-shape stores only; fixed-shape stores take the
                           shape from the manifest's sample.shape)
    b"__crc32__"           uint32 little-endian (N,): CRC32 of sample i's value (check="sample")
    b"__targets__"         .npy bytes of the (N, K) int64/float32 target vectors (only where converted from them)

Why this layout:
  * zero-padded decimal keys sort in sample order, so the writer appends with ``MDB_APPEND``
    (no page splits, a compact file) and a reader scanning a cursor meets samples in order;
    reserved keys start with ``__``, which sorts after every digit.
  * values are the bare pixels (no header, no pickle): ``np.frombuffer(value, np.uint8)
    .reshape(shape)`` is the whole decoder, in any language.
  * shapes of a variable-shape store live in one ``__shapes__`` value rather than a
    per-sample header, so every sample value has the same meaning.

Checksums (manifest ``checksums.files``; what each covers is spelt out in ``layout["hashed"]``
so ``dlstore verify`` can recompute them): ``samples`` = sha256 of the values of keys 0..N-1
concatenated in key order (the same digest an HDF5 store of the same source records),
``labels`` = sha256 of the ``__labels__`` value, ``shapes`` = sha256 of the ``__shapes__``
value, ``targets`` = sha256 of the little-endian target vectors.

Writing: samples are committed in batched write transactions (64 MiB by default). The map
starts small and doubles whenever LMDB reports ``MDB_MAP_FULL`` (the failed transaction is
retried), so any store that fits the disk can be written. Syncing is deferred to the end: the
store is published by rename only after a final ``fsync``, so a crash leaves only a staging folder.

Reading: the environment is opened ``readonly=True, lock=False`` (a published store never
changes in place: it is replaced by rename, so readers need no lock table), lazily, once per
process. ``readahead`` defaults to True when the data file is smaller than half the physical
memory (the page cache will hold it, and readahead fills it with fewer, larger reads) and to
False otherwise (random reads of a store bigger than RAM: readahead would evict pages that are
still needed for neighbours that are not); pass ``readahead=`` to choose.
"""

from __future__ import annotations

import functools
import hashlib
import os
import zlib
from array import array
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from ..errors import (
    ArgumentError,
    StoreCorruptError,
)
from ..sources.origins import Origins
from ._common import (
    PartialRows,
    StorePin,
    check_identity,
    check_sample,
    write_error,
)
from ._lmdb_env import data_file, shared
from ._integrity import (
    SUMS_ALGORITHM,
    SUMS_DTYPE,
    check_sidecar_seal,
    seal_sidecar,
)
from ._targets import HASHED, LMDB_KEY, WithTargets, digest, npy_bytes, read_lmdb
from .manifest import loads as load_manifest_text
from .manifest import validate
from .reader import StoreReader

FORMAT = "lmdb"
FORMAT_VERSION = 1
SUFFIXES = (".lmdb",)
READER_OPTIONS = ("readahead",)   # keyword options of Reader, see open_dataset(reader_options=)

KEY_DIGITS = 10
MANIFEST_KEY = b"__dlstore__"
LABELS_KEY = b"__labels__"
SHAPES_KEY = b"__shapes__"
SUMS_KEY = b"__crc32__"
INT_DTYPE = np.dtype("<i8")
DEFAULT_MAP_SIZE = 1 << 30  # initial map; doubles on MDB_MAP_FULL
DEFAULT_BATCH_BYTES = 64 << 20  # sample bytes per write transaction


def sample_key(i: int) -> bytes:
    """The key of sample ``i`` (``b"0000000042"``)."""
    return b"%010d" % i


class LmdbWriter(WithTargets):
    """Writes samples in order into a staging LMDB environment folder.

    Used by ``dlstore.convert``, which owns staging and publishing; a writer only fills the folder it is given.

    Args:
        folder: the staging folder to create.
        shape: (C, H, W) of every sample, or None for a variable-shape store.
        map_size: initial LMDB map size in bytes (grows by doubling as needed).
        batch_bytes: sample bytes committed per write transaction.
        compression: must be ``"none"``: LMDB stores hold raw pixels.
    """

    format = FORMAT
    format_version = FORMAT_VERSION
    _PARTIAL_LABELS = "labels.partial"  # int64 rows of committed samples, appended at checkpoints
    _PARTIAL_SHAPES = "shapes.partial"  # (variable shapes) C, H, W per committed sample

    def __init__(self, folder: Path, *, shape: tuple[int, int, int] | None,
                 map_size: int = DEFAULT_MAP_SIZE, batch_bytes: int = DEFAULT_BATCH_BYTES,
                 compression: str | None = "none", _create: bool = True, **_: Any):
        if compression not in (None, "none"):
            raise ArgumentError(f"compression={compression!r}: LMDB stores hold raw pixels; "
                                "compression applies to hdf5 stores only (use --format hdf5)")
        self.folder = Path(folder)
        self.shape = shape
        self.batch_bytes = max(1, int(batch_bytes))
        self.labels = array("q")  # int64, not a list of Python ints: no per-sample objects
        self.shapes = array("q")  # C, H, W of each sample, flat (variable-shape stores)
        self.sums = array("q")    # CRC32 of each sample's value
        self.checksums: dict[str, str] = {}
        self._hash = hashlib.sha256()
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0
        self._count = 0
        self._partial_labels = PartialRows(self.folder / self._PARTIAL_LABELS, 1)
        self._partial_shapes = PartialRows(self.folder / self._PARTIAL_SHAPES, 3)
        if _create:
            self.folder.mkdir(parents=True, exist_ok=False)
        elif not (self.folder / "data.mdb").is_file():  # _create=False: reopen (resume)
            raise StoreCorruptError(f"{self.folder}: nothing to resume (no data.mdb); rerun without --resume")
        # sync=False/metasync=False: one fsync at the end is enough, because the store only
        # becomes visible (by rename) after it; meminit stays on so unused page bytes are zeros.
        self._env: lmdb.Environment | None = lmdb.open(
            str(self.folder), map_size=max(1 << 16, int(map_size)), subdir=True, sync=False,
            metasync=False, readahead=False, max_dbs=0)

    def add(self, sample: np.ndarray, label: int) -> bool:
        """Append one uint8 CHW sample and its label; True if this committed a transaction."""
        check_sample(self.folder, sample, self.shape)
        if self._count >= 10 ** KEY_DIGITS:
            raise ArgumentError(f"{self.folder}: an LMDB store holds at most {10 ** KEY_DIGITS} samples; "
                                "split the source or use --format shards")
        value = np.ascontiguousarray(sample).tobytes()
        self._hash.update(value)
        self.sums.append(zlib.crc32(value))
        self._pending.append((sample_key(self._count), value))
        self._pending_bytes += len(value)
        self._count += 1
        self.labels.append(int(label))
        if self.shape is None:
            self.shapes.extend(int(d) for d in sample.shape)
        if self._pending_bytes >= self.batch_bytes:
            self._flush()
            return True
        return False

    def _put(self, items: list[tuple[bytes, bytes]], append: bool) -> None:
        """Commit ``items`` in one transaction, growing the map until they fit."""
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for key, value in items:
                        txn.put(key, value, append=append)
                return
            except lmdb.MapFullError:
                # The transaction was aborted; a bigger map lets the same batch commit.
                size = self._env.info()["map_size"]
                self._env.set_mapsize(2 * size + 2 * sum(len(v) for _, v in items))
            except lmdb.Error as exc:
                # A full disk shows as "mdb_txn_commit: Input/output error" (a short write).
                # The transaction is aborted; earlier commits and the checkpoint stay valid.
                mapped = write_error(self.folder / "data.mdb", exc, nbytes=sum(len(v) for _, v in items))
                if mapped is None:
                    raise
                raise mapped from exc

    def _flush(self) -> None:
        if self._pending:
            self._put(self._pending, append=True)
            self._pending = []
            self._pending_bytes = 0

    # Resumption: a committed transaction is a unit. At a checkpoint the environment is synced
    # and the labels (and shapes) of the committed samples are appended to files next to it.
    def checkpoint(self) -> dict[str, Any]:
        """Make the committed samples durable; return the state ``resume`` needs.

        Only called right after ``add`` returned True, so nothing is pending.
        """
        try:
            self._env.sync(True)
        except lmdb.Error as exc:
            mapped = write_error(self.folder / "data.mdb", exc)
            if mapped is None:
                raise
            raise mapped from exc
        rows = self._count
        self._partial_labels.append(self.labels, rows)
        if self.shape is None:
            self._partial_shapes.append(self.shapes, rows)
        return {"rows": rows}

    @classmethod
    def resume(cls, folder: Path, state: dict[str, Any], *, shape: tuple[int, int, int] | None,
               **options: Any) -> LmdbWriter:
        """Reopen a staging environment at a checkpoint, dropping samples committed after it.

        The running sha256 of the samples cannot be saved, so it is recomputed by reading
        the kept samples back once (sequentially).
        """
        rows = int(state["rows"])
        writer = cls(folder, shape=shape, _create=False, **options)
        try:
            with writer._env.begin(write=True) as txn:
                cursor = txn.cursor()
                if cursor.set_range(sample_key(rows)):
                    while cursor.key()[:1].isdigit():
                        if not cursor.delete():
                            break
                for i in range(rows):
                    value = txn.get(sample_key(i))
                    if value is None:
                        raise StoreCorruptError(f"{writer.folder}: sample {i} missing before the checkpoint; "
                                                "rerun without --resume")
                    writer._hash.update(value)
                    writer.sums.append(zlib.crc32(value))
            writer.labels.extend(writer._partial_labels.restore(rows))
            if shape is None:
                writer.shapes.extend(writer._partial_shapes.restore(rows))
        except BaseException:
            writer.close()  # py-lmdb allows one open per process: let a retry open it again
            raise
        writer._count = rows
        return writer

    def finish(self) -> dict[str, Any]:
        """Commit the remaining samples, labels and shapes; return the manifest's ``layout``."""
        self._flush()
        self._partial_labels.remove()
        self._partial_shapes.remove()
        labels = np.asarray(self.labels, dtype=INT_DTYPE).tobytes()
        items = [(LABELS_KEY, labels)]
        self.checksums["samples"] = self._hash.hexdigest()
        self.checksums["labels"] = hashlib.sha256(labels).hexdigest()
        sums = np.asarray(self.sums, dtype=SUMS_DTYPE).tobytes()
        items.append((SUMS_KEY, sums))
        self.checksums["crc32"] = hashlib.sha256(sums).hexdigest()
        hashed = {
            "samples": f"values of keys {sample_key(0).decode()}..{sample_key(max(self._count - 1, 0)).decode()} "
                       "concatenated in key order",
            "labels": f"value of key {LABELS_KEY.decode()}",
            "crc32": f"value of key {SUMS_KEY.decode()}",
        }
        layout: dict[str, Any] = {
            "kind": "fixed" if self.shape is not None else "variable",
            "key_digits": KEY_DIGITS,
            "labels_key": LABELS_KEY.decode(),
            "int_dtype": INT_DTYPE.str,
            "sample_sums": {"algorithm": SUMS_ALGORITHM, "key": SUMS_KEY.decode()},
        }
        if self.shape is None:
            shapes = np.asarray(self.shapes, dtype=INT_DTYPE).reshape(-1, 3).tobytes()
            items.append((SHAPES_KEY, shapes))
            self.checksums["shapes"] = hashlib.sha256(shapes).hexdigest()
            hashed["shapes"] = f"value of key {SHAPES_KEY.decode()}"
            layout["shapes_key"] = SHAPES_KEY.decode()
        if self.targets is not None:   # __targets__ (see _targets)
            items.append((LMDB_KEY, npy_bytes(self.targets)))
            layout["targets_key"], self.checksums["targets"], hashed["targets"] = LMDB_KEY.decode(), \
                digest(self.targets), HASHED
        origins = getattr(self, "origins", None)
        if origins is not None:  # __provenance_indices__ (int64), or __provenance_offsets__ + __provenance_blob__
            keys = {}
            for name, values in origins.arrays().items():
                keys[name] = f"__provenance_{name}__"
                dtype = INT_DTYPE if values.dtype.kind == "i" else np.uint8
                items.append((keys[name].encode(), np.asarray(values, dtype=dtype).tobytes()))
            layout["provenance"] = {"kind": origins.kind, "keys": keys}
        layout["hashed"] = hashed
        self._put(items, append=False)
        return layout

    def set_provenance(self, origins: Origins) -> None:
        """Where each sample came from (``sources.origins``), written by ``finish``."""
        self.origins = origins

    def write_manifest(self, text: str) -> None:
        self._put([(MANIFEST_KEY, text.encode("utf-8"))], append=False)
        self._env.sync(True)
        self.close()  # nothing writes data.mdb after this: seal it (see _common, whole-file seals)
        seal_sidecar(self.folder / "data.mdb")

    def close(self) -> None:
        """Close the environment; safe after finish() and after an error."""
        if self._env is not None:
            self._env.close()
            self._env = None


# --- reading -------------------------------------------------------------------------------

def _env_folder(path: str | os.PathLike) -> Path:
    """The environment folder, also when given its ``data.mdb`` (as format detection allows)."""
    path = Path(path)
    return path.parent if path.name == "data.mdb" and path.is_file() else path


def _default_readahead(data: Path) -> bool:
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return True
    return data.stat().st_size <= ram // 2


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
    """Reads samples of an LMDB store; each read copies the value out of the map once.

    Args:
        path: the ``.lmdb`` folder.
        manifest: the already-read manifest (read from the store if None).
        readahead: OS readahead on the data file; default: True if the file is smaller than half
            the physical memory, else False (see the module doc). Readers of one store in one
            process share one environment (py-lmdb allows a single open per process); the first
            one's setting applies.
    """

    format = FORMAT
    _handles = ("_env",)

    @_lmdb_errors_as_damage
    def __init__(self, path: str | os.PathLike, manifest: dict[str, Any] | None = None, *,
                 readahead: bool | None = None):
        self.path = _env_folder(path)
        data = data_file(self.path)
        self._pin = StorePin(self.path)   # before reading any of it; held while this reader lives: see _common
        self._identity = self._pin.identity
        self.readahead = _default_readahead(data) if readahead is None else bool(readahead)
        self._env: lmdb.Environment | None = None
        self._pid: int | None = None
        self.sums = None   # SampleSums once enable_sample_check() ran (check="sample")
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

    @_lmdb_errors_as_damage
    def _read(self, i: int) -> np.ndarray:
        """Sample ``i`` as a fresh, writable array."""
        with self._env.begin(buffers=True) as txn:
            return self._copy(txn, i)

    @_lmdb_errors_as_damage
    def _read_many(self, indices: list[int]) -> list[np.ndarray]:
        # One transaction; each sample its own array (not a view of one block), so a sample
        # kept by the caller pins only its own memory.
        with self._env.begin(buffers=True) as txn:
            return [self._copy(txn, i) for i in indices]

    @_lmdb_errors_as_damage
    def _read_batch(self, indices: np.ndarray, out: np.ndarray) -> None:
        flat = out.reshape(len(indices), -1)
        nbytes = flat.shape[1]
        with self._env.begin(buffers=True) as txn:
            for k, i in enumerate(indices.tolist()):
                flat[k] = np.frombuffer(self._value(txn, i, nbytes), dtype=np.uint8)

    def _copy(self, txn: lmdb.Transaction, i: int) -> np.ndarray:
        shape = self._shape_of(i)
        # The memoryview points into the map and is valid only inside the transaction.
        value = self._value(txn, i, shape[0] * shape[1] * shape[2])
        return np.frombuffer(value, dtype=np.uint8).reshape(shape).copy()



Writer = LmdbWriter
Reader = LmdbReader
