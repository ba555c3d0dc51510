"""Integrity checks beyond the manifest: whole-file seals and per-sample CRC32 sums.

Two mechanisms, for two questions:

* a **seal** (LMDB, HDF5): is this data file, every byte of it, the file conversion
  wrote? Checked by ``dlstore verify`` and by ``open_dataset(check="open")``, before the
  file reaches the C library (damaged metadata pages can crash or hang LMDB and HDF5).
* **sample sums** (every format): is the record about to be returned the one conversion
  wrote for this index? ``zlib.crc32`` of each sample's stored bytes (the raw CHW pixels,
  or the JPEG/PNG file of an encoded store), computed by the Writer from the bytes it
  stores and kept in the store as one uint32 per sample::

      shards  crc32.npy            uint32 (N,)   also in checksums.files (sha256)
      LMDB    key __crc32__        uint32 little-endian (N,); checksums.files["crc32"]
      HDF5    dataset /crc32       uint32 (N,);  checksums.files["crc32"]

  and named in the manifest: ``layout["sample_sums"] = {"algorithm": "crc32", <where>}``.
  ``open_dataset(check="sample")`` checks every sample a reader returns against it, on
  the copy it returns (or, for shards, the memory-mapped view), so a damaged sample is
  an error, never pixels. CRC32 finds every burst of up to 32 flipped bits and any other
  change with probability 1 - 2**-32; it is a damage detector, not a defence against an
  adversary (the sums live beside the data).
"""

from __future__ import annotations

import hashlib
import os
import weakref
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import StoreCorruptError, UsageError
from .synced import sha256_file, write_synced

SUMS_ALGORITHM = "crc32"
SUMS_DTYPE = np.dtype("<u4")


def record_crc(data: Any) -> int:
    """CRC32 of an array's bytes in C order (the bytes a Writer stores for a sample)."""
    data = np.ascontiguousarray(data)
    return zlib.crc32(memoryview(data).cast("B")) if data.size else 0


