"""Which samples each rank holds when a dataset is split across ranks (``GPUDataset(shard=True)``).

A sharded dataset is a *fixed partition*: rank ``r`` of ``W`` holds the samples
``sorted(perm[r::W])`` where ``perm`` is a permutation of the whole store drawn
from ``partition_seed`` (the same on every rank). A random partition rather than
contiguous blocks, because stores are usually ordered by class (ImageFolder
order): contiguous blocks would give each rank a handful of classes and batches
that are anything but a sample of the dataset. The shares are sorted so each
rank reads its samples from the store in file order.

Each epoch, every rank draws its own permutation of its share (``ShareSampler``: from
the loader's pass generator and the rank) and pads it by wrapping to the longest
share, ``ceil(N / W)``, so every rank runs the same number of batches, as
``DistributedSampler`` does. What this shuffle is, and is not:

- every sample is seen once per epoch (plus at most one wrapped repeat on the
  ranks whose share is one shorter), exactly as with a global shuffle;
- the *global* batch (the union of the ranks' batches, which DDP averages over)
  is a stratified draw: ``B / W`` samples from each fixed share, instead of
  ``B`` samples from the whole dataset. Two samples held by different ranks
  always land on different ranks. With a random partition the shares are
  statistically alike, so the gradient has the same expectation; its variance
  across steps is at most that of a global shuffle (stratification never adds
  variance).
- to mix the shares as well, build the dataset again every k epochs with
  another ``partition_seed`` (the same on every rank): each rank then re-reads
  its new share from the store, which must be on storage every rank can read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from ...errors import ArgumentError


def resolve_distributed(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): the given values, else torch.distributed's, else (0, 1)."""
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    world_size, rank = int(world_size), int(rank)
    if world_size < 1:
        raise ArgumentError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ArgumentError(f"rank must be in [0, {world_size}), got {rank}")
    return rank, world_size


def _check(n: int, rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ArgumentError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ArgumentError(f"rank must be in [0, {world_size}), got {rank}")
    if n < world_size:
        raise ArgumentError(f"cannot shard {n} sample(s) over {world_size} ranks: every rank needs at least one")


def rank_share(n: int, rank: int, world_size: int, *, seed: int = 0) -> np.ndarray:
    """Sorted store indices (int64) held by ``rank`` of ``world_size`` under partition ``seed``.

    The shares of all ranks are disjoint, together cover ``range(n)``, and differ
    in length by at most one. Every rank must pass the same ``n``, ``world_size``
    and ``seed``.
    """
    _check(n, rank, world_size)
    perm = np.random.default_rng(int(seed)).permutation(n)
    return np.sort(perm[rank::world_size]).astype(np.int64)


def per_rank(n: int, world_size: int) -> int:
    """Samples every rank serves per epoch: the longest share, ``ceil(n / world_size)``."""
    return math.ceil(n / world_size)


class _SubsetReader:
    """A store reader restricted to ``indices``: position ``k`` reads store sample ``indices[k]``."""

    def __init__(self, reader: Any, indices: np.ndarray):
        self._reader = reader
        self._indices = indices

    def get_batch(self, positions: Any, out: Any = None) -> Any:
        return self._reader.get_batch(self._indices[np.asarray(positions, dtype=np.int64)], out=out)

    def read_range(self, start: int, stop: int, out: Any = None, threads: int = 1) -> Any:
        # The share is sorted, so this reads in file order; numpy copies release the GIL.
        return self._reader.get_batch(self._indices[start:stop], out=out)


class SubsetSource:
    """The samples ``indices`` of a fixed-shape dlstore dataset, seen as a dataset of their own.

    What :class:`~dlstore.GPUDataset` reads when it holds one rank's share: the
    same ``shape``, ``classes`` and reading methods, with positions ``0..len-1``
    mapped to the store's indices.
    """

    def __init__(self, source: Any, indices: np.ndarray):
        self._source = source
        self.indices = np.asarray(indices, dtype=np.int64)
        self.shape = source.shape
        self.classes = list(getattr(source, "classes", []))
        self.path = getattr(source, "path", None)
        self.fingerprint = getattr(source, "fingerprint", None)
        self.manifest = getattr(source, "manifest", None)   # the loader checks transforms against its static spec
        labels = np.asarray(source.targets)   # (N,) int labels, or (N, K) target vectors kept in their dtype
        self._labels = (labels if labels.ndim == 2 else labels.astype(np.int64, copy=False))[self.indices]
        self.targets = self._labels.tolist() if self._labels.ndim == 1 else self._labels
        reader = getattr(source, "reader", None)
        self.reader = _SubsetReader(reader, self.indices) if hasattr(reader, "get_batch") else None

    def __len__(self) -> int:
        return len(self.indices)

    def read_batch(self, positions: Any) -> Any:
        return self._source.read_batch(self.indices[np.asarray(positions, dtype=np.int64)].tolist())


class ShareSampler(Sampler[int]):
    """The order of a sharded GPUDataset's own samples (its share: positions ``0..local-1``), shuffled
    from ``generator`` each pass when ``shuffle``, wrapped to ``count`` (the longest share) so that every
    rank runs as many batches.

    Args:
        local: samples in this rank's share.
        count: samples per epoch on every rank (``per_rank(total, world_size)``).
        shuffle: a new permutation each pass.
        rank: this rank (mixed into the draw).
        generator: where the permutation is drawn from (None: a seed from torch's default generator,
            as ``RandomSampler`` draws).
    """

    def __init__(self, local: int, count: int, *, shuffle: bool, rank: int = 0,
                 generator: torch.Generator | None = None):
        if local < 1 or count < local:
            raise ArgumentError(f"ShareSampler needs 1 <= local <= count, got local={local}, count={count}")
        self.local, self.count, self.shuffle, self.rank, self.generator = local, count, shuffle, rank, generator

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            # one draw from the (shared) generator, mixed with the rank: each rank its own permutation,
            # else ranks with shares of one length would take the same positions of their sorted shares
            drawn = int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
            generator = torch.Generator()
            generator.manual_seed(int(np.random.SeedSequence([drawn & (2**64 - 1), self.rank])
                                      .generate_state(1, dtype=np.uint64)[0]) >> 1)
            order = torch.randperm(self.local, generator=generator)
        else:
            order = torch.arange(self.local)
        if self.count > self.local:
            order = order.repeat(math.ceil(self.count / self.local))[:self.count]
        return iter(order.tolist())

    def __len__(self) -> int:
        return self.count
