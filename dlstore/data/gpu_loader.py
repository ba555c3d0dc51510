"""The loader of a :class:`~dlstore.data.gpu.GPUDataset`: batches indexed and augmented on the device."""

from __future__ import annotations

import inspect
import math
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import ArgumentError
from ..transforms.batch import BatchCompose, BatchTransform

if TYPE_CHECKING:
    from .gpu import GPUDataset

# Served bytes per group of batches that the loader gathers and augments in one go.
GROUP_BYTES = 64 << 20

BatchFn = Callable[..., torch.Tensor]


def _resolve_distributed(rank: int | None, world_size: int | None) -> tuple[int, int]:
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


class _Prefetcher:
    """Runs ``fn(job)`` for each job in a background thread, ``depth`` results ahead at most.

    Iterating yields the results in order. A result counts as in use until the
    consumer asks for the next one, so at most ``depth`` results (host buffers)
    exist at a time. An exception in the thread is re-raised in the consumer;
    ``close()`` (also called when iteration ends or is abandoned) stops the thread.
    """

    def __init__(self, jobs: Iterable[Any], fn: Callable[[Any], Any], depth: int = 2):
        self._jobs = iter(jobs)
        self._fn = fn
        self._slots = threading.Semaphore(max(1, depth))
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dlstore-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for job in self._jobs:
                while not self._slots.acquire(timeout=0.1):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                self._queue.put((True, self._fn(job)))
            self._queue.put((False, None))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._queue.put((False, exc))

    def __iter__(self) -> Iterator[Any]:
        try:
            first = True
            while True:
                if not first:
                    self._slots.release()  # the consumer is done with the previous result
                first = False
                more, item = self._queue.get()
                if not more:
                    if item is not None:
                        raise item
                    return
                yield item
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        self._slots.release()  # wake a producer waiting for a slot
        self._thread.join()


def _per_sample(transform: Any) -> bool:
    """Whether ``transform`` draws independent randomness per sample (dlstore batch transforms do),
    so that running it on several batches at once changes nothing but the random stream."""
    if isinstance(transform, BatchCompose):
        return all(_per_sample(t) for t in transform.transforms)
    return isinstance(transform, BatchTransform)


