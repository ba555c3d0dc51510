"""``ThreadLoader``: batches built ahead by a pool of threads, in this process.

A store's batch path (``StoreDataset.get_batch`` on a fixed-shape store: a
gather out of a memory map, an LMDB transaction or HDF5 chunks, the fused
crop/flip copy, batch transforms) is numpy/torch work that releases the GIL.
Threads therefore build batches in parallel with no inter-process copy: a
batch is built once, in memory the training loop reads directly. Worker
processes (``num_workers=``) remain for per-sample Python ops that hold the GIL.

Reproducibility, whatever the thread count::

    base  = one int64 drawn from `generator` (or torch's default generator) per pass,
            as DataLoader draws its `_base_seed`
    batch k of a pass -> torch.Generator seeded with SeedSequence([base, epoch, k])

so batch k gets the same random draws with 1 thread or 4, and batches come
out in sampler order. Random ops must take that generator (batch transforms
and the fused crop/flip do; a torchvision per-sample op draws from torch's
global generator, which threads share: not reproducible, which is one reason
``dlstore.loader`` does not pick threads for such pipelines by itself).

Each thread runs the torch ops of its batch (batch transforms, the pinning copy) on
itself alone (``intraop.one_thread_here``): the threads are the parallelism, and a torch
intra-op team per thread would oversubscribe the cores and stall on a busy machine.

With the reader's ``willneed`` on (a store that cannot stay cached), the kernel is asked
for each batch's samples ``ADVISE_AHEAD_BYTES`` of batches before a thread (or, in
``ShmRingLoader``, a worker process) builds it (``StoreReader.prefetch``), so the disk reads ahead of the gathers whatever the order, as
its own readahead does for a sequential read of a file (which the store's maps no longer
have: ``readahead.readahead_default``).

A batch handed out is never written again by the loader: each is a buffer of
its own, and the dataset recycles a buffer only once no tensor refers to it
(``StoreDataset._new_batch``). With ``pin_memory`` the batch is copied, on the
loader thread, into page-locked memory from torch's caching host allocator,
which likewise reuses a block only after its last tensor is gone.
"""

from __future__ import annotations

import itertools
import warnings
from collections import deque
from collections.abc import Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler

from ...errors import ArgumentError, DlstoreError
from ...formats.readahead import batches_advised_ahead
from ..intraop import one_thread_here
from ..passes import LoaderIterator, PassState
from ..profiling_ranges import profiling_range


def batch_seed(base: int, epoch: int, k: int) -> int:
    """The seed of batch ``k`` of a pass whose base seed is ``base``, in epoch ``epoch``."""
    entropy = [base % (1 << 64), epoch % (1 << 64), k]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0])


def _pin(value: Any) -> Any:
    return value.pin_memory() if isinstance(value, torch.Tensor) else value


