"""``dlstore.loader``: whole index lists to a store's batch path, built by threads or worker processes."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable
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
from ...errors import ArgumentError, ArgumentTypeError, UsageError
from ...transforms import compiled
from ..dataset import StoreDataset
from ..gpu.dataset import GPUDataset
from ..gpu.loader import GPULoader
from .dataloader import StoreDataLoader
from .device import DeviceLoader, host_stage
from .shm_ring import ShmRingLoader, batch_spec, ring_bytes, shm_free, shm_message
from .threads import ThreadLoader

BACKENDS = ("auto", "threads", "ring", "dataloader", "gpu")

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
    share: those pipelines go to worker processes. An encoded store whose pipeline begins
    with RandomResizedCrop counts as fixed-shape: the crop runs as each record decodes,
    drawn from that generator (``decode_crop``).
    """
    fixed = dataset.shape is not None or getattr(dataset, "decode_crop", None) is not None
    return fixed and not dataset.per_sample_ops


def _backend_choice(backend: str, dataset: StoreDataset, *, num_workers: int, threads: int | None,
                    shm_ring: bool | None, dataloader_only: list[str]) -> tuple[int, bool | None]:
    """``(threads, shm_ring)`` for a StoreDataset: threads > 0 builds a ThreadLoader; else
    shm_ring True takes the ring (or fails), None the ring where it fits, False the DataLoader."""
    def conflict(other: str, fix: str) -> ArgumentError:
        return ArgumentError(f"dlstore.loader: backend={backend!r} and {other}: {fix}")

    if backend == "auto":
        if threads and num_workers:
            raise ArgumentError(f"threads={threads} and num_workers={num_workers}: batches are built either by "
                                "threads in this process or by worker processes; pass one of them")
        if threads and dataloader_only:
            raise ArgumentError(f"threads={threads} and {dataloader_only[0]}=: threads start no worker processes; "
                                "pass backend='ring' or 'dataloader' with num_workers >= 1")
        if shm_ring and not num_workers:
            raise ArgumentError("shm_ring=True applies to worker processes: pass num_workers >= 1")
        if threads is None:
            # under torchrun the node's CPUs are shared by its LOCAL_WORLD_SIZE ranks: each takes its share
            threads = _auto_threads() if num_workers == 0 and not dataloader_only and threads_apply(dataset) else 0
        return threads, shm_ring
    if backend == "threads":
        if num_workers:
            raise conflict(f"num_workers={num_workers}", "threads build batches in this process; drop num_workers "
                           "or pass backend='ring' for worker processes")
        if threads == 0 or shm_ring is not None:
            raise conflict("threads=0" if threads == 0 else f"shm_ring={shm_ring}", "choose the back-end once")
        if dataloader_only:
            raise conflict(f"{dataloader_only[0]}=", "threads start no worker processes")
        return threads or _auto_threads(), None
    if threads:
        raise conflict(f"threads={threads}", "threads= is the thread count of backend='threads'")
    if backend == "ring":
        if not num_workers:
            raise conflict("num_workers=0", "the ring's batches are written by worker processes: pass num_workers >= 1")
        if shm_ring is False:
            raise conflict("shm_ring=False", "choose the back-end once")
        return 0, True
    if shm_ring:   # backend == "dataloader"
        raise conflict("shm_ring=True", "choose the back-end once")
    return 0, False


