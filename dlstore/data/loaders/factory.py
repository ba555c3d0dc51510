"""``dlstore.loader``: whole index lists to a store's batch path, built by threads or worker processes."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    SequentialSampler,
)
from torch.utils.data.distributed import DistributedSampler

from ..._system import usable_cpus
from ...errors import ArgumentError, ArgumentTypeError
from ...transforms import compiled
from ..dataset import StoreDataset
from ..gpu.dataset import GPUDataset
from ..gpu.loader import GPULoader
from .dataloader import StoreDataLoader
from .device import DeviceLoader, host_stage
from .shm_ring import ShmRingLoader, batch_spec, ring_bytes, shm_free, shm_message
from .threads import ThreadLoader

# threads=None picks min(usable CPUs, this): beyond it memory bandwidth, not CPU, bounds a
# gather, and every thread keeps two batches in flight (2 x 9.6 MB at 64x3x224x224).
MAX_AUTO_THREADS = 8


class _EpochBatchSampler(BatchSampler):
    """A BatchSampler that forwards ``set_epoch`` to a DistributedSampler inside (no-op otherwise)."""

    epoch = 0   # read by ThreadLoader: the epoch enters each batch's seed

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def threads_apply(dataset: StoreDataset) -> bool:
    """Whether ``dataset``'s batch path is work that threads run in parallel, reproducibly.

    True when ``get_batch`` assembles a fixed-shape batch with no per-sample op: a
    gather from the reader (numpy copies, LMDB/HDF5 reads, PIL decodes of an encoded
    store: all release the GIL), the fused crop/flip, batch transforms, every random
    draw from the generator ``get_batch`` is given. Per-sample ops (torchvision
    transforms without a batch equivalent, run sample by sample) hold the GIL
    between small kernels and draw from torch's global generator, which threads
    share: those pipelines go to worker processes.
    """
    return dataset.shape is not None and not dataset.per_sample_ops


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
    seed: int | None = 0,
    transform: Callable[..., torch.Tensor] | None = None,
    channels_last: bool = False,
    threads: int | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    shm_ring: bool | None = None,
    fused: bool | None = None,
    compile: bool = False,
) -> ThreadLoader | ShmRingLoader | DataLoader | GPULoader | DeviceLoader:
    """A loader that reads whole batches: one ``get_batch`` call per batch.

    Batches are built by a pool of threads in this process (a :class:`ThreadLoader`)
    or by a ``torch.utils.data.DataLoader``, in worker processes when ``num_workers > 0``.
    ``threads=None`` (the default) chooses threads when ``num_workers == 0`` and the
    store's batch path releases the GIL (:func:`threads_apply`: a fixed-shape store,
    raw or encoded, whose dynamic transforms all run per batch), with
    ``min(usable CPUs, 8)`` threads; otherwise the DataLoader. ``threads=0`` always
    takes the DataLoader; ``threads=N`` always N threads (with ``num_workers=0``).

    With threads, batch ``k`` of a pass draws its random parameters from its own
    generator, seeded from (a base seed drawn from ``generator`` -- or from torch's
    default generator -- when the pass starts, the epoch, ``k``): the same batches
    with 1 or 8 threads, in sampler order. ``prefetch_factor`` batches per thread
    are in flight (default 2). A batch handed out is never reused by the loader
    while any tensor refers to it. ``pin_memory`` pins on the loader threads.

    With ``num_workers > 0`` and a batch path of fixed output shape (a fixed-shape store whose
    transforms give tensors of one shape and dtype: :func:`~dlstore.data.loaders.shm_ring.batch_spec`
    reads sample 0 to tell), worker processes write each batch into a ring of shared-memory
    slots allocated once (a :class:`~dlstore.data.loaders.shm_ring.ShmRingLoader`; ``shm_ring=False``
    takes the DataLoader instead): only the slot number, the batch index and the labels cross
    the pipes, 3.8-5.7x the DataLoader path's samples/s on 224 px batches. Its batches are the
    threads' (the same per-batch seeds and sampler order, whatever the worker count; per-sample
    torchvision ops draw from torch's, numpy's and ``random``'s global generators, which each
    worker seeds per batch, so they too are the same for any worker count); a batch handed out is a slot,
    reused only once no tensor (view, ``.numpy()`` array) refers to it. ``persistent_workers``,
    ``multiprocessing_context``, ``worker_init_fn``, ``pin_memory`` and ``prefetch_factor``
    (batches in flight per worker) apply; one pass at a time (a pass started while another is
    suspended takes over, and the old iterator raises).

    Through the DataLoader, a ``BatchSampler`` yields index lists; each worker assembles a batch in one
    copy, runs the batch transforms once on it and returns ``(images, labels)``
    tensors; no per-sample collate. Random parameters come from ``generator``
    with ``num_workers=0``, and in workers from torch's default generator, which
    the DataLoader seeds per worker from ``generator`` (or from the global seed):
    ``generator`` (or ``torch.manual_seed``) makes epochs reproducible.

    With ``device=`` (any torch device: ``"cuda"``, ``"cuda:1"``, ``"cpu"``), the threads or
    workers run only the host stage of the dataset's transforms (uint8 crops and flips)
    and the float tail -- the device stage: ``ToDtype``, ``Normalize``, every op after
    them and ``batch_transform`` -- runs on ``device`` (see ``HybridTransform`` and
    :class:`~dlstore.data.loaders.device.DeviceLoader`): uint8 crosses the worker queues, the
    pinned buffers and the host-to-device copy, a quarter of the bytes of float32.
    The main process copies each batch into a ring of reused pinned buffers (CUDA)
    and issues the copy and the device stage on a side stream, a batch ahead of the
    one handed out. Labels move too. ``device=None`` (the default) runs everything
    in the threads/workers; ``device="cpu"`` runs the device path on the CPU.

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
        transform: GPUDataset only, see :class:`GPULoader`.
        channels_last: images in ``torch.channels_last`` memory format (a GPUDataset, or with ``device=``).
        threads: threads building batches in this process (None: chosen as above;
            0: none, a DataLoader).
        device: run the device stage there and deliver batches there (None: no device stage).
        dtype: with ``device=``, the float dtype of the images (torch.float32, float16 or
            bfloat16; None: what the pipeline gives, float32 for ``ToDtype(torch.float32)``,
            matching torchvision). The device stage computes in float32 and rounds once.
        shm_ring: with ``num_workers > 0``, workers write batches into shared-memory slots
            (None: where the batch has a fixed shape, else the DataLoader; True: the ring, or
            ArgumentError; False: the DataLoader).
        fused, compile: GPUDataset only: crop + flip + conversion + channels_last as one gather
            on the device, compiled with ``torch.compile`` (see :class:`GPULoader`). For a
            GPUDataset ``prefetch_factor`` is the number of batch groups prepared ahead (default
            2) and ``distributed=True`` serves this rank's share of each epoch.
    """
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ArgumentTypeError(f"seed must be an int (or None: 0, a GPUDataset's own), got {seed!r}")
    if isinstance(dataset, GPUDataset):
        unused = [name for name, value, default in (
            ("num_workers", num_workers, 0), ("generator", generator, None), ("pin_memory", pin_memory, False),
            ("persistent_workers", persistent_workers, False),
            ("multiprocessing_context", multiprocessing_context, None), ("worker_init_fn", worker_init_fn, None),
            ("threads", threads, None), ("device", device, None), ("dtype", dtype, None), ("shm_ring", shm_ring, None),
        ) if value is not default and value != default]
        if unused:
            raise ArgumentError(f"dlstore.loader: {', '.join(unused)} do not apply to a GPUDataset (it has no "
                                "workers and is already on its device); use seed= for reproducible batches")
        if distributed and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ArgumentError("loader(distributed=True) needs an initialised torch.distributed process group")
        if prefetch_factor is not None and (not isinstance(prefetch_factor, int) or isinstance(prefetch_factor, bool)
                                            or prefetch_factor < 1):
            raise ArgumentError(f"prefetch_factor must be a positive int (batch groups prepared ahead), "
                                f"got {prefetch_factor!r}")
        if distributed:   # this rank's share of each epoch, from the process group
            rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        else:
            rank = world_size = None
        return GPULoader(dataset, batch_size, shuffle, drop_last=drop_last, transform=transform, seed=seed,
                         channels_last=channels_last, rank=rank, world_size=world_size,
                         prefetch=2 if prefetch_factor is None else prefetch_factor, fused=fused, compile=compile)
    if fused is not None or compile:
        raise ArgumentError("dlstore.loader: fused= and compile= apply to a GPUDataset (its gather on the device); "
                            "a StoreDataset's crop + flip is fused into its batch copy already")
    if transform is not None:
        raise ArgumentError("dlstore.loader: transform= applies to a GPUDataset only; give a "
                            "StoreDataset its transforms in open_dataset(path, transform=...)")
    if not isinstance(dataset, StoreDataset):
        raise ArgumentTypeError(f"dlstore.loader takes a StoreDataset (dlstore.open_dataset(path)), got "
                        f"{type(dataset).__name__}; for other datasets use torch.utils.data.DataLoader")
    if device is None and (channels_last or dtype is not None):
        raise ArgumentError("dlstore.loader: channels_last= and dtype= apply with device= (where the float "
                            "stage runs) or to a GPUDataset; pass device='cuda' (or 'cpu')")
    if device is not None:
        if pin_memory:
            raise ArgumentError("dlstore.loader: pin_memory=True with device=: the loader stages batches in "
                                "its own pinned buffers when the device is CUDA; drop pin_memory")
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ArgumentError(f"dlstore.loader: device={device!r} is not a torch device ({exc})") from exc
        host_ds, steps = host_stage(dataset)
        host = loader(host_ds, batch_size, shuffle, num_workers, drop_last=drop_last, generator=generator,
                      persistent_workers=persistent_workers, prefetch_factor=prefetch_factor,
                      multiprocessing_context=multiprocessing_context, worker_init_fn=worker_init_fn,
                      distributed=distributed, seed=seed, threads=threads, shm_ring=shm_ring)
        return DeviceLoader(host, device, steps, dtype=dtype, channels_last=channels_last, generator=generator)
    for name, flag in (("shuffle", shuffle), ("drop_last", drop_last), ("distributed", distributed)):
        if not isinstance(flag, bool):
            raise ArgumentTypeError(f"{name} must be True or False, got {flag!r}")
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
        raise ArgumentError(f"num_workers must be 0 (read in this process) or a positive int, got {num_workers!r}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ArgumentError(f"batch_size must be a positive int, got {batch_size!r}")
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 0):
        raise ArgumentError(f"threads must be None (chosen), 0 (no threads) or a positive int, got {threads!r}")
    if threads and num_workers:
        raise ArgumentError(f"threads={threads} and num_workers={num_workers}: batches are built either by threads "
                            "in this process or by worker processes; pass one of them")
    if prefetch_factor is not None and (not isinstance(prefetch_factor, int) or isinstance(prefetch_factor, bool)
                                        or prefetch_factor < 1):
        raise ArgumentError(f"prefetch_factor must be a positive int (batches in flight per worker or thread), "
                            f"got {prefetch_factor!r}")
    if shm_ring is not None and not isinstance(shm_ring, bool):
        raise ArgumentTypeError(f"shm_ring must be None (chosen), True or False, got {shm_ring!r}")
    if shm_ring and not num_workers:
        raise ArgumentError("shm_ring=True applies to worker processes: pass num_workers >= 1")
    if threads is None:
        # DataLoader-only options ask for the DataLoader; under torchrun the node's CPUs are shared
        # by its LOCAL_WORLD_SIZE ranks, so each takes its share
        dataloader_only = worker_init_fn is not None or multiprocessing_context is not None or persistent_workers
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        threads = (max(1, min(usable_cpus() // ranks, MAX_AUTO_THREADS))
                   if num_workers == 0 and not dataloader_only and threads_apply(dataset) else 0)
    if distributed:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ArgumentError("loader(distributed=True) needs an initialised torch.distributed process group "
                             "(launch with torchrun and call torch.distributed.init_process_group first)")
        sampler = DistributedSampler(dataset, shuffle=shuffle, seed=seed or 0, drop_last=drop_last)
    else:
        sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
    batches = _EpochBatchSampler(sampler, batch_size, drop_last)
    if num_workers and getattr(dataset, "fuses_crop_flip", False):
        compiled.available()   # numba's kernel built (or loaded) here, once, before workers fork
    if threads:
        return ThreadLoader(dataset, batches, threads=threads, prefetch=threads * (prefetch_factor or 2),
                            generator=generator, pin_memory=pin_memory)
    # worker processes write into the shared-memory ring where the batch has one fixed shape
    # (3.8-5.7x the DataLoader path on static 224 px batches, 2.0-3.9x with crop+flip); None
    # chooses it there and the DataLoader elsewhere
    spec = batch_spec(dataset) if num_workers > 0 and shm_ring is not False else None
    if shm_ring and spec is None:
        raise ArgumentError(f"shm_ring=True needs a batch path of fixed output shape; {dataset!r} gives "
                            "variable shapes or non-tensor batches: pass shm_ring=False (or leave it None)")
    if spec is not None and shm_ring is None:   # chosen: a ring that does not fit /dev/shm is not chosen
        need, free = ring_bytes(spec, batch_size, num_workers * (prefetch_factor or 2), num_workers), shm_free()
        if free is not None and need > free // 2:
            warnings.warn(f"dlstore.loader: not using worker processes' shared-memory ring: {shm_message(need)}",
                          stacklevel=2)
            spec = None

    def dataloader() -> StoreDataLoader:
        options: dict[str, Any] = {}
        if num_workers > 0:
            options.update(persistent_workers=persistent_workers, prefetch_factor=prefetch_factor,
                           multiprocessing_context=multiprocessing_context)
        return StoreDataLoader(dataset, batches, num_workers=num_workers, pin_memory=pin_memory,
                               worker_init_fn=worker_init_fn, generator=generator, **options)

    if spec is not None:
        return ShmRingLoader(dataset, batches, workers=num_workers, prefetch=num_workers * (prefetch_factor or 2),
                             spec=spec, generator=generator, pin_memory=pin_memory,
                             persistent_workers=persistent_workers, multiprocessing_context=multiprocessing_context,
                             worker_init_fn=worker_init_fn, fallback=dataloader if shm_ring is None else None)
    return dataloader()
