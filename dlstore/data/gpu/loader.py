"""The loader of a :class:`~dlstore.data.gpu.GPUDataset`: batches indexed and augmented on the device.

One pass (an epoch, or the rest of one after ``load_state_dict``): this rank's order
(``indices``), then, a group of batches at a time, a gather from the resident tensor
(one fused gather, or ``index_select`` and the transform's steps: ``steps.py``), handed
out as slices; in stream mode each batch is read from the store ahead, on a thread.

On ``device="cpu"`` (no GPU: the data and the gathers are in host memory) a group is built
as a store's batch is (``dlstore.data.intraop``): its torch ops run on the caller's thread
alone, and a group stays under glibc's 32 MiB mmap limit, so that its buffers are memory
freed by the last group, not fresh pages for the kernel to fault in and zero. On 2 cores,
64 batches of 3x224x224 uint8: the fault-in of a 64 MiB group's fresh mmap was about 4/5 of
its time, and torch's two-thread team kept 0.1-0.3x of its rate beside two busy processes
(``benchmarks/contention.py``; docs/shared-machines.md).
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ...errors import ArgumentError
from ...transforms.batch import BatchRandomCrop
from ...transforms.planner import draws_per_sample
from ..intraop import one_thread
from ..passes import STATE_VERSION, LoaderIterator
from .padding import NO_PADDING, unpadded_crop
from .partition import epoch_order, per_rank, resolve_distributed
from .resident import Resident
from .steps import against_store, choose_gather, plan_steps

# Served bytes per group of batches that the loader gathers and augments in one go: on a GPU
# enough to amortise its kernel launches; on the CPU (where a launch costs microseconds) well
# under glibc's 32 MiB mmap limit, room left for a conversion's float32 copy, so that the
# allocator reuses the memory of the groups before (see the module's docstring).
GROUP_BYTES = 64 << 20
CPU_GROUP_BYTES = 8 << 20


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

    Batches: ``index_select`` on the device, then the steps of ``transform``
    (``steps``; see :mod:`~dlstore.data.gpu.steps`): the same transforms ``open_dataset`` takes, with
    the same result as torchvision per sample followed by the dataset's
    conversion (``ToDtype(dtype, scale=True)`` and ``Normalize``); then
    optionally channels_last. A torchvision pipeline or :class:`HybridTransform`
    runs its ops with a batch equivalent per batch (independent parameters per
    sample) and the others on each sample in turn; dlstore batch transforms run
    as given; any other callable gets the converted batch, with
    ``generator=`` only if it declares a parameter of that name. When every step
    draws per sample (or there is no transform), the steps run on groups of
    ``group_batches`` batches (about 64 MiB of output; 8 MiB on the CPU) and the batches are
    slices of the result: the same distribution of outputs with far fewer
    kernel launches. Any other callable sees one batch at a time.

    ``fused=True`` runs crop (with padding) + flip + the conversion +
    channels_last as one gather (:mod:`~dlstore.data.gpu.fused`) where the
    transform has only those steps, with the same draws and bit-identical
    output, and raises when the transform cannot be fused; ``fused=False``
    keeps the step-by-step path; ``fused=None`` (default) fuses only with
    ``compile=True`` on CUDA: eager, the step-by-step path measured faster
    (docs/gpu.md). ``compile=True`` runs the fused gather
    through ``torch.compile`` (the conversion as a table lookup: same bits;
    eager fallback if compiling fails). ``loader.fused`` / ``loader.fused_reason``
    say which path runs.

    Raises:
        TransformSpecError: an op cannot run faithfully on this dataset (a
            per-sample torchvision op on converted data, a second Normalize).
        StaticMismatchError: a hybrid's static part differs from the store's, or a
            pipeline begins with some of the store's static ops but not all, or with one
            under other settings (one that begins with all of them runs without them:
            ``already_applied`` lists them).
    """

    def __init__(
        self,
        dataset: Resident,
        batch_size: int,
        shuffle: bool = False,
        *,
        drop_last: bool = False,
        transform: Any = None,
        seed: int | None = None,
        channels_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        prefetch: int = 2,
        fused: bool | None = None,
        compile: bool = False,
    ):
        if int(batch_size) < 1:
            raise ArgumentError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.transform = transform
        # a whole pipeline's leading ops that made the stored samples do not run again
        planned = against_store(transform, dataset)
        self.already_applied = planned.already_applied
        steps = plan_steps(planned.steps(), dataset)
        self.steps = steps
        self.channels_last = channels_last
        # The resident tensor the unfused path gathers from: the padded copy when the first
        # step is a crop with the dataset's padding (it then pads nothing), else the samples.
        self._held = dataset.held_samples()
        if self.steps and type(self.steps[0][0]) is BatchRandomCrop and dataset.padding != NO_PADDING:
            crop = unpadded_crop(self.steps[0][0], dataset)
            if crop is not self.steps[0][0]:
                self.steps = [(crop, True)] + self.steps[1:]
                self._held = dataset.data
        self._fused, self.fused_reason = choose_gather(dataset, steps, fused=fused, compile=compile,
                                                       channels_last=channels_last)
        # by default the dataset's rank and world size (its share, when sharded)
        rank = dataset.rank if rank is None else rank
        world_size = dataset.world_size if world_size is None else world_size
        self.rank, self.world_size = resolve_distributed(rank, world_size)
        if dataset.sharded and (self.rank, self.world_size) != (dataset.rank, dataset.world_size):
            raise ArgumentError(f"this GPUDataset holds rank {dataset.rank} of {dataset.world_size}'s share "
                                f"(shard=True); its loader cannot serve rank {self.rank} of {self.world_size}")
        if seed is None:
            # Every rank must draw the same permutation: a fixed default, like DistributedSampler.
            seed = 0 if self.world_size > 1 else int(torch.randint(0, 2**62, ()).item())
        self.seed = int(seed)
        self.prefetch = max(1, int(prefetch))
        self.epoch = 0
        self._skip = 0                   # batches the next pass skips (load_state_dict)
        self._pass: tuple[int, int] | None = None   # (epoch, batches handed out) of the pass in progress
        self.group_batches = self._group_size()
        device = dataset.device
        self._perm_gen = torch.Generator(device=device)
        self._aug_gen = torch.Generator(device=device)

    @property
    def fused(self) -> bool:
        """Whether groups run as one fused gather (else ``fused_reason`` says why not)."""
        return self._fused is not None

    def _group_size(self) -> int:
        """Batches gathered and augmented together: 1 unless the transform is per-sample."""
        ds = self.dataset
        if ds.mode == "stream" or not all(draws_per_sample(fn) or fn is ds.conversion for fn, _ in self.steps):
            return 1
        itemsize = torch.empty((), dtype=ds.dtype).element_size()
        sample = int(np.prod(ds.shape)) * itemsize
        limit = CPU_GROUP_BYTES if ds.device.type == "cpu" else GROUP_BYTES
        return max(1, limit // (sample * self.batch_size))

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s permutation for the next iteration (and count on from there)."""
        self.epoch = int(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: an epoch's order and augmentations follow from (seed, epoch,
        rank), so the state is those and the batches of the epoch handed out."""
        epoch, served = self._pass if self._pass is not None else (self.epoch, self._skip)
        return {"version": STATE_VERSION, "epoch": epoch, "batches": served, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next pass is that epoch, past the batches handed out
        (they are gathered and augmented again, unseen: each group's draws follow the last's)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION or not all(
                isinstance(state.get(k), int) for k in ("epoch", "batches", "seed")) \
                or not 0 <= state["batches"] <= len(self):
            raise ArgumentError(f"load_state_dict takes what state_dict() returned, got {state!r}")
        self.seed, self.epoch, self._skip = state["seed"], state["epoch"], state["batches"]

    @property
    def num_samples(self) -> int:
        """Samples this rank sees per epoch (including the wrap-around padding)."""
        if self.dataset.sharded:  # every rank serves as many as the longest share holds
            return per_rank(self.dataset.total_samples, self.world_size)
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
        if self.dataset.sharded:  # positions in this rank's share, permuted per rank and epoch
            return epoch_order(n, self.num_samples, shuffle=self.shuffle, seed=self.seed, epoch=epoch,
                               rank=self.rank, device=device)
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
        return LoaderIterator(self._batches())

    def _batches(self) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
        epoch, skip = self.epoch, self._skip
        self.epoch += 1
        self._skip = 0
        self._pass = (epoch, 0)
        with contextlib.closing(self._epoch_batches(epoch)) as batches:   # (its prefetcher stops with it)
            for k, batch in enumerate(batches):
                if k >= skip:
                    self._pass = (epoch, k + 1)
                    yield batch
        self._pass = None

    def _epoch_batches(self, epoch: int) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
        order = self.indices(epoch)
        self._aug_gen.manual_seed(self._aug_seed(epoch))
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
            with self._build():
                if self._fused is not None:
                    images = self._fused(idx, self._aug_gen)
                else:
                    images = self._augment(self._held.index_select(0, idx))
            labels = ds.labels.index_select(0, idx)
            for s in range(0, len(idx), self.batch_size):
                yield images[s:s + self.batch_size], labels[s:s + self.batch_size]

    def _build(self) -> contextlib.AbstractContextManager:
        """Where a group is built: on the CPU, on the caller's thread alone (its count restored
        for the code between batches); on a GPU as it is (the host thread only launches kernels)."""
        return one_thread() if self.dataset.device.type == "cpu" else contextlib.nullcontext()

    def _aug_seed(self, epoch: int) -> int:
        """Seed of the augmentation generator in ``epoch``: differs per epoch and per rank, yet is reproducible."""
        return (self.seed * 1_000_003 + epoch * 7_919 + self.rank) % (2**63)

    def _augment(self, images: torch.Tensor) -> torch.Tensor:
        """A gathered group as held (uint8, or converted in preload mode) -> served and augmented."""
        for fn, takes_generator in self.steps:
            images = fn(images, generator=self._aug_gen) if takes_generator else fn(images)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images

    def _stream(self, order: torch.Tensor, batches: list[tuple[int, int]]
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        ds = self.dataset
        host_order = order.cpu().numpy()

        def read(bounds: tuple[int, int]) -> torch.Tensor:
            start, stop = bounds
            return ds.read(host_order[start:stop])

        prefetcher = _Prefetcher(batches, read, depth=self.prefetch)
        try:
            for (start, stop), host in zip(batches, prefetcher):
                images = host.to(ds.device, non_blocking=ds.pin)
                labels = ds.labels.index_select(0, order[start:stop])
                with self._build():
                    images = self._augment(images)
                yield images, labels
        finally:
            prefetcher.close()