def sums_spec(layout: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest's description of the per-sample sums, or None for a store without them."""
    spec = layout.get("sample_sums")
    return spec if isinstance(spec, dict) else None


def no_sums_error(path: Path) -> UsageError:
    """check="sample" on a store converted before per-sample sums existed."""
    return UsageError(f"{path}: check='sample' needs per-sample CRC32 sums, and this store has none (it was "
                      "converted by a dlstore that did not record them); open it with check='open' (the "
                      "whole-file sha256/seal), check it with dlstore verify, or convert it again to get them")


def sums_array(raw: Any, count: int, where: str) -> np.ndarray:
    """The stored sums as a uint32 (count,) array, or StoreCorruptError naming ``where``."""
    sums = np.asarray(raw)
    if sums.dtype.kind != "u" or sums.dtype.itemsize != 4 or sums.shape != (count,):
        raise StoreCorruptError(f"{where}: per-sample sums hold {sums.dtype} {sums.shape}, expected uint32 "
                                f"({count},); the store is damaged: convert again or restore a copy")
    return sums.astype(np.uint32, copy=False)


class SampleSums:
    """Expected CRC32 of every sample; checks what a reader is about to return.

    Args:
        sums: uint32 (N,), sample i's CRC32 at position i.
        where: returns the function sample index -> the file to name in errors (the shard holding it,
            data.mdb, the .h5), or None when that is gone (then the message names no file).
    """

    def __init__(self, sums: np.ndarray, where: Callable[[], Callable[[int], Path] | None] | None):
        self.sums = sums
        self.where = where

    def __getstate__(self) -> dict[str, Any]:
        return {"sums": self.sums, "where": None}   # a weak reference does not pickle; the reader rebinds it

    def check(self, i: int, data: Any) -> None:
        """StoreCorruptError unless ``data`` (sample ``i`` as read) has the recorded CRC32."""
        actual = record_crc(data)
        if actual != int(self.sums[i]):
            self._raise([(int(i), actual)], 1)

    def check_many(self, indices: Sequence[int], samples: Sequence[Any]) -> None:
        """``check`` for a batch; one error naming every damaged sample of it."""
        bad = []
        for i, data in zip(indices, samples):
            actual = record_crc(data)
            if actual != int(self.sums[i]):
                bad.append((int(i), actual))
        if bad:
            self._raise(bad, len(indices))

    def _raise(self, bad: list[tuple[int, int]], total: int) -> None:
        i, actual = bad[0]
        if len(bad) == 1:
            what = f"sample {i} fails its CRC32 check (its bytes give {actual:08x}, conversion recorded " \
                   f"{int(self.sums[i]):08x})"
        else:
            listed = ", ".join(str(j) for j, _ in bad[:20]) + (", ..." if len(bad) > 20 else "")
            what = f"samples {listed} ({len(bad)} of the {total} read) fail their CRC32 check"
        file = self.where() if self.where is not None else None
        raise StoreCorruptError(f"{file(i) if file is not None else 'store'}: {what}: the stored data changed since conversion; "
                                "dlstore verify --deep on the store lists every damaged sample; convert again or "
                                "restore a copy")


# --- whole-file seals (LMDB, HDF5) -------------------------------------------------------
# The manifest of an LMDB or HDF5 store lives inside its one data file, so it cannot hold
# that file's own digest. The sums it records cover the samples, labels and shapes only;
# bytes that reach no sample (page headers, B-tree and free pages, HDF5 metadata and free
# space) could change unseen. A seal closes that gap: the sha256 of the data file, written
# after the last byte of the store, where the library does not look:
#
#   HDF5: the file's 512-byte user block (HDF5 skips it; h5py.File(..., userblock_size=512))
#         b"dlstore-seal sha256 <64 hex> of bytes 512..end\n", zero padded
#   LMDB: a file ``data.mdb.sha256`` beside data.mdb: "<64 hex>  data.mdb\n" (sha256sum format)
#
# ``dlstore verify`` checks it, and so does a reader opened with check="open". Stores
# written before seals existed have none; they are reported as unsealed, not as damaged.

SEAL_BLOCK = 512
SEAL_MAGIC = b"dlstore-seal sha256 "


def sha256_range(path: Path, start: int = 0) -> str:
    """sha256 hex digest of a file's bytes from ``start`` to the end."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def seal_userblock(path: Path) -> None:
    """Write the digest of bytes ``SEAL_BLOCK..end`` of ``path`` into its user block, and fsync."""
    line = SEAL_MAGIC + sha256_range(path, SEAL_BLOCK).encode() + b" of bytes 512..end\n"
    with open(path, "r+b") as f:
        f.write(line.ljust(SEAL_BLOCK, b"\0"))
        f.flush()
        os.fsync(f.fileno())


def check_userblock_seal(path: Path) -> str | None:
    """None if the user-block seal of ``path`` matches its bytes, else what is wrong (or "unsealed")."""
    try:
        with open(path, "rb") as f:
            head = f.read(SEAL_BLOCK)
    except OSError as exc:
        return f"unreadable ({exc})"
    if not head.startswith(SEAL_MAGIC):
        # HDF5 files start with their signature when there is no user block
        return "unsealed" if head.startswith(b"\x89HDF\r\n\x1a\n") else \
            "the first 512 bytes hold neither an HDF5 signature nor a dlstore seal: the file is damaged"
    digest = head[len(SEAL_MAGIC):len(SEAL_MAGIC) + 64].decode("ascii", "replace")
    actual = sha256_range(path, SEAL_BLOCK)
    expected_head = (SEAL_MAGIC + actual.encode() + b" of bytes 512..end\n").ljust(SEAL_BLOCK, b"\0")
    if digest == actual and head != expected_head:   # the rest of the user block is covered too
        return "the seal's user block was changed after conversion (bytes 0..511 differ from the seal written)"
    if digest != actual:
        return (f"sha256 mismatch: the file changed since conversion (bytes 512..end hash to {actual[:16]}..., "
                f"its seal says {digest[:16]}...)")
    return None


def userblock_seal(path: str | os.PathLike) -> tuple[Path, str | None]:
    """(the file, None if its user-block seal matches its bytes, else the problem or "unsealed")."""
    return Path(path), check_userblock_seal(Path(path))


def seal_sidecar(path: Path) -> None:
    """Write ``path.sha256`` (sha256sum format) beside ``path``, and fsync it."""
    write_synced(path.with_name(path.name + ".sha256"), f"{sha256_file(path)}  {path.name}\n".encode())


def check_sidecar_seal(path: Path) -> str | None:
    """None if ``path.sha256`` matches ``path``'s bytes, else what is wrong (or "unsealed")."""
    seal = path.with_name(path.name + ".sha256")
    try:
        data = seal.read_bytes()
    except FileNotFoundError:
        return "unsealed"
    except OSError as exc:
        return f"{seal.name} unreadable ({exc})"
    try:
        actual = sha256_file(path)
    except OSError as exc:
        return f"unreadable ({exc})"
    if data.split()[:1] != [actual.encode()]:
        return (f"sha256 mismatch: the file changed since conversion (it hashes to {actual[:16]}..., "
                f"{seal.name} says {data[:16]!r}...)")
    if data != f"{actual}  {path.name}\n".encode():   # the whole seal file is what was written, or damaged
        return f"{seal.name} was changed after conversion (its digest matches, the rest differs from what was written)"
    return None


class SampleChecks:
    """Mixin for readers: ``enable_sample_check()`` (open_dataset(check="sample")) loads the sums.

    A reader sets ``self.sums`` to None in ``__init__``, implements ``_load_sums(spec)`` (the
    stored array) and ``_sample_file(i)`` (the file to name), and passes what it returns
    through ``self.sums.check*`` when ``self.sums`` is set.
    """

    sums: SampleSums | None = None

    def enable_sample_check(self) -> None:
        """Check every sample read from now on against its CRC32; UsageError if the store has none."""
        spec = sums_spec(self.manifest["layout"])
        if spec is None:
            raise no_sums_error(self.path)
        if spec.get("algorithm") != SUMS_ALGORITHM:
            raise StoreCorruptError(f"{self.path}: per-sample sums use {spec.get('algorithm')!r}, this dlstore "
                                    f"checks {SUMS_ALGORITHM!r}; upgrade dlstore or use check='open'")
        self._check_metadata()
        # a weak reference: no reader -> sums -> reader cycle, so a dropped reader closes its files at once
        self.sums = SampleSums(sums_array(self._load_sums(spec), self.count, str(self.path)),
                               weakref.WeakMethod(self._sample_file))

    def _check_metadata(self) -> None:
        """Labels, shapes and targets (read once at open, held in memory) against the manifest's sha256s: the
        per-sample sums cover the pixels, these say which class and shape the pixels have."""
        files = self.manifest["checksums"]["files"]
        for name in ("labels", "shapes", "targets"):   # LMDB, HDF5: digests of the little-endian values
            values = getattr(self, name, None)
            if name in files and values is not None and files[name] != hashlib.sha256(np.ascontiguousarray(
                    values, dtype=np.asarray(values).dtype.newbyteorder("<")).tobytes()).hexdigest():
                raise StoreCorruptError(f"{self.path}: its {name} changed since conversion (sha256 mismatch); "
                                        "convert again or restore a copy")
        for key in ("labels", "index", "targets"):     # shards: the .npy files
            name = self.manifest["layout"].get(key)
            if isinstance(name, str) and name.endswith(".npy") and name in files \
                    and sha256_file(self.path / name) != files[name]:
                raise StoreCorruptError(f"{self.path / name}: sha256 mismatch: changed since conversion; "
                                        "convert again or restore a copy")

    def __setstate__(self, state: dict[str, Any]) -> None:   # (pickled into DataLoader workers: spawn)
        self.__dict__.update(state)
        if self.sums is not None:
            self.sums.where = weakref.WeakMethod(self._sample_file)

    def _load_sums(self, spec: dict[str, Any]) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _sample_file(self, i: int) -> Path:
        return self.path
