"""The shards Reader and its manifest (layout: ``layout.py``)."""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import StoreCorruptError, VariableShapeError
from ...sources.origins import Origins
from ..checks import batch_out, check_indices, safe_member
from ..inplace import IN_PLACE
from ..integrity import check_sidecar_seal
from ..manifest import loads as load_manifest_text
from ..pins import StorePin, check_identity
from ..readahead import Extents, choose_willneed, readahead_default
from ..reader import StoreReader
from ..synced import sha256_file
from ..targets import read_shards
from .layout import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    load_npy,
)


def check_manifest_seal(path: str | os.PathLike) -> tuple[Path, str | None]:
    """(manifest.json, None if ``manifest.json.sha256`` matches it, else the problem or "unsealed")."""
    manifest = Path(path) / MANIFEST_NAME
    return manifest, check_sidecar_seal(manifest)


def read_manifest(path: Path) -> dict[str, Any]:
    where = str(path / MANIFEST_NAME)
    try:
        text = (path / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        raise StoreCorruptError(f"{path}: not a complete shards store (no {MANIFEST_NAME})") from None
    return load_manifest_text(text, where, format=FORMAT, max_format_version=FORMAT_VERSION)


class ShardReader(StoreReader):
    """Reads samples of a shards store as numpy views into memory maps."""

    format = FORMAT
    _handles = ("_maps", "_map_lock")
    read_path, read_path_reason = IN_PLACE, "samples read from maps of the shard files"

    def __init__(self, path: str | os.PathLike, manifest: dict[str, Any] | None = None, *,
                 readahead: bool | None = None, willneed: bool | None = None):
        """``readahead``: the OS readahead of the files' maps; None: on if the store fits in half
        the memory (``readahead.readahead_default``), else off (``MADV_RANDOM``: a fault reads its
        own page). ``willneed``: posix_fadvise(WILLNEED) for each sample of a batch before the
        gather, so a cold batch has all its reads in flight at once (see ``readahead.py``); None:
        on only for a store that cannot stay cached."""
        self.path = Path(path)
        self._pin = StorePin(self.path)   # before reading any of it; held while this reader lives: see common
        self._identity = self._pin.identity
        self.manifest = manifest if manifest is not None else read_manifest(self.path)
        layout = self.manifest["layout"]
        self.count = self.manifest["count"]
        self.kind = layout.get("kind")
        if self.kind == "fixed":
            self.shape = tuple(self.manifest["sample"]["shape"])
            self.per_shard = layout.get("per_shard")
            files = layout.get("shards")
            if not isinstance(self.per_shard, int) or self.per_shard < 1 or not isinstance(files, list):
                raise StoreCorruptError(f"{self.path}: manifest layout is damaged")
        elif self.kind == "variable":
            self.shape = None
            files = layout.get("files")
            if not isinstance(files, list):
                raise StoreCorruptError(f"{self.path}: manifest layout is damaged")
        else:
            raise StoreCorruptError(f"{self.path}: unknown shards layout kind {self.kind!r}")
        try:
            self.files = [safe_member(self.path, entry["file"]) for entry in files]
            counts = [int(entry["count"]) for entry in files]
        except (TypeError, KeyError) as exc:
            raise StoreCorruptError(f"{self.path}: manifest file list is damaged ({exc})") from None
        if sum(counts) != self.count:
            raise StoreCorruptError(
                f"{self.path}: manifest counts {sum(counts)} samples in its files but declares {self.count}")
        if any(n < 0 or (self.kind == "fixed" and n > self.per_shard) for n in counts):
            raise StoreCorruptError(f"{self.path}: manifest file counts {counts} are out of range "
                                    f"(0..{self.per_shard if self.kind == 'fixed' else 'any'} per file)")
        self._counts = counts
        # First sample of each file. A single conversion writes `per_shard` samples per file
        # but the last; stores assembled from several writers (one per rank) have a short
        # file per part, so sample -> file goes through these starts unless the layout is uniform.
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._uniform = self.kind == "fixed" and all(n == self.per_shard for n in counts[:-1])
        labels = load_npy(safe_member(self.path, layout.get("labels", "labels.npy")), mmap=False)
        if labels.dtype != np.int64 or labels.shape != (self.count,):
            raise StoreCorruptError(
                f"{self.path}: labels.npy holds {labels.dtype} {labels.shape}, expected int64 ({self.count},)")
        self.labels = labels
        self.targets = read_shards(self.path, self.manifest)   # (N, K), or None: int labels only
        if self.kind == "variable":
            self._load_index(safe_member(self.path, layout.get("index", "index.npy")))
        self._maps: list[np.ndarray | None] | None = None
        self._pid = None
        sample_bytes = (int(np.prod(self.shape)) if self.kind == "fixed"
                        else float(np.prod(self.index[:, 2:], axis=1).mean()) if self.count else 0.0)
        self.willneed = choose_willneed(willneed, self.count, sample_bytes)
        # the samples' bytes stand for the files' (no stat of every shard at each open)
        self.readahead = readahead_default(self.count * sample_bytes) if readahead is None else bool(readahead)
        self.sums = None   # SampleSums once enable_sample_check() ran (check="sample")

    def _load_sums(self, spec: dict[str, Any]) -> np.ndarray:
        return load_npy(safe_member(self.path, spec.get("file")), mmap=False)

    def _sample_file(self, i: int) -> Path:
        if self.kind == "variable":
            return self.files[int(self.index[i, 0])]
        return self.files[int(np.searchsorted(self._starts, i, side="right")) - 1]

    def _load_index(self, path: Path) -> None:
        index = load_npy(path, mmap=False)
        if index.dtype != np.int64 or index.shape != (self.count, 5):
            raise StoreCorruptError(f"{path}: index holds {index.dtype} {index.shape}, expected int64 ({self.count}, 5)")
        sizes = []
        for f in self.files:
            try:
                sizes.append(f.stat().st_size)
            except FileNotFoundError:
                raise StoreCorruptError(f"{f}: missing data file named in the manifest") from None
        file_no, offset, c, h, w = index.T
        ok = (file_no >= 0) & (file_no < len(self.files)) & (offset >= 0) & (c > 0) & (h > 0) & (w > 0)
        if not ok.all():
            raise StoreCorruptError(f"{path}: index has out-of-range entries (first at sample {int(np.argmin(ok))})")
        ends = offset + c * h * w
        limits = np.asarray(sizes, dtype=np.int64)[file_no]
        # the float product catches damaged sizes whose int64 product wraps around
        beyond = (ends > limits) | (offset + c.astype(np.float64) * h * w > limits)
        if beyond.any():
            bad = int(np.argmax(beyond))
            raise StoreCorruptError(f"{path}: sample {bad} lies beyond the end of {self.files[file_no[bad]].name}")
        self.index = index

    def _open(self) -> None:
        # Each file is mapped the first time a sample in it is read: a worker touches only the
        # files it needs, and one damaged file fails only the samples it holds.
        self._maps = [None] * len(self.files)
        self._map_lock = threading.Lock()   # threads meeting an unmapped file: one maps (and checks) it

    check_files = False  # True (open_dataset(check="open")): each file's sha256 checked when first mapped

    def _check_file(self, k: int, f: Path) -> None:
        expected = self.manifest["checksums"]["files"].get(f.name)
        try:
            actual = sha256_file(f)
        except FileNotFoundError:
            raise StoreCorruptError(f"{f}: missing data file named in the manifest") from None
        if actual != expected:
            held = (f"samples {int(self._starts[k])}..{int(self._starts[k + 1]) - 1}" if self.kind == "fixed"
                    else "the samples stored in it")
            raise StoreCorruptError(f"{f}: sha256 mismatch ({actual[:16]}..., the manifest records "
                                    f"{str(expected)[:16]}...): {held} are damaged; convert again or restore "
                                    "a copy")

    def _map(self, k: int) -> np.ndarray:
        arr = self._maps[k]
        if arr is not None:
            return arr
        with self._map_lock:
            return self._maps[k] if self._maps[k] is not None else self._map_file(k)

    def _map_file(self, k: int) -> np.ndarray:
        f = self.files[k]
        if self.check_files:
            self._check_file(k, f)
        if self.kind == "fixed":
            arr = load_npy(f, mmap=True)
            n = self._counts[k]
            if arr.dtype != np.uint8 or arr.shape != (n, *self.shape):
                raise StoreCorruptError(
                    f"{f}: holds {arr.dtype} {arr.shape}, manifest expects uint8 {(n, *self.shape)}")
        else:
            try:
                arr = np.memmap(f, dtype=np.uint8, mode="c") if f.stat().st_size else np.zeros(0, np.uint8)
            except FileNotFoundError:
                raise StoreCorruptError(f"{f}: missing data file named in the manifest") from None
        check_identity(self.path, self._identity)   # after the open: the file is the old store's, or this raises
        if not self.readahead and getattr(arr, "_mmap", None) is not None:
            arr._mmap.madvise(mmap.MADV_RANDOM)
        self._maps[k] = arr
        return arr

    def origins(self) -> Origins | None:
        """Where each sample came from; None for a store converted before provenance was kept."""
        spec = self.manifest["layout"].get("provenance")
        if spec is None:
            return None
        files = spec.get("files", {}) if isinstance(spec, dict) else {}
        arrays = {name: load_npy(safe_member(self.path, file), mmap=False) for name, file in files.items()}
        return Origins.from_arrays(spec.get("kind"), arrays, str(self.path), count=self.count)

    def _read(self, i: int) -> np.ndarray:
        """Sample ``i`` as a view into the memory map (no copy: the caller's collate does the one copy)."""
        if self.kind == "fixed":
            if self._uniform:
                return self._map(i // self.per_shard)[i % self.per_shard]
            s = int(np.searchsorted(self._starts, i, side="right")) - 1
            return self._map(s)[i - self._starts[s]]
        file_no, offset, c, h, w = (int(v) for v in self.index[i])
        return self._map(file_no)[offset:offset + c * h * w].reshape(c, h, w)

    def _read_batch(self, indices: np.ndarray, out: np.ndarray) -> None:
        shard_no, local = self._locate(indices)
        # sorted(set(...)), not np.unique: the latter imports a numpy submodule on its first
        # call (~50 ms), paid by every fresh DataLoader worker on its first batch
        shards = set(shard_no.tolist())
        if len(shards) == 1:
            # mode="clip" (indices checked above): with the default "raise" numpy gathers
            # into a hidden buffer and copies it to `out`, 2-4x slower for 224x224 samples
            np.take(self._map(shards.pop()), local, axis=0, out=out, mode="clip")
        else:
            # spread over several files: one copy per sample straight into `out` (a fancy-index
            # gather per file would copy every sample twice)
            for k, (s, j) in enumerate(zip(shard_no.tolist(), local.tolist())):
                out[k] = self._map(s)[j]

    def sample_addresses(self, indices: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]] | None:
        """(uintp address of each C-contiguous sample, the maps holding them: keep those until
        done) for a kernel reading in place; None where ``get_many`` must (variable shapes, sums)."""
        if self.kind != "fixed" or self.sums is not None:
            return None
        self._ensure_open()
        indices = check_indices(self.path, indices, self.count)
        self._advise_batch(indices)
        shard_no, local = self._locate(indices)
        maps = {k: self._map(k) for k in set(shard_no.tolist())}
        bases = np.zeros(len(self.files), dtype=np.uint64)
        bases[list(maps)] = [arr.__array_interface__["data"][0] for arr in maps.values()]
        addresses = bases[shard_no] + local.astype(np.uint64) * np.uint64(int(np.prod(self.shape)))
        return addresses.astype(np.uintp), list(maps.values())

    def _locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file number, row in that file) of each of the checked ``indices`` (fixed-shape store)."""
        if self._uniform:
            return indices // self.per_shard, indices % self.per_shard
        shard_no = np.searchsorted(self._starts, indices, side="right") - 1
        return shard_no, indices - self._starts[shard_no]

    def _extents(self, indices: np.ndarray) -> Extents:
        """Fixed shapes: rows after each file's .npy header (mapping a file checks it); variable: the index."""
        if self.kind == "variable":
            rows = self.index[indices]
            return Extents(self.files, rows[:, 0], rows[:, 1], np.prod(rows[:, 2:], axis=1))
        shard_no, local = self._locate(indices)
        headers = np.zeros(len(self.files), dtype=np.int64)
        for k in set(shard_no.tolist()):
            headers[k] = self._map(k).offset
        sample_bytes = int(np.prod(self.shape))
        return Extents(self.files, shard_no, headers[shard_no] + local * sample_bytes, np.int64(sample_bytes))

    def read_range(self, start: int, stop: int, out: np.ndarray | None = None, *, threads: int = 1) -> np.ndarray:
        """Samples ``[start, stop)`` of a fixed-shape store into one C-contiguous (k, C, H, W) array.

        Sequential reads skip the gather of ``get_batch`` (``np.take`` from the
        memory map, ~5 GB/s on one core): each file's byte range is read with
        ``os.preadv`` straight into ``out``, in 8 MiB pieces over ``threads``
        threads (~17 GB/s from the page cache per thread, the GIL released).
        Each file is validated (header, dtype, shape, size) as ``get`` does.
        """
        if self.kind != "fixed":
            raise VariableShapeError(f"{self.path}: read_range needs a fixed-shape store")
        self._check_range(start, stop)
        self._ensure_open()
        out = batch_out(out, stop - start, self.shape)  # checks that out is C-contiguous
        sample_bytes = int(np.prod(self.shape))
        flat = memoryview(out.reshape(-1))
        jobs = []
        i = start
        while i < stop:
            k = int(np.searchsorted(self._starts, i, side="right")) - 1
            j = min(stop, int(self._starts[k + 1]))
            data_offset = self._map(k).offset             # validates the file; the map itself is not read
            first = (i - start) * sample_bytes
            local = data_offset + (i - int(self._starts[k])) * sample_bytes
            nbytes = (j - i) * sample_bytes
            for p in range(0, nbytes, _PIECE):
                q = min(nbytes, p + _PIECE)
                jobs.append((self.files[k], local + p, flat[first + p:first + q]))
            i = j
        if threads > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(min(threads, len(jobs)), thread_name_prefix="dlstore-read") as pool:
                for done in [pool.submit(_pread_into, *job) for job in jobs]:
                    done.result()
        else:
            for job in jobs:
                _pread_into(*job)
        check_identity(self.path, self._identity)   # the files were opened by name above
        if self.sums is not None:
            self.sums.check_many(range(start, stop), out)
        return out


_PIECE = 8 << 20   # bytes per preadv call of read_range


def _pread_into(path: Path, offset: int, view: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise StoreCorruptError(f"{path}: ended early (truncated while reading?)")
            done += got
    finally:
        os.close(fd)
