"""Epoch orders for stores bigger than the page cache: block shuffle.

A full shuffle touches the whole store in every window of the epoch, so once the store is
bigger than memory each page read from disk is evicted before its neighbours are needed, and
a sample smaller than the disk's read unit costs a whole unit. Block shuffle keeps the reads
local, as MosaicML Streaming's ``py1b`` shuffle and FFCV's ``QUASI_RANDOM`` order do::

    samples    0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15 | 16 17        blocks of block_size (4)
    blocks     shuffled:  [12..15] [4..7] | [16 17] [0..3] | [8..11]       windows of `window` (2) blocks
    epoch      samples shuffled within each window:
               6 13 4 15 12 7 5 14 | 1 16 3 0 17 2 | 10 8 11 9

Only a window's blocks are read at a time, so the page cache needs a window
(``window * block_size`` samples per rank), not the store. Where the store cannot stay cached,
a window read already is let go (``release``) once the one after it has been read too: pages
read through a map count as used and would otherwise outlive, in a small memory cgroup, the
next window's advised pages not yet read. With the whole store in one
window the order is a uniform permutation, a full shuffle. The order of an epoch is a pure
function of (seed, epoch): every rank computes the same one and takes its own part, and a
resumed loader recomputes it. The randomness against a full shuffle is measured in
docs/reading.md (``benchmarks/bigger_than_ram.py`` prints it).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from .._system import memory_available
from ..errors import ArgumentError, ArgumentTypeError
from ..formats.readahead import Extents, advise, release_default

# Default block: 4 MiB of store, 32 readahead units of 128 KiB, so reading a block costs
# bandwidth rather than seeks; a window of 64 such blocks is 256 MiB.
BLOCK_BYTES = 4 << 20
# Default window: a quarter of the memory left to this process (shared by the node's ranks),
# leaving the rest to the model, pinned buffers and the other processes' page cache.
WINDOW_SHARE = 0.25
FALLBACK_MEMORY = 4 << 30   # when the machine's memory cannot be read


def _blocks(n: int, block_size: int, seed: int, epoch: int) -> tuple[np.random.Generator, int, np.ndarray]:
    rng = np.random.default_rng(np.random.SeedSequence([seed % (1 << 64), epoch % (1 << 64)]))
    block_size = max(1, min(block_size, n))
    return rng, block_size, rng.permutation(-(-n // block_size))


def block_shuffle(n: int, block_size: int, window: int, seed: int, epoch: int = 0) -> np.ndarray:
    """The block-shuffled order of ``range(n)`` for ``(seed, epoch)``: an int64 permutation."""
    rng, block_size, order = _blocks(n, block_size, seed, epoch)
    blocks = len(order)
    idx = (order[:, None] * block_size + np.arange(block_size)).ravel()
    window_of = np.repeat(np.arange(blocks) // window, block_size)
    keep = idx < n                          # the last block may be short
    idx, window_of = idx[keep], window_of[keep]
    return idx[np.lexsort((rng.random(len(idx)), window_of))]


def windows(n: int, block_size: int, window: int, seed: int, epoch: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """The blocks of each window of ``block_shuffle(n, ...)`` (sorted), and the position in the
    epoch where each window starts."""
    _, block_size, order = _blocks(n, block_size, seed, epoch)
    groups = [np.sort(order[w:w + window]) for w in range(0, len(order), window)]
    sizes = [int(np.minimum((g + 1) * block_size, n).sum() - (g * block_size).sum()) for g in groups]
    return groups, np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64)]).astype(np.int64)


class Readahead:
    """Asks the kernel to read blocks of samples ahead (``posix_fadvise(WILLNEED)``), so a window
    is read as a few large sequential reads instead of one fault per sample.

    Where the dataset can say where its samples lie (``StoreDataset.prefetch``: every
    format's fixed-shape stores), those exact bytes. Elsewhere an estimate: every format writes
    its samples in index order, so sample ``i`` of ``n`` lies near byte ``i / n`` of the store's
    data files (the files holding 95 % of its bytes, in name order). The estimate drifts by what
    the files hold besides samples (LMDB's B-tree and metadata: by 7 MB, more than a 4 MiB
    block, at the end of a 1.4 GB store, so its last windows were advised beside their
    blocks). Advice only: a block a little off costs some bandwidth, never a wrong sample.
    """

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self.exact = hasattr(dataset, "prefetch")
        self.path = Path(dataset.path)
        self.n = len(dataset)

    @functools.cached_property
    def _layout(self) -> tuple[list[Path], np.ndarray, np.ndarray]:
        """(data files, their sizes, their cumulative ends): the estimate's, listed on its first use."""
        path = self.path
        files = [path] if path.is_file() else sorted((f for f in path.rglob("*") if f.is_file()),
                                                     key=lambda f: -f.stat().st_size)
        sizes = [f.stat().st_size for f in files]
        keep = next((k + 1 for k in range(len(sizes)) if sum(sizes[:k + 1]) >= 0.95 * sum(sizes)), len(sizes))
        kept = sorted(files[:keep])
        kept_sizes = np.array([f.stat().st_size for f in kept], dtype=np.int64)
        return kept, kept_sizes, np.cumsum(kept_sizes)

    def release(self, indices: np.ndarray) -> bool:
        """Let the page cache drop samples ``indices`` (the dataset's ``release``); False
        where the reader cannot (an estimate could drop a neighbouring block not read yet)."""
        release = getattr(self.dataset, "release", None)
        return bool(release is not None and release(indices))

    def __call__(self, first: int, stop: int) -> None:
        """Advise the bytes of samples ``[first, stop)``."""
        if self.exact:
            self.exact = self.dataset.prefetch(np.arange(first, stop, dtype=np.int64))
            if self.exact:
                return
        files, sizes, ends = self._layout
        total = int(ends[-1]) if len(ends) else 0
        start, end = first * total // max(self.n, 1), -(-stop * total // max(self.n, 1))
        k = int(np.searchsorted(ends, start, side="right"))
        while k < len(files) and start < end:
            base = int(ends[k] - sizes[k])
            length = min(end, int(ends[k])) - start
            advise(Extents([files[k]], np.zeros(1, dtype=np.int64), np.array([start - base]),
                           np.array([length])))
            start += length
            k += 1


def store_bytes(path: str | os.PathLike) -> int:
    """Bytes of a store on disk: the file, or every file under the folder."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def default_blocks(dataset: Any, *, ranks_per_node: int = 1) -> tuple[int, int]:
    """``(block_size, window)`` for a store: blocks of about ``BLOCK_BYTES``, a window of
    ``WINDOW_SHARE`` of the available memory per rank on this node for two windows (the one
    read and the next, read ahead), at least 2 blocks."""
    n = len(dataset)
    per_sample = max(1.0, store_bytes(dataset.path) / max(n, 1))
    block_size = max(1, min(n, round(BLOCK_BYTES / per_sample)))
    memory = memory_available()
    memory = FALLBACK_MEMORY if memory is None else memory
    budget = memory * WINDOW_SHARE / max(1, ranks_per_node)
    blocks = max(1, -(-n // block_size))
    # Two windows are resident at once: the one being read and the next, read ahead as it begins.
    window = int(min(blocks, max(2, budget // (2 * block_size * per_sample))))
    return block_size, window


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ArgumentError(f"BlockShuffleSampler: {name} must be a positive int, got {value!r}")
    return value


class BlockShuffleSampler(Sampler[int]):
    """Shuffle blocks of consecutive samples, then the samples within windows of blocks.

    A ``sampler=`` for ``dlstore.loader`` or a ``torch.utils.data.DataLoader``. Split between
    ranks as ``DistributedSampler`` splits (padded by repeating the order's first samples, or
    trimmed with ``drop_last``), each rank taking a contiguous part of the epoch's order, so it
    reads whole windows. Call ``set_epoch(epoch)`` before each epoch, as with ``DistributedSampler``.

    Args:
        data_source: the dataset (a store's dataset sizes the defaults) or its length.
        block_size: consecutive samples per block (None: about 4 MiB of store).
        window: blocks whose samples are shuffled together (None: a quarter of the memory
            available, per rank on this node; the whole store when it fits: a full shuffle).
        seed: the order of epoch ``e`` is a function of ``(seed, e)``. None: drawn from
            ``generator`` (torch's default generator when None) at each pass, as
            ``RandomSampler`` draws; ranks must agree, so distributed it defaults to 0.
        generator: where ``seed=None`` draws from.
        num_replicas, rank: this rank's share (default: the process group's with
            ``distributed=True``, else the whole epoch).
        distributed: take ``num_replicas`` and ``rank`` from the initialised ``torch.distributed`` group.
        drop_last: with ranks, drop the tail instead of padding to equal shares.
        readahead: as a window begins, ask the kernel to read the next window's blocks
            (:class:`Readahead`; None: on for a store's dataset).
        release: with readahead, as a window begins, let the page cache drop the window two
            before it (``StoreReader.release``; the windows left at the end of a pass, as the
            next pass begins). None: on for a store that cannot stay cached (larger than half
            the memory, physical or this process's cgroup limit: ``readahead.release_default``).
    """

    def __init__(self, data_source: Sized | int, *, block_size: int | None = None, window: int | None = None,
                 seed: int | None = None, generator: torch.Generator | None = None,
                 num_replicas: int | None = None, rank: int | None = None, distributed: bool = False,
                 drop_last: bool = False, readahead: bool | None = None, release: bool | None = None):
        if isinstance(data_source, bool) or not isinstance(data_source, (int, Sized)):
            raise ArgumentTypeError(f"BlockShuffleSampler takes a dataset or its length, got "
                                    f"{type(data_source).__name__}")
        self.n = data_source if isinstance(data_source, int) else len(data_source)
        if self.n < 0:
            raise ArgumentError(f"BlockShuffleSampler: a length must be >= 0, got {self.n}")
        if distributed:
            if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                raise ArgumentError("BlockShuffleSampler(distributed=True) needs an initialised "
                                    "torch.distributed process group")
            num_replicas = torch.distributed.get_world_size() if num_replicas is None else num_replicas
            rank = torch.distributed.get_rank() if rank is None else rank
        self.num_replicas = _positive("num_replicas", 1 if num_replicas is None else num_replicas)
        self.rank = 0 if rank is None else rank
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or not 0 <= self.rank < self.num_replicas:
            raise ArgumentError(f"BlockShuffleSampler: rank must be in [0, {self.num_replicas}), got {rank!r}")
        if block_size is None or window is None:
            if not hasattr(data_source, "path"):
                raise ArgumentError("BlockShuffleSampler: pass block_size= and window= (the defaults are "
                                    "sized from a store's bytes: give it the store's dataset)")
            ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
            chosen = default_blocks(data_source, ranks_per_node=ranks)
            block_size = chosen[0] if block_size is None else block_size
            window = chosen[1] if window is None else window
        self.block_size = _positive("block_size", block_size)
        self.window = _positive("window", window)
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ArgumentTypeError(f"BlockShuffleSampler: seed must be an int or None, got {seed!r}")
        self.seed = 0 if seed is None and self.num_replicas > 1 else seed
        self.generator = generator
        self.drop_last = bool(drop_last)
        self.epoch = 0
        if self.drop_last and self.n % self.num_replicas:
            self.num_samples = math.ceil((self.n - self.num_replicas) / self.num_replicas)
        else:
            self.num_samples = math.ceil(self.n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        if readahead is None:
            readahead = hasattr(data_source, "path") and hasattr(os, "posix_fadvise")
        if readahead and not hasattr(data_source, "path"):
            raise ArgumentError("BlockShuffleSampler: readahead=True reads a store's files: give it the store's dataset")
        self.readahead = Readahead(data_source) if readahead else None
        if release is None:
            release = self.readahead is not None and release_default(store_bytes(data_source.path))
        if release and self.readahead is None:
            raise ArgumentError("BlockShuffleSampler: release=True lets go of windows read ahead: "
                                "it needs readahead (a store's dataset, readahead not False)")
        self.release = bool(release)
        self._unreleased: list[np.ndarray] = []   # samples of windows read but not let go yet

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next pass yields."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def order(self, seed: int | None = None) -> np.ndarray:
        """This rank's indices for the current epoch (``seed``: the one a pass with ``seed=None`` drew)."""
        seed = self.seed if seed is None else seed
        if seed is None:
            raise ArgumentError("BlockShuffleSampler.order: this sampler draws its seed per pass; pass seed=")
        if self.n == 0:
            return np.zeros(0, dtype=np.int64)
        full = block_shuffle(self.n, self.block_size, self.window, seed, self.epoch)
        if self.total_size > self.n:       # pad with the order's first samples, as DistributedSampler does
            full = np.concatenate([full, np.resize(full, self.total_size - self.n)])
        start = self.rank * self.num_samples
        return full[start:start + self.num_samples]

    def __iter__(self) -> Iterator[int]:
        seed = self.seed
        if seed is None:
            seed = int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
        mine = self.order(seed).tolist()
        return iter(mine) if self.readahead is None else self._reading_ahead(mine, seed)

    def _reading_ahead(self, mine: list[int], seed: int) -> Iterator[int]:
        groups, starts = windows(self.n, self.block_size, self.window, seed, self.epoch)
        first = self.rank * self.num_samples
        stop = min(first + self.num_samples, self.n)          # the padding repeats samples read already
        if stop <= first:
            yield from mine
            return
        w0, w1 = (int(np.searchsorted(starts, p, side="right")) - 1 for p in (first, stop - 1))
        # the position in this rank's part where each of its windows begins
        enter_at = {max(int(starts[w]), first) - first: w for w in range(w0, w1 + 1)}
        block_size = max(1, min(self.block_size, self.n))

        def advise(w: int) -> None:
            for b in groups[w].tolist():
                self.readahead(b * block_size, min((b + 1) * block_size, self.n))

        def samples(w: int) -> np.ndarray:
            return np.concatenate([np.arange(b * block_size, min((b + 1) * block_size, self.n))
                                   for b in groups[w].tolist()]).astype(np.int64)

        # a window partly another rank's is never let go: that rank may read it later
        whole = {w for w in range(w0, w1 + 1)
                 if starts[w] >= first and (w + 1 == len(starts) or starts[w + 1] <= stop)}
        self._let_go(len(self._unreleased))   # the pass before's last windows: read by now
        advise(w0)
        for i, index in enumerate(mine):
            w = enter_at.get(i)
            if w is not None:
                # window w - 1 is read, but batches of it may still be built (a loader takes
                # indices ahead of them): it is let go as the next window begins, before that
                # one's advice, so that the pages let go are the first the kernel evicts
                if self.release and w - 1 in whole:
                    self._unreleased.append(samples(w - 1))
                    self._let_go(len(self._unreleased) - 1)
                if w < w1:
                    advise(w + 1)   # entering window w advises the next
            yield index
        if self.release and w1 in whole:
            self._unreleased.append(samples(w1))

    def _let_go(self, k: int) -> None:
        """Release the first ``k`` windows waiting; stop releasing where the reader cannot."""
        for indices in self._unreleased[:k]:
            if self.release and self.readahead is not None and not self.readahead.release(indices):
                self.release = False
        del self._unreleased[:k]

    def __repr__(self) -> str:
        ranks = f", rank {self.rank} of {self.num_replicas}" if self.num_replicas > 1 else ""
        return (f"BlockShuffleSampler({self.n} samples, block_size={self.block_size}, window={self.window}, "
                f"seed={self.seed}{ranks})")