class ThreadLoader:
    """Iterates ``(images, labels)`` batches of a StoreDataset, built by ``threads`` threads.

    Behaves like the DataLoader that ``dlstore.loader`` returns otherwise: ``len()``,
    re-iteration for each epoch, ``sampler.set_epoch`` (or ``set_epoch``) for a
    distributed shuffle.

    Args:
        dataset: a StoreDataset.
        batch_sampler: yields the index list of each batch (it may have ``set_epoch``).
        threads: threads building batches (>= 1).
        prefetch: batches in flight (submitted, being built or waiting to be taken), >= threads.
        generator: the per-pass base seed is drawn from it (None: torch's default generator).
        pin_memory: page-locked batches, when CUDA is available.
    """

    def __init__(self, dataset: Any, batch_sampler: BatchSampler, *, threads: int, prefetch: int,
                 generator: torch.Generator | None = None, pin_memory: bool = False):
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ArgumentError(f"threads must be a positive int, got {threads!r}")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 1:
            raise ArgumentError(f"prefetch must be a positive int (batches in flight), got {prefetch!r}")
        self.dataset = dataset
        self.batch_sampler = batch_sampler
        self.threads = threads
        self.prefetch = max(prefetch, threads)
        self.generator = generator
        if pin_memory and not torch.cuda.is_available():
            warnings.warn("dlstore.loader: pin_memory=True but CUDA is not available; batches are not pinned",
                          stacklevel=3)
            pin_memory = False
        self.pin_memory = pin_memory
        self.epoch = 0
        self._state = PassState()

    @property
    def sampler(self) -> BatchSampler:
        """The batch sampler (``loader.sampler.set_epoch(epoch)`` as on the DataLoader path)."""
        return self.batch_sampler

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch: it enters every batch seed and the distributed shuffle."""
        self.epoch = epoch
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands in its epoch: ``load_state_dict`` on a loader made with the same
        arguments (in another process too) continues with the same batches and augmentations."""
        return self._state.state_dict(self.generator, self._epoch())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the epoch is set, and the next pass skips the batches
        already handed out (without building them)."""
        self.set_epoch(self._state.load_state_dict(state, len(self)))

    def _epoch(self) -> int:
        # the sampler's own record when it keeps one, so loader.sampler.set_epoch(e) (the
        # DataLoader path's idiom) counts as set_epoch(e)
        return int(getattr(self.batch_sampler, "epoch", self.epoch))

    def _build(self, indices: Any, seed: int) -> tuple[torch.Tensor, Any]:
        with profiling_range("dlstore.build_batch"):   # in the builder thread: read + host transforms
            generator = torch.Generator()
            generator.manual_seed(seed)
            images, labels = self.dataset.get_batch(indices, generator=generator)
            if self.pin_memory:
                images, labels = _pin(images), _pin(labels)
            return images, labels

    def __iter__(self) -> Iterator[tuple[torch.Tensor, Any]]:
        return LoaderIterator(self._thread_batches())

    def _thread_batches(self) -> Generator[tuple[torch.Tensor, Any], None, None]:
        epoch = self._epoch()
        skip = self._state.begin(self.generator, epoch)
        base = int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
        _open_handles(self.dataset)
        # Buffers in use at once: the batches in flight, the one the user holds and the one
        # before it (still bound to the loop variable while next() runs), one for a last,
        # smaller batch; fewer and the dataset would allocate (and page-fault) new ones.
        keep = getattr(self.dataset, "_keep_buffers", None)
        release = keep(self.prefetch + 4) if keep is not None else None
        batches, ahead = self._index_batches(skip)
        # each thread builds a batch on its own: torch's ops in it start no intra-op team (see intraop)
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="dlstore-loader",
                                  initializer=_advised_builder if ahead else one_thread_here)
        pending: deque[Future] = deque()

        def submit(k: int, indices: Any) -> None:
            pending.append(pool.submit(self._build, indices, batch_seed(base, epoch, k)))

        try:
            for k, indices in itertools.islice(batches, self.prefetch):
                submit(k, indices)
            while pending:
                nxt = next(batches, None)
                if nxt is not None:
                    submit(*nxt)
                # yielded straight from the future: this frame keeps no reference to the batch
                # the user holds, so its buffer is recycled as soon as the user lets go of it
                self._state.served += 1
                yield pending.popleft().result()
            self._state.end()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            if release is not None:       # the dataset's other passes keep what they asked for
                release()

    def _index_batches(self, skip: int) -> tuple[Iterator[tuple[int, Any]], bool]:
        """This pass's ``(k, indices)`` from the batch sampler, past the ``skip`` a resumed pass
        has served; with the reader's ``willneed`` on, each advised ahead (the second value)."""
        batches = itertools.islice(enumerate(iter(self.batch_sampler)), skip, None)
        reader = getattr(self.dataset, "format_reader", None)
        if not (getattr(reader, "willneed", False) and hasattr(reader, "prefetch")):
            return batches, False
        shape = getattr(reader, "shape", None)
        sample = int(np.prod(shape)) if shape else 64 << 10
        return _advised_ahead(batches, reader, sample * getattr(self.batch_sampler, "batch_size", 1)), True

    def __repr__(self) -> str:
        return (f"ThreadLoader({self.dataset!r}, batches={len(self)}, threads={self.threads}, "
                f"prefetch={self.prefetch}, pin_memory={self.pin_memory})")


# Bytes of batches whose samples are advised ahead of the one being built: a few of the
# disk's readahead units (8 MiB here), well under the memory a store too big to cache leaves.
ADVISE_AHEAD_BYTES = 32 << 20


def _advised_ahead(batches: Iterator[tuple[int, Any]], reader: Any,
                   batch_bytes: float) -> Iterator[tuple[int, Any]]:
    """``batches`` unchanged, each one's samples advised to the kernel (``reader.prefetch``)
    ``ADVISE_AHEAD_BYTES`` worth of batches before it is yielded."""
    ahead = int(min(64, max(1, ADVISE_AHEAD_BYTES // max(batch_bytes, 1))))
    window: deque[tuple[int, Any]] = deque()
    for item in batches:
        try:
            reader.prefetch(item[1])
        except DlstoreError:     # advice only: building that batch raises the error, in its turn
            pass
        window.append(item)
        if len(window) > ahead:
            yield window.popleft()
    yield from window


def _advised_builder() -> None:
    one_thread_here()
    batches_advised_ahead()   # the reader's own advice of each batch would repeat _advised_ahead's


def _open_handles(dataset: Any) -> None:
    """Open the reader's handles here, before the threads start.

    Readers open lazily on first use (``ForkSafe._ensure_open``, under a lock, so
    threads racing to open are safe); opening here keeps that cost, and any error
    about the store, out of the first batch's thread.
    """
    ensure = getattr(getattr(dataset, "format_reader", None), "_ensure_open", None)
    if ensure is not None:
        ensure()