def _auto_threads() -> int:
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(usable_cpus() // ranks, MAX_AUTO_THREADS))


def loader(
    dataset: StoreDataset | GPUDataset,
    batch_size: int,
    shuffle: bool = False,
    num_workers: int = 0,
    *,
    backend: str = "auto",
    sampler: Iterable[int] | None = None,
    drop_last: bool = False,
    generator: torch.Generator | None = None,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    multiprocessing_context: Any = None,
    worker_init_fn: Callable[[int], None] | None = None,
    distributed: bool = False,
    seed: int | None = 0,
    batch_transform: Callable[..., torch.Tensor] | None = None,
    transform: Any = None,
    channels_last: bool = False,
    threads: int | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    shm_ring: bool | None = None,
    fused: bool | None = None,
    compile: bool = False,
) -> ThreadLoader | ShmRingLoader | DataLoader | GPULoader | DeviceLoader:
    """A loader that reads whole batches: one ``get_batch`` call per batch (docs/reading.md).

    ``backend`` chooses who builds the batches: ``"threads"`` (a :class:`ThreadLoader`, in this
    process), ``"ring"`` (worker processes writing into shared-memory slots, a
    :class:`~dlstore.data.loaders.shm_ring.ShmRingLoader`), ``"dataloader"`` (a torch DataLoader
    over whole batches, in worker processes when ``num_workers > 0``) or ``"gpu"`` (a
    :class:`GPUDataset`'s :class:`GPULoader`, indexed and augmented on its device). ``"auto"``
    takes ``"gpu"`` for a GPUDataset; else threads when ``num_workers == 0`` and the batch path
    releases the GIL (:func:`threads_apply`), the ring when ``num_workers > 0`` and the batch has
    one fixed shape that fits ``/dev/shm``, the DataLoader otherwise. Every back-end draws batch
    ``k``'s random parameters reproducibly from ``generator`` and the epoch, resumes mid-epoch
    (``state_dict``), and hands out batches in sampler order.

    ``device=`` runs the float tail of the transforms (``ToDtype``, ``Normalize``, what follows)
    on that device behind the back-end (a :class:`~dlstore.data.loaders.device.DeviceLoader`).

    Args:
        dataset: a StoreDataset (``open_dataset``) or a GPUDataset.
        batch_size: samples per batch.
        shuffle: a new random order every epoch (default False, as ``DataLoader``).
        num_workers: worker processes (0: read in this process).
        backend: ``"auto"``, ``"threads"``, ``"ring"``, ``"dataloader"`` or ``"gpu"``, as above.
        sampler: the order of the samples (e.g. :class:`~dlstore.data.order.BlockShuffleSampler`
            for a store bigger than memory); excludes ``shuffle`` and ``distributed``, which
            choose a sampler themselves.
        drop_last: drop a last, smaller batch.
        generator: seeds the order and the random draws of every batch.
        pin_memory, persistent_workers, prefetch_factor, multiprocessing_context,
            worker_init_fn: as ``torch.utils.data.DataLoader`` (``prefetch_factor``: batches in
            flight per thread or worker; a GPUDataset's batch groups prepared ahead).
        distributed: read this rank's share under an initialised ``torch.distributed`` group
            (a ``DistributedSampler``, padded or trimmed with ``drop_last``). Call
            ``loader.set_epoch(epoch)`` before each epoch.
        seed: the seed every rank shares, of the order across ranks: a StoreDataset's
            ``DistributedSampler`` (its batches' random draws come from ``generator``); a
            GPUDataset, which takes no generator, seeds its order and its draws with it.
        batch_transform, fused, compile: GPUDataset only, see :class:`GPULoader` (its
            ``transform``): the pipeline its device batches run. A StoreDataset's transforms
            are ``open_dataset(path, transform=...)``'s.
        transform: the 0.1 name of ``batch_transform``; raises :class:`UsageError` naming it.
        channels_last: images in ``torch.channels_last`` memory format (a GPUDataset, or with ``device=``).
        threads: threads of ``backend="threads"`` (None: ``min(usable CPUs, 8)``, shared by the
            node's ranks). ``threads=0`` is the 0.1 spelling of ``backend="dataloader"``.
        device: run the device stage there and deliver batches there (None: no device stage).
        dtype: with ``device=``, the float dtype of the images (None: what the pipeline gives).
        shm_ring: the 0.1 spelling of ``backend="ring"`` (True) or ``"dataloader"`` (False).

    Raises:
        ArgumentError: an unknown backend, or one that does not fit the dataset or the other
            arguments (the message names both).
    """
    if transform is not None:   # 0.1's name: one name, one meaning (open_dataset's per-sample transform)
        raise UsageError("dlstore.loader(transform=...) is now batch_transform= (a GPUDataset's batch "
                         "pipeline); a StoreDataset takes its transforms in open_dataset(path, transform=...)")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ArgumentTypeError(f"seed must be an int (or None: 0, a GPUDataset's own), got {seed!r}")
    if backend not in BACKENDS:
        raise ArgumentError(f"dlstore.loader: backend must be one of {', '.join(map(repr, BACKENDS))}, "
                            f"got {backend!r}")
    if isinstance(dataset, GPUDataset) and backend not in ("auto", "gpu"):
        raise ArgumentError(f"dlstore.loader: backend={backend!r} with a GPUDataset: its batches are indexed on "
                            "its device (backend='gpu'); for threads or workers open the store with open_dataset")
    if backend == "gpu" and not isinstance(dataset, GPUDataset):
        raise ArgumentError(f"dlstore.loader: backend='gpu' serves a GPUDataset (dlstore.GPUDataset(path, "
                            f"device=...)), got {type(dataset).__name__}")
    if sampler is not None:
        if not (hasattr(sampler, "__iter__") and hasattr(sampler, "__len__")):
            raise ArgumentTypeError(f"dlstore.loader: sampler= takes a Sampler (iterable, with len), got "
                                    f"{type(sampler).__name__}")
        for name, value in (("shuffle", shuffle), ("distributed", distributed)):
            if value is True:
                raise ArgumentError(f"dlstore.loader: sampler= and {name}=True: the sampler sets the order "
                                    f"(give it distributed=True or num_replicas/rank); drop {name}")
    if isinstance(dataset, GPUDataset):
        unused = [name for name, value, default in (
            ("num_workers", num_workers, 0), ("generator", generator, None), ("pin_memory", pin_memory, False),
            ("persistent_workers", persistent_workers, False),
            ("multiprocessing_context", multiprocessing_context, None), ("worker_init_fn", worker_init_fn, None),
            ("threads", threads, None), ("device", device, None), ("dtype", dtype, None), ("shm_ring", shm_ring, None),
            ("sampler", sampler, None),
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
        return GPULoader(dataset, batch_size, shuffle, drop_last=drop_last, transform=batch_transform, seed=seed,
                         channels_last=channels_last, rank=rank, world_size=world_size,
                         prefetch=2 if prefetch_factor is None else prefetch_factor, fused=fused, compile=compile)
    if fused is not None or compile:
        raise ArgumentError("dlstore.loader: fused= and compile= apply to a GPUDataset (its gather on the device); "
                            "a StoreDataset's crop + flip is fused into its batch copy already")
    if batch_transform is not None:
        raise ArgumentError("dlstore.loader: batch_transform= applies to a GPUDataset only; give a "
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
        # JPEG records go to CUDA undecoded (nvjpeg decodes them there: device_decode.py), except
        # through the ring, whose slots hold pixels
        target = torch.device(device)
        to_device = target.type == "cuda" and not shm_ring and backend != "ring"
        host_ds, steps = host_stage(dataset, records_to=target if to_device else None)
        host = loader(host_ds, batch_size, shuffle, num_workers, backend=backend, sampler=sampler,
                      drop_last=drop_last, generator=generator,
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
        raise ArgumentError(f"threads must be None (chosen), a positive int (or 0: backend='dataloader'), got {threads!r}")
    if prefetch_factor is not None and (not isinstance(prefetch_factor, int) or isinstance(prefetch_factor, bool)
                                        or prefetch_factor < 1):
        raise ArgumentError(f"prefetch_factor must be a positive int (batches in flight per worker or thread), "
                            f"got {prefetch_factor!r}")
    if shm_ring is not None and not isinstance(shm_ring, bool):
        raise ArgumentTypeError(f"shm_ring must be None (chosen), True or False, got {shm_ring!r}")
    # DataLoader-only options ask for worker processes or the DataLoader, never for threads
    dataloader_only = [name for name, value in (("worker_init_fn", worker_init_fn), ("persistent_workers",
                       persistent_workers), ("multiprocessing_context", multiprocessing_context)) if value]
    threads, shm_ring = _backend_choice(backend, dataset, num_workers=num_workers, threads=threads,
                                        shm_ring=shm_ring, dataloader_only=dataloader_only)
    if distributed:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ArgumentError("loader(distributed=True) needs an initialised torch.distributed process group "
                             "(launch with torchrun and call torch.distributed.init_process_group first)")
        sampler = DistributedSampler(dataset, shuffle=shuffle, seed=seed or 0, drop_last=drop_last)
    elif sampler is None:
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
        raise ArgumentError(f"backend='ring' needs a batch path of fixed output shape; {dataset!r} gives "
                            "variable shapes or non-tensor batches: pass backend='dataloader' (or 'auto')")
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