def _accepts_generator(transform: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(transform).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return "generator" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class GPULoader:
    """Iterates a :class:`GPUDataset` in batches of device tensors, one epoch per ``iter``.

    Each epoch draws a permutation with ``torch.randperm`` on the device from a
    generator seeded with ``seed + epoch``, so the same seed gives the same order
    and each epoch a new one. The epoch advances by one after each iteration;
    ``set_epoch(e)`` sets it, as with ``DistributedSampler``.

    With ``world_size > 1`` the permutation is padded by wrapping to a multiple
    of ``world_size`` and rank ``r`` takes every ``world_size``-th index from
    ``r``: shares are disjoint (up to the < ``world_size`` padded repeats),
    together complete, and equal in length, so every rank runs the same number
    of batches. Every rank must use the same seed (default 0 when distributed).

    Batches: ``index_select`` on the device, conversion when the data is held
    as uint8, then ``transform(images, generator=g)`` (a batch transform from
    ``dlstore.transforms``; a callable without a ``generator`` parameter is
    called with the images alone), then optionally channels_last. When the
    transform is made only of ``dlstore.transforms`` batch transforms (whose
    randomness is per sample) or is None, these steps run on groups of
    ``group_batches`` batches (about 64 MiB of output) and the batches are
    slices of the result: the same distribution of outputs with far fewer
    kernel launches. Any other callable sees one batch at a time.
    """

    def __init__(
        self,
        dataset: GPUDataset,
        batch_size: int,
        shuffle: bool = False,
        *,
        drop_last: bool = False,
        transform: BatchFn | None = None,
        seed: int | None = None,
        channels_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        prefetch: int = 2,
    ):
        if int(batch_size) < 1:
            raise ArgumentError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.transform = transform
        self._transform_takes_generator = transform is not None and _accepts_generator(transform)
        self.channels_last = channels_last
        self.rank, self.world_size = _resolve_distributed(rank, world_size)
        if seed is None:
            # Every rank must draw the same permutation: a fixed default, like DistributedSampler.
            seed = 0 if self.world_size > 1 else int(torch.randint(0, 2**62, ()).item())
        self.seed = int(seed)
        self.prefetch = max(1, int(prefetch))
        self.epoch = 0
        self.group_batches = self._group_size()
        device = dataset.device
        self._perm_gen = torch.Generator(device=device)
        self._aug_gen = torch.Generator(device=device)

    def _group_size(self) -> int:
        """Batches gathered and augmented together: 1 unless the transform is per-sample."""
        ds = self.dataset
        if ds.mode == "stream" or (self.transform is not None and not _per_sample(self.transform)):
            return 1
        itemsize = torch.empty((), dtype=ds.dtype).element_size()
        sample = int(np.prod(ds.shape)) * itemsize
        return max(1, GROUP_BYTES // (sample * self.batch_size))

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s permutation for the next iteration (and count on from there)."""
        self.epoch = int(epoch)

    @property
    def num_samples(self) -> int:
        """Samples this rank sees per epoch (including the wrap-around padding)."""
        return math.ceil(len(self.dataset) / self.world_size)

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    def indices(self, epoch: int | None = None) -> torch.Tensor:
        """This rank's sample order for ``epoch`` (default: the next one), on the device."""
        epoch = self.epoch if epoch is None else int(epoch)
        n = len(self.dataset)
        device = self.dataset.device
        if self.shuffle:
            self._perm_gen.manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=self._perm_gen, device=device)
        else:
            order = torch.arange(n, device=device)
        if self.world_size > 1:
            total = self.num_samples * self.world_size
            if total > n:
                order = order.repeat(math.ceil(total / n))[:total]
            order = order[self.rank:total:self.world_size]
        return order

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch = self.epoch
        self.epoch += 1
        order = self.indices(epoch)
        # Augmentation randomness differs per epoch and per rank, yet is reproducible.
        self._aug_gen.manual_seed((self.seed * 1_000_003 + epoch * 7_919 + self.rank) % (2**63))
        count = len(self) * self.batch_size if self.drop_last else len(order)
        batches = [(s, min(s + self.batch_size, count)) for s in range(0, count, self.batch_size)]
        ds = self.dataset
        if ds.mode == "stream":
            yield from self._stream(order, batches)
            return
        # Gather, convert and augment a group of batches at once, then hand out slices:
        # the per-batch cost becomes two views instead of a few dozen kernel launches.
        step = self.group_batches * self.batch_size
        for g0 in range(0, count, step):
            idx = order[g0:min(count, g0 + step)]
            images = ds.data.index_select(0, idx)
            if ds.mode == "uint8":
                images = ds._finish(images)
            images = self._augment(images)
            labels = ds.targets.index_select(0, idx)
            for s in range(0, len(idx), self.batch_size):
                yield images[s:s + self.batch_size], labels[s:s + self.batch_size]

    def _augment(self, images: torch.Tensor) -> torch.Tensor:
        if self.transform is not None:
            if self._transform_takes_generator:
                images = self.transform(images, generator=self._aug_gen)
            else:
                images = self.transform(images)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images

    def _stream(self, order: torch.Tensor, batches: list[tuple[int, int]]
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        ds = self.dataset
        host_order = order.cpu().numpy()

        def read(bounds: tuple[int, int]) -> torch.Tensor:
            start, stop = bounds
            return ds._read_into(host_order[start:stop], ds._host_buffer(stop - start))

        prefetcher = _Prefetcher(batches, read, depth=self.prefetch)
        try:
            for (start, stop), host in zip(batches, prefetcher):
                images = ds._finish(host.to(ds.device, non_blocking=ds._pin))
                labels = ds.targets.index_select(0, order[start:stop])
                yield self._augment(images), labels
        finally:
            prefetcher.close()
