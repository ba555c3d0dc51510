"""The shards Writer: fills a staging path (layout: ``layout.py``)."""

from __future__ import annotations

import hashlib
import os
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ArgumentError, StoreCorruptError
from ...sources.origins import Origins
from ..checks import check_sample
from ..integrity import SUMS_ALGORITHM, SUMS_DTYPE, record_crc, seal_sidecar
from ..synced import PartialRows, save_npy_synced, sha256_file, write_synced
from ..targets import WithTargets
from .layout import (
    DEFAULT_SHARD_SIZE,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    npy_header,
)


class _HashingFile:
    """A file opened for writing that hashes what goes through it."""

    def __init__(self, path: Path):
        self.path = path
        self.f = open(path, "wb")  # noqa: SIM115 - closed by close(), after the last write
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.hash.update(data)
        self.size += len(data)

    def close(self) -> str:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return self.hash.hexdigest()


class ShardWriter(WithTargets):
    """Writes samples in order into a staging folder; see the module doc for the layout.

    Used by ``dlstore.convert``, which owns staging and publishing; a writer only
    fills the folder it is given. A data file is a unit of resumption: ``add``
    returns True when it completed one, and ``checkpoint()`` then describes the
    writer's state so that ``ShardWriter.resume`` can continue from it.
    """

    format = FORMAT
    format_version = FORMAT_VERSION
    _PARTIAL_LABELS = "labels.partial"  # int64 rows of completed files, appended at checkpoints
    _PARTIAL_INDEX = "index.partial"    # (variable shapes) 5 int64 per sample, as in index.npy
    _PARTIAL_SUMS = "crc32.partial"     # CRC32 of each sample (as int64), as in crc32.npy

    def __init__(self, folder: Path, *, shape: tuple[int, int, int] | None,
                 shard_size: int = DEFAULT_SHARD_SIZE, compression: str | None = "none",
                 _create: bool = True, **_: Any):
        if compression not in (None, "none"):
            raise ArgumentError(f"compression={compression!r}: shards stores are memory-mapped raw arrays; "
                                "compression applies to hdf5 stores only (or use encoding='jpeg'/'png')")
        self.folder = Path(folder)
        if _create:
            self.folder.mkdir(parents=True, exist_ok=False)
        elif not self.folder.is_dir():  # _create=False: reopen (resume)
            raise StoreCorruptError(f"{self.folder}: nothing to resume (no such folder); rerun without --resume")
        self.shape = shape
        self.shard_size = int(shard_size)
        # int64 arrays, not lists of Python objects: 8 (labels) + 40 (index) bytes per sample
        self.labels = array("q")
        self.sums = array("q")   # CRC32 of each sample's bytes
        self.checksums: dict[str, str] = {}
        self._file: _HashingFile | None = None
        self._files: list[dict[str, Any]] = []
        self._index = array("q")  # file number, byte offset, C, H, W of each sample, flat
        self._partial_labels = PartialRows(self.folder / self._PARTIAL_LABELS, 1)
        self._partial_index = PartialRows(self.folder / self._PARTIAL_INDEX, 5)
        self._partial_sums = PartialRows(self.folder / self._PARTIAL_SUMS, 1)
        if shape is not None:
            self.sample_bytes = int(np.prod(shape))
            self.per_shard = max(1, self.shard_size // self.sample_bytes)

    def _open_next(self) -> None:
        n = len(self._files)
        if self.shape is not None:
            name = f"shard-{n:05d}.npy"
            self._file = _HashingFile(self.folder / name)
            self._file.write(npy_header(self.per_shard, self.shape))
        else:
            name = f"data-{n:05d}.bin"
            self._file = _HashingFile(self.folder / name)
        self._files.append({"file": name, "count": 0})

    def _close_file(self) -> None:
        if self._file is not None:
            self.checksums[self._files[-1]["file"]] = self._file.close()
            self._file = None

    def add(self, sample: np.ndarray, label: int) -> bool:
        """Append one uint8 CHW sample and its label; True if this completed a data file."""
        check_sample(self.folder, sample, self.shape)   # a float array would be written as its raw bytes
        if self._file is None:
            self._open_next()
        if self.shape is None:
            c, h, w = sample.shape
            self._index.extend((len(self._files) - 1, self._file.size, c, h, w))
        sample = np.ascontiguousarray(sample)
        self._file.write(memoryview(sample).cast("B"))
        self.sums.append(record_crc(sample))
        self._files[-1]["count"] += 1
        self.labels.append(int(label))
        full = (self._files[-1]["count"] == self.per_shard if self.shape is not None
                else self._file.size >= self.shard_size)
        if full:
            self._close_file()
        return full

    def checkpoint(self) -> dict[str, Any]:
        """Persist labels/index of completed files; return the state ``resume`` needs.

        Only called right after ``add`` returned True, so no data file is open.
        """
        rows = len(self.labels)
        self._partial_labels.append(self.labels, rows)
        self._partial_sums.append(self.sums, rows)
        if self.shape is None:
            self._partial_index.append(self._index, rows)
        return {"files": [dict(f) for f in self._files], "checksums": dict(self.checksums), "rows": rows}

    @classmethod
    def resume(cls, folder: Path, state: dict[str, Any], *, shape: tuple[int, int, int] | None,
               **options: Any) -> ShardWriter:
        """Reopen a staging folder at a checkpoint, dropping everything written after it."""
        writer = cls(folder, shape=shape, _create=False, **options)
        rows = int(state["rows"])
        writer._files.extend(dict(f) for f in state["files"])
        writer.checksums.update(state["checksums"])
        keep = {f["file"] for f in writer._files} | {cls._PARTIAL_LABELS, cls._PARTIAL_INDEX, cls._PARTIAL_SUMS}
        for path in writer.folder.iterdir():
            if path.name not in keep and not path.name.startswith("progress.json"):   # (and its .targets)
                path.unlink()
        writer.labels.extend(writer._partial_labels.restore(rows))
        writer.sums.extend(writer._partial_sums.restore(rows))
        if shape is None:
            writer._index.extend(writer._partial_index.restore(rows))
        return writer

    def finish(self) -> dict[str, Any]:
        """Complete the data files; return the manifest's ``layout`` (checksums in ``self.checksums``)."""
        self._close_file()
        layout: dict[str, Any] = {"labels": "labels.npy"}
        if self.shape is not None:
            last = self._files[-1] if self._files else None
            if last is not None and last["count"] != self.per_shard:
                path = self.folder / last["file"]
                with open(path, "r+b") as f:
                    f.write(npy_header(last["count"], self.shape))
                    f.flush()
                    os.fsync(f.fileno())
                self.checksums[last["file"]] = sha256_file(path)
            layout.update(kind="fixed", per_shard=self.per_shard, shards=self._files)
        else:
            index = np.frombuffer(self._index, dtype=np.int64).reshape(-1, 5)
            self._save("index.npy", index)
            layout.update(kind="variable", files=self._files, index="index.npy")
        self._save("labels.npy", np.frombuffer(self.labels, dtype=np.int64))
        self._save("crc32.npy", np.asarray(self.sums, dtype=SUMS_DTYPE))
        layout["sample_sums"] = {"algorithm": SUMS_ALGORITHM, "file": "crc32.npy"}
        if self.targets is not None:
            self._save("targets.npy", self.targets)
            layout["targets"] = "targets.npy"
        origins = getattr(self, "origins", None)
        if origins is not None:  # provenance-{indices | offsets, blob}.npy
            files = {name: f"provenance-{name}.npy" for name in origins.arrays()}
            for name, values in origins.arrays().items():
                self._save(files[name], values)
            layout["provenance"] = {"kind": origins.kind, "files": files}
        self._partial_labels.remove()
        self._partial_index.remove()
        self._partial_sums.remove()
        return layout

    def _save(self, name: str, array: np.ndarray) -> None:
        self.checksums[name] = save_npy_synced(self.folder / name, array)

    def set_provenance(self, origins: Origins) -> None:
        """Where each sample came from (``sources.origins``), written by ``finish``."""
        self.origins = origins

    def write_manifest(self, text: str) -> None:
        write_synced(self.folder / MANIFEST_NAME, text.encode("utf-8"))
        seal_sidecar(self.folder / MANIFEST_NAME)

    def close(self) -> None:
        """Release open files; safe after finish() and after an error."""
        if self._file is not None:
            self._file.f.close()
            self._file = None
