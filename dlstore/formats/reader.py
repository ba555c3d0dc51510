"""StoreReader, the base class of every format's Reader: the public reads, done one way.

A format's reader supplies only its native reads of already-checked indices,
with its handles open; the base class does the rest::

    get(i)                       check i -> open -> _read(i)                 -> sums check
    get_many(indices)            check   -> open -> advise -> _read_many(indices)      -> sums check
    get_batch(indices, out=None) fixed shape? -> check -> open -> out array -> advise -> _read_batch
                                 -> sums check
    read_range(start, stop)      [start, stop) through get_batch (a format with a faster
                                 sequential path overrides it)
    prefetch(indices)            check -> open -> advise (no read)
    release(indices)             check -> open -> let the page cache drop them (no read)
    sample_addresses(indices)    fixed shape? -> check -> open -> advise -> _in_place -> sums check
                                 -> (addresses, the map holding them), or None: read natively

"in place": a format whose samples are runs of uncompressed bytes at known offsets of one
file (``_in_place``: a map of the file and the offsets) has its batches gathered from that map
in one pass (``inplace.py``), and hands a kernel the samples' addresses, so a fused crop reads
them where they lie; ``read_path`` says whether this reader does (``IN_PLACE``) or reads
through the format's library (``NATIVE``), and ``read_path_reason`` why.

"advise": with ``willneed`` on, the kernel is told where every sample of the batch lies
before the gather (``readahead.py``), so a cold batch has all its reads in flight at once;
a format supplies where its samples are (``_extents``).

Readers only fetch stored samples (uint8 CHW arrays); decoding and transforms
live elsewhere. Indices are positions 0..count-1 (see ``common.check_index``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..errors import SampleIndexError, VariableShapeError
from .checks import batch_out, check_index, check_indices
from .handles import ForkSafe
from .inplace import NATIVE, gather, views
from .inplace import addresses as map_addresses
from .integrity import SampleChecks
from .readahead import Extents, advise, advised_ahead, release

# samples of a batch looked up in the page cache before it is advised: all there, no advice
PROBES = 8
# how far back a sample may start from the one before it and still count as in order: a page
ORDER_SLACK = 4096


class SampleLayout(NamedTuple):
    """What a store's layout allows (``StoreReader.sample_layout``, printed by ``dlstore info``)."""

    read_path: str          # "in place" (gatherable: each sample one uncompressed run of bytes) or "native"
    reason: str             # why, in a sentence
    in_order: bool | None   # every sample's bytes after the one before's, give or take a page (None: places
    #                         unknown): a block of consecutive samples is then one range of the file, as
    #                         block shuffle and the window advice assume


