"""``dlstore.loader``: a DataLoader that hands whole index lists to a store's batch path."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    RandomSampler,
    SequentialSampler,
    get_worker_info,
)
from torch.utils.data.distributed import DistributedSampler

from ..errors import ArgumentError, ArgumentTypeError
from .dataset import StoreDataset
from .gpu import GPUDataset
from .gpu_loader import GPULoader


class _Batches(Dataset):
    """Index lists in, ``StoreDataset.get_batch`` out: what ``loader`` iterates over.

    In the main process (``num_workers=0``) the random parameters come from the
    loader's generator; in a worker from torch's default generator, which the
    DataLoader seeds per worker from that same generator.
    """

    def __init__(self, dataset: StoreDataset, generator: torch.Generator | None):
        self.dataset = dataset
        self.generator = generator

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: Sequence[int]) -> tuple[torch.Tensor, Any]:
        generator = self.generator if get_worker_info() is None else None
        return self.dataset.get_batch(indices, generator=generator)

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "generator": None}   # workers use their seeded default


class _EpochBatchSampler(BatchSampler):
    """A BatchSampler that forwards ``set_epoch`` to a DistributedSampler inside (no-op otherwise)."""

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def _as_is(batch: Any) -> Any:
    return batch


def loader(
    dataset: StoreDataset | GPUDataset,
    batch_size: int,
    shuffle: bool = False,
    num_workers: int = 0,
    *,
    drop_last: bool = False,
    generator: torch.Generator | None = None,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    multiprocessing_context: Any = None,
    worker_init_fn: Callable[[int], None] | None = None,
    distributed: bool = False,
    seed: int = 0,
    transform: Callable[..., torch.Tensor] | None = None,
    channels_last: bool = False,
) -> DataLoader | GPULoader:
    """A DataLoader that reads whole batches: one ``get_batch`` call per batch.

    A ``BatchSampler`` yields index lists; each worker assembles a batch in one
    copy, runs the batch transforms once on it and returns ``(images, labels)``
    tensors; no per-sample collate. Random parameters come from ``generator``
    with ``num_workers=0``, and in workers from torch's default generator, which
    the DataLoader seeds per worker from ``generator`` (or from the global seed):
    ``generator`` (or ``torch.manual_seed``) makes epochs reproducible.

    Given a :class:`GPUDataset`, returns its :class:`GPULoader` (no workers: the
    batches are indexed and augmented on the device); the DataLoader options
    (``num_workers``, ``pin_memory``, ...) do not apply there.

    ``shuffle`` defaults to False everywhere, as in ``torch.utils.data.DataLoader``:
    a loader built for evaluation keeps the store's order; pass ``shuffle=True`` to train.

    Args:
        dataset: a StoreDataset (``open_dataset``) or a GPUDataset.
        batch_size: samples per batch.
        shuffle: a new random order every epoch.
        num_workers: worker processes (0: read in this process).
        drop_last: drop a last, smaller batch.
        generator: seeds the order and the workers' random streams.
        pin_memory, persistent_workers, prefetch_factor, multiprocessing_context,
            worker_init_fn: as ``torch.utils.data.DataLoader``.
        distributed: read this rank's share under an initialised ``torch.distributed``
            group: a ``DistributedSampler`` (padded by repeating samples, or trimmed
            with ``drop_last``) so every rank gets the same number of batches and DDP
            never waits at the end of an epoch on a rank that ran out. Call
            ``loader.sampler.set_epoch(epoch)`` before each epoch for a new shuffle.
        seed: the distributed shuffle's seed; must be the same on every rank (GPUDataset:
            the seed of the order and of the augmentations).
        transform, channels_last: GPUDataset only, see :class:`GPULoader`.
    """
    if isinstance(dataset, GPUDataset):
        unused = [name for name, value, default in (
            ("num_workers", num_workers, 0), ("generator", generator, None), ("pin_memory", pin_memory, False),
            ("persistent_workers", persistent_workers, False), ("prefetch_factor", prefetch_factor, None),
            ("multiprocessing_context", multiprocessing_context, None), ("worker_init_fn", worker_init_fn, None),
        ) if value is not default and value != default]
        if unused:
            raise ArgumentError(f"dlstore.loader: {', '.join(unused)} do not apply to a GPUDataset (it has no "
                                "workers and is already on its device); use seed= for reproducible batches")
        if distributed and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ArgumentError("loader(distributed=True) needs an initialised torch.distributed process group")
        return dataset.loader(batch_size, shuffle, drop_last=drop_last, transform=transform, seed=seed,
                              channels_last=channels_last)
    if transform is not None or channels_last:
        raise ArgumentError("dlstore.loader: transform= and channels_last= apply to a GPUDataset only; give a "
                            "StoreDataset its transforms in open_dataset(path, transform=...)")
    if not isinstance(dataset, StoreDataset):
        raise ArgumentTypeError(f"dlstore.loader takes a StoreDataset (dlstore.open_dataset(path)), got "
                        f"{type(dataset).__name__}; for other datasets use torch.utils.data.DataLoader")
    for name, flag in (("shuffle", shuffle), ("drop_last", drop_last), ("distributed", distributed)):
        if not isinstance(flag, bool):
            raise ArgumentTypeError(f"{name} must be True or False, got {flag!r}")
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
        raise ArgumentError(f"num_workers must be 0 (read in this process) or a positive int, got {num_workers!r}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ArgumentError(f"batch_size must be a positive int, got {batch_size!r}")
    if distributed:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ArgumentError("loader(distributed=True) needs an initialised torch.distributed process group "
                             "(launch with torchrun and call torch.distributed.init_process_group first)")
        sampler = DistributedSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
    else:
        sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
    options: dict[str, Any] = {}
    if num_workers > 0:
        options.update(persistent_workers=persistent_workers, prefetch_factor=prefetch_factor,
                       multiprocessing_context=multiprocessing_context)
    return DataLoader(_Batches(dataset, generator), sampler=_EpochBatchSampler(sampler, batch_size, drop_last),
                      batch_size=None, num_workers=num_workers, collate_fn=_as_is, pin_memory=pin_memory,
                      worker_init_fn=worker_init_fn, generator=generator, **options)
