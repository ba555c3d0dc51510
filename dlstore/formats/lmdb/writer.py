"""The lmdb Writer: fills a staging path (layout: ``layout.py``)."""

from __future__ import annotations

import hashlib
import zlib
from array import array
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from ...errors import (
    ArgumentError,
    StoreCorruptError,
)
from ...sources.origins import Origins
from ..checks import check_sample
from ..integrity import (
    SUMS_ALGORITHM,
    SUMS_DTYPE,
    seal_sidecar,
)
from ..space import write_error
from ..synced import PartialRows
from ..targets import HASHED, LMDB_KEY, WithTargets, digest, npy_bytes
from .layout import (
    DEFAULT_BATCH_BYTES,
    DEFAULT_MAP_SIZE,
    FORMAT,
    FORMAT_VERSION,
    INT_DTYPE,
    KEY_DIGITS,
    LABELS_KEY,
    MANIFEST_KEY,
    SHAPES_KEY,
    SUMS_KEY,
    sample_key,
)


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
        self._committed = 0       # samples already in the environment (a resume rewrites none of them)
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
        if self._count < self._committed:
            self._check_committed(self._count, value)
        else:
            self._pending.append((sample_key(self._count), value))
        self._pending_bytes += len(value)     # counted either way: transactions end where they ended before
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

    def _check_committed(self, i: int, value: bytes) -> None:
        """Sample ``i``, committed before an interruption, must be what the resumed run made again."""
        with self._env.begin() as txn:
            stored = txn.get(sample_key(i))
        if stored != value:
            raise StoreCorruptError(f"{self.folder}: sample {i}, committed before the interruption, differs from "
                                    "what the resumed conversion makes of its source; rerun without --resume")

    # Resumption: a committed transaction is a unit. At a checkpoint the environment is synced
    # and the labels (and shapes) of the committed samples are appended to files next to it. A
    # kill between a commit and its checkpoint leaves samples past the checkpoint: the resume keeps
    # them and checks them as the run makes them again, rather than deleting them (LMDB would lay
    # the freed pages out anew, and the file would differ from an uninterrupted run's).
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
        """Reopen a staging environment at a checkpoint; the samples committed after it are kept, and
        checked as the resumed run makes them again.

        The running sha256 of the samples cannot be saved, so it is recomputed by reading
        the kept samples back once (sequentially).
        """
        rows = int(state["rows"])
        writer = cls(folder, shape=shape, _create=False, **options)
        try:
            with writer._env.begin() as txn:
                writer._committed = max(rows, sum(1 for key in txn.cursor().iternext(values=False)
                                                  if key[:1].isdigit()))
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
        if self.targets is not None:   # __targets__ (see targets)
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
        self.close()  # nothing writes data.mdb after this: seal it (see common, whole-file seals)
        seal_sidecar(self.folder / "data.mdb")

    def close(self) -> None:
        """Close the environment; safe after finish() and after an error."""
        if self._env is not None:
            self._env.close()
            self._env = None