class StoreReader(SampleChecks, ForkSafe):
    """A store's samples by index. Subclasses set ``path``, ``count``, ``shape`` (None: variable)
    and ``manifest``, and implement ``_read`` (and ``_read_many`` / ``_read_batch`` where the
    format reads several samples faster than one by one, ``_extents`` where it can say where
    its samples lie on disk).

    ``willneed``: advise the kernel of each batch's samples before reading them (set by the
    format from its reader option, ``readahead.choose_willneed``).

    ``read_path``: ``"in place"`` where batches are gathered from a map of the store's file
    (``_in_place``), ``"native"`` where the format's library reads each sample;
    ``read_path_reason``: why, in a sentence (what ``dlstore info`` prints)."""

    path: Path
    count: int
    shape: tuple[int, int, int] | None
    willneed: bool = False
    read_path: str = NATIVE
    read_path_reason: str = "this format reads through its own library"

    def __len__(self) -> int:
        return self.count

    def get(self, i: int) -> np.ndarray:
        """Sample ``i`` (0 <= i < len) as a uint8 (C, H, W) array."""
        i = check_index(self.path, i, self.count)
        self._ensure_open()
        sample = self._read(i)
        if self.sums is not None:   # what is handed out is what is checked
            self.sums.check(i, sample)
        return sample

    def get_many(self, indices: Any) -> list[np.ndarray]:
        """Samples ``indices``, in that order, each its own (C, H, W) array."""
        checked = check_indices(self.path, indices, self.count)
        indices = checked.tolist()
        self._ensure_open()
        self._advise_batch(checked)
        samples = self._read_many(indices)
        if self.sums is not None:
            self.sums.check_many(indices, samples)
        return samples

    def get_batch(self, indices: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Samples ``indices`` of a fixed-shape store as one (B, C, H, W) array (into ``out`` if given)."""
        if self.shape is None:
            raise VariableShapeError(f"{self.path}: get_batch needs a fixed-shape store (read samples "
                                     "with get/get_many, or convert with a size-fixing static op)")
        indices = check_indices(self.path, indices, self.count)
        self._ensure_open()
        out = batch_out(out, len(indices), self.shape)
        self._advise_batch(indices)
        placed = self._in_place(indices)
        if placed is not None:
            gather(*placed, out)
        else:
            self._read_batch(indices, out)
        if self.sums is not None:
            self.sums.check_many(indices.tolist(), out)
        return out

    def read_range(self, start: int, stop: int, out: np.ndarray | None = None, *, threads: int = 1) -> np.ndarray:
        """Samples ``[start, stop)`` of a fixed-shape store as one (k, C, H, W) array (``threads``:
        used by formats with a sequential path of their own)."""
        self._check_range(start, stop)
        return self.get_batch(np.arange(start, stop, dtype=np.int64), out=out)

    def _check_range(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.count:
            raise SampleIndexError(f"{self.path}: range [{start}, {stop}) out of range for a store of "
                                   f"{self.count} samples")

    def prefetch(self, indices: Any) -> bool:
        """Ask the kernel to read samples ``indices`` ahead (``posix_fadvise(WILLNEED)``, nearby
        samples merged; returns at once); False where this store cannot say where they lie.
        An epoch order that reads ahead by windows calls it (``data/order.py``)."""
        indices = check_indices(self.path, indices, self.count)
        self._ensure_open()
        extents = self._extents(indices) if len(indices) else None
        if extents is None:
            return False
        advise(extents, probe=PROBES)
        return True

    def release(self, indices: Any) -> bool:
        """Let the page cache drop samples ``indices`` read already (``readahead.release``: this
        process's maps page them out, then ``posix_fadvise(DONTNEED)``), so that a store which
        cannot stay cached keeps room for what is advised next; False where this store cannot
        say where they lie. Reading them again reads them from the disk again."""
        indices = check_indices(self.path, indices, self.count)
        self._ensure_open()
        extents = self._extents(indices) if len(indices) else None
        if extents is None:
            return False
        release(extents)
        return True

    def sample_addresses(self, indices: Any) -> tuple[np.ndarray, np.ndarray] | None:
        """(uintp address of each C-contiguous (C, H, W) sample of ``indices``, the map holding
        them: keep it until done) for a kernel reading the samples in place; None where they are
        read natively (``read_path``; variable shapes), which ``get_many`` then does. With the
        per-sample sums on (``check="sample"``) the samples are checked in place first."""
        if self.shape is None:
            return None
        indices = check_indices(self.path, indices, self.count)
        self._ensure_open()
        self._advise_batch(indices)
        placed = self._in_place(indices)
        if placed is None:
            return None
        data, offsets = placed
        if self.sums is not None:
            self.sums.check_many(indices.tolist(), views(data, offsets, [self.shape] * len(indices)))
        return map_addresses(data, offsets), data

    def sample_layout(self) -> SampleLayout:
        """Whether samples are read in place and lie in index order, found from every sample's
        place (LMDB: every leaf page read; HDF5: the chunk index)."""
        self._ensure_open()
        extents = self._extents(np.arange(self.count, dtype=np.int64)) if self.count else None
        in_order = None
        if extents is not None:
            file_no, offset = np.asarray(extents.file_no), np.asarray(extents.offset)
            same = file_no[1:] == file_no[:-1]
            # (within a page: LMDB packs the small values of a leaf page from its end down)
            in_order = bool((file_no[1:] >= file_no[:-1]).all()
                            and (offset[1:][same] >= offset[:-1][same] - ORDER_SLACK).all())
        return SampleLayout(self.read_path, self.read_path_reason, in_order)

    def _advise_batch(self, indices: np.ndarray) -> None:
        """With ``willneed`` on, tell the kernel where the checked ``indices`` lie (handles open),
        unless this thread's loader advised them ahead."""
        if self.willneed and len(indices) > 1 and not advised_ahead():
            extents = self._extents(indices)
            if extents is not None:
                advise(extents, probe=PROBES)

    # --- what a format supplies (indices checked, handles open) ------------------------------

    def _extents(self, indices: np.ndarray) -> Extents | None:
        """Where samples ``indices`` lie in the store's files; None: this store cannot say (no advice)."""
        return None

    def _in_place(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(a map of the file as a uint8 array, the offset of each of ``indices``' samples in it)
        where they can be read in place: sample ``indices[k]`` is the ``C*H*W`` bytes (its own
        shape's, for a variable-shape store) at ``offsets[k]``, every one inside the map;
        None: read them natively."""
        return None

    def _read(self, i: int) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def _read_many(self, indices: list[int]) -> list[np.ndarray]:
        return [self._read(i) for i in indices]

    def _read_batch(self, indices: np.ndarray, out: np.ndarray) -> None:
        for k, i in enumerate(indices.tolist()):
            out[k] = self._read(i)
