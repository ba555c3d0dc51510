"""The hdf5 Writer: fills a staging path (layout: ``layout.py``)."""

from __future__ import annotations

import contextlib
import hashlib
import os
from array import array
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ...errors import (
    ArgumentError,
    StoreCorruptError,
    StoreExistsError,
    WriterKilledError,
)
from ...sources.origins import Origins
from ..checks import check_sample
from ..integrity import (
    SEAL_BLOCK,
    SUMS_ALGORITHM,
    SUMS_DTYPE,
    record_crc,
    seal_userblock,
)
from ..space import SPACE_MARGIN, ensure_space, free_bytes, write_error
from ..synced import PartialRows
from ..targets import HASHED, WithTargets, digest
from .layout import (
    COMPRESSIONS,
    DEFAULT_BATCH_BYTES,
    FORMAT,
    FORMAT_VERSION,
    INT_DTYPE,
    LIBVER,
    MANIFEST_ATTR,
    VLEN_CHUNK,
)


class Hdf5Writer(WithTargets):
    """Writes samples in order into a staging HDF5 file.

    Used by ``dlstore.convert``, which owns staging and publishing; a writer only fills the file it is given.

    Args:
        path: the staging file to create.
        shape: (C, H, W) of every sample, or None for a variable-shape store.
        compression: ``"none"`` (default), ``"lzf"`` (fast, needs h5py to read) or
            ``"gzip"`` (smaller, slower; readable by any HDF5). Fixed-shape stores only.
        compression_level: gzip level 0-9 (default 4).
        batch_bytes: sample bytes buffered before each write.
    """

    format = FORMAT
    format_version = FORMAT_VERSION

    def __init__(self, path: Path, *, shape: tuple[int, int, int] | None, compression: str | None = "none",
                 compression_level: int | None = None, batch_bytes: int = DEFAULT_BATCH_BYTES,
                 _create: bool = True, **_: Any):
        compression = "none" if compression is None else compression
        if compression not in COMPRESSIONS:
            raise ArgumentError(f"unknown HDF5 compression {compression!r}; valid: {', '.join(COMPRESSIONS)}")
        if compression != "none" and shape is None:
            raise ArgumentError(
                f"compression={compression!r} needs a fixed-shape store: HDF5 filters do not compress "
                "variable-length data. Add a size-fixing static op (center_crop=N or resize=HxW) "
                "or use compression 'none'")
        if compression_level is not None and compression != "gzip":
            raise ArgumentError(f"compression_level={compression_level!r} applies to compression='gzip' only "
                                f"(got compression={compression!r}); drop it or use gzip")
        self.path = Path(path)
        self.shape = shape
        self.compression = compression
        self.labels = array("q")  # int64, not a list of Python ints: no per-sample objects
        self.shapes = array("q")  # C, H, W of each sample, flat (variable-shape stores)
        self.sums = array("q")    # CRC32 of each sample's bytes
        self.checksums: dict[str, str] = {}
        self._hash = hashlib.sha256()
        self._count = 0
        self._written = 0
        self._broken = False  # a write failed: the file cannot be closed as it is (see _writing)
        # labels of written samples, saved at checkpoints beside the file (the store itself gets
        # its `labels` dataset at the end); shapes need no such file: /shapes is written as it goes
        self._partial_labels = PartialRows(self.path.with_name(self.path.name + ".labels.partial"), 1)
        if self.shape is not None:
            self.sample_bytes = int(np.prod(self.shape))
            self._block = np.empty((max(1, min(4096, batch_bytes // self.sample_bytes)), *self.shape), np.uint8)
        else:
            self._pending: list[np.ndarray] = []
            self._pending_bytes = 0
            self._batch_bytes = max(1, int(batch_bytes))
        if _create:
            if self.path.exists():
                raise StoreExistsError(f"{self.path}: staging file already exists (left by another writer?); "
                                       "remove it first")
            # a user block holds the whole-file seal, written after the file is complete
            self._file: h5py.File | None = h5py.File(self.path, "w", libver=LIBVER, userblock_size=SEAL_BLOCK)
            self._images, self._shapes = self._create_datasets(compression_level)
        else:  # reopen the file of an interrupted conversion (resume)
            try:
                self._file = h5py.File(self.path, "r+", libver=LIBVER)
            except OSError as exc:  # a killed writer leaves HDF5's "already open for write" flags set
                kind = WriterKilledError if "already open for write" in str(exc) else StoreCorruptError
                raise kind(f"{self.path}: the interrupted conversion's file cannot be reopened ({exc})") from exc
            self._images = self._existing("images")
            self._shapes = self._existing("shapes") if shape is None else None

    def _create_datasets(self, compression_level: int | None) -> tuple[h5py.Dataset, h5py.Dataset | None]:
        """The empty, resizable ``images`` (and ``shapes``) datasets of a new file."""
        filters: dict[str, Any] = {}
        if self.compression == "gzip":
            filters = {"compression": "gzip", "compression_opts": 4 if compression_level is None
                       else int(compression_level)}
        elif self.compression == "lzf":
            filters = {"compression": "lzf"}
        if self.shape is not None:
            images = self._file.create_dataset(
                "images", shape=(0, *self.shape), maxshape=(None, *self.shape), dtype=np.uint8,
                chunks=(1, *self.shape), **filters)
            return images, None
        images = self._file.create_dataset(
            "images", shape=(0,), maxshape=(None,), dtype=h5py.vlen_dtype(np.uint8), chunks=(VLEN_CHUNK,))
        shapes = self._file.create_dataset(
            "shapes", shape=(0, 3), maxshape=(None, 3), dtype=INT_DTYPE, chunks=(VLEN_CHUNK, 3))
        return images, shapes

    def _existing(self, name: str) -> h5py.Dataset:
        obj = self._file.get(name)
        if not isinstance(obj, h5py.Dataset):
            self.close()
            raise StoreCorruptError(f"{self.path}: the interrupted conversion's file has no /{name}; "
                                    "rerun without --resume")
        return obj

    def add(self, sample: np.ndarray, label: int) -> bool:
        """Append one uint8 CHW sample and its label; True if this wrote a block to the file."""
        check_sample(self.path, sample, self.shape)
        sample = np.ascontiguousarray(sample)
        self._hash.update(memoryview(sample).cast("B"))
        self.sums.append(record_crc(sample))
        self.labels.append(int(label))
        if self.shape is not None:
            self._block[self._count - self._written] = sample
            self._count += 1
            if self._count - self._written == len(self._block):
                self._flush()
                return True
        else:
            self.shapes.extend(int(d) for d in sample.shape)
            self._pending.append(sample.reshape(-1))
            self._pending_bytes += sample.size
            self._count += 1
            if self._pending_bytes >= self._batch_bytes:
                self._flush()
                return True
        return False

    # Resumption: a written block is a unit. At a checkpoint the file is flushed and the labels of the
    # written samples are appended to a file beside it (the store gets its `labels` dataset at the end).
    def checkpoint(self) -> dict[str, Any]:
        """Make the written samples durable; return the state ``resume`` needs (called right after
        ``add`` returned True, so nothing is buffered)."""
        with self._writing():
            self._file.flush()
            with open(self.path, "rb+") as f:
                os.fsync(f.fileno())
        self._partial_labels.append(self.labels, self._written)
        return {"rows": self._written}

    @classmethod
    def resume(cls, path: Path, state: dict[str, Any], *, shape: tuple[int, int, int] | None,
               **options: Any) -> Hdf5Writer:
        """Reopen a staging file at a checkpoint, dropping samples written after it.

        The running sha256 and the CRC32s of the samples are not saved: they are recomputed
        by reading the kept samples back once, in order.
        """
        rows = int(state["rows"])
        writer = cls(path, shape=shape, _create=False, **options)
        try:
            if writer._file.userblock_size != SEAL_BLOCK:   # staged by a dlstore without seals
                raise StoreCorruptError(f"{writer.path}: this partial conversion was started by an older dlstore "
                                        "(no room for the seal); rerun without --resume")
            held = writer._images.shape[0]
            if held < rows or (shape is None and writer._shapes.shape[0] < rows):
                raise StoreCorruptError(f"{writer.path}: holds {held} samples, the checkpoint counts {rows}; "
                                        "rerun without --resume")
            writer._images.resize(rows, axis=0)
            if shape is None:
                writer._shapes.resize(rows, axis=0)
                writer.shapes.frombytes(np.ascontiguousarray(writer._shapes[:rows], dtype=np.int64).tobytes())
            step = max(1, (64 << 20) // int(np.prod(shape))) if shape is not None else 1024
            for start in range(0, rows, step):
                block = writer._images[start:min(rows, start + step)]
                for flat in block:
                    flat = np.ascontiguousarray(flat)
                    writer._hash.update(memoryview(flat).cast("B"))
                    writer.sums.append(record_crc(flat))
            writer.labels.extend(writer._partial_labels.restore(rows))
        except BaseException:
            writer.close()
            raise
        writer._count = writer._written = rows
        return writer

    # A full disk: HDF5 (2.0, h5py 3.16) cannot recover from a failed write. Its metadata cache
    # then fails to flush at close, and the library crashes (SIGSEGV) when it tries again at
    # exit. So each block is written only when the free space holds it (ensure_space: the file
    # stays as the last checkpoint left it, and a resume continues it), and a file whose write
    # failed anyway (the disk filled from elsewhere) is emptied, closed and removed (see close).
    @contextlib.contextmanager
    def _writing(self, nbytes: int = 0):
        try:
            yield
        except OSError as exc:
            self._broken = True
            mapped = write_error(self.path, exc, nbytes=nbytes)
            if mapped is None:
                raise
            raise mapped from exc

    def _flush(self) -> None:
        k = self._count - self._written
        if k == 0:
            return
        nbytes = k * self.sample_bytes if self.shape is not None else self._pending_bytes + 16 * k
        ensure_space(self.path, nbytes)
        with self._writing(nbytes):
            self._write_block(k)

    def _write_block(self, k: int) -> None:
        start, end = self._written, self._count
        self._images.resize(end, axis=0)
        if self.shape is not None:
            self._images[start:end] = self._block[:k]
        else:
            # One write per sample: an object array of equal-length samples is taken by h5py
            # as a 2-D array and refused ("Can't broadcast (k, n) -> (k,)"), which happens
            # whenever a block's samples have the same size.
            for j, flat in enumerate(self._pending):
                self._images[start + j] = flat
            self._shapes.resize(end, axis=0)
            self._shapes[start:end] = np.asarray(self.shapes[3 * start:3 * end], dtype=INT_DTYPE).reshape(-1, 3)
            self._pending = []
            self._pending_bytes = 0
        self._written = end

    def finish(self) -> dict[str, Any]:
        """Write the remaining samples and the labels; return the manifest's ``layout``."""
        self._flush()
        self._partial_labels.remove()
        labels = np.asarray(self.labels, dtype=INT_DTYPE)
        ensure_space(self.path, labels.nbytes + self.shapes.itemsize * len(self.shapes))
        with self._writing(labels.nbytes):
            self._file.create_dataset("labels", data=labels)
            self._file.create_dataset("crc32", data=np.asarray(self.sums, dtype=SUMS_DTYPE))
        self.checksums["samples"] = self._hash.hexdigest()
        self.checksums["labels"] = hashlib.sha256(labels.tobytes()).hexdigest()
        self.checksums["crc32"] = hashlib.sha256(np.asarray(self.sums, dtype=SUMS_DTYPE).tobytes()).hexdigest()
        hashed = {"samples": "every sample's CHW bytes (images[i]) concatenated in sample order",
                  "labels": "labels as int64 little-endian bytes", "crc32": "crc32 as uint32 little-endian bytes"}
        layout: dict[str, Any] = {
            "kind": "fixed" if self.shape is not None else "variable",
            "images": "images",
            "labels": "labels",
            "compression": self.compression,
            "sample_sums": {"algorithm": SUMS_ALGORITHM, "dataset": "crc32"},
        }
        if self.shape is not None:
            layout["chunks"] = [1, *self.shape]
        else:
            shapes = np.asarray(self.shapes, dtype=INT_DTYPE).reshape(-1, 3)
            self.checksums["shapes"] = hashlib.sha256(shapes.tobytes()).hexdigest()
            hashed["shapes"] = "shapes as int64 little-endian bytes"
            layout["shapes"] = "shapes"
        if self.targets is not None:   # /targets (see targets)
            with self._writing(self.targets.nbytes):
                self._file.create_dataset("targets", data=self.targets)
            layout["targets"], self.checksums["targets"], hashed["targets"] = "targets", digest(self.targets), HASHED
        origins = getattr(self, "origins", None)
        if origins is not None:  # /provenance/indices, or /provenance/offsets + /provenance/blob
            arrays = origins.arrays()
            with self._writing(sum(a.nbytes for a in arrays.values())):
                group = self._file.create_group("provenance")
                for name, values in arrays.items():
                    group.create_dataset(name, data=values)
            layout["provenance"] = {"kind": origins.kind, "group": "provenance"}
        if self.shape is not None and self.compression == "none" and self._count:
            # each sample's byte offset, so a reader need not walk the chunk index (~3 us a
            # chunk, 0.6 s for 170,000 samples, before its first batch); checked, not trusted
            offsets = np.full(self._count, -1, dtype=INT_DTYPE)

            def record(info: Any) -> None:
                offsets[info.chunk_offset[0]] = info.byte_offset

            if hasattr(self._images.id, "chunk_iter"):
                self._images.id.chunk_iter(record)
                if (offsets >= 0).all():
                    with self._writing(offsets.nbytes):
                        self._file.create_dataset("offsets", data=offsets)
                    layout["offsets"] = "offsets"
        layout["hashed"] = hashed
        return layout

    def set_provenance(self, origins: Origins) -> None:
        """Where each sample came from (``sources.origins``), written by ``finish``."""
        self.origins = origins

    def write_manifest(self, text: str) -> None:
        ensure_space(self.path, len(text.encode("utf-8")))
        with self._writing(len(text)):
            self._file.attrs[MANIFEST_ATTR] = text
            self._file.flush()
            self._file.close()
        self._file = None
        with open(self.path, "rb+") as f:
            os.fsync(f.fileno())
        seal_userblock(self.path)

    def close(self) -> None:
        """Close the file; safe after write_manifest() and after an error.

        After a failed write (or with the disk too full for HDF5 to flush its metadata)
        the file is emptied first, so that HDF5 can close it, and then removed: it cannot
        be resumed (see ``_writing``).
        """
        if self._file is None:
            return
        free = free_bytes(self.path)
        # (closing writes little: what changed since the last flush, which ensure_space kept
        # to nothing when it refused a block; a quarter of the margin covers the superblock)
        if self._broken or (free is not None and free < SPACE_MARGIN // 4):
            os.truncate(self.path, 0)
            try:
                self._file.close()
            finally:
                self._file = None
                self.path.unlink(missing_ok=True)
                self._partial_labels.remove()
            return
        self._file.close()
        self._file = None
