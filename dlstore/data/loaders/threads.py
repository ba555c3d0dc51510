"""The threads back-end: batches built ahead by a pool of threads, in this process.

A store's batch path (``StoreDataset.get_batch`` on a fixed-shape store: a gather out
of a memory map, an LMDB transaction or HDF5 chunks, the fused crop/flip, batch
transforms) is numpy/torch work that releases the GIL. Threads therefore build
batches in parallel with no inter-process copy: a batch is built once, in memory the
training loop reads directly (the loader's ``BatchBuffers``, handed in as ``out=``).

Each thread runs the torch ops of its batch on itself alone (``intraop.one_thread_here``):
the threads are the parallelism, and a torch intra-op team per thread would oversubscribe
the cores and stall on a busy machine.

With the dataset's ``advises_reads`` (a store that cannot stay cached), the kernel is asked
for each batch's samples ``ADVISE_AHEAD_BYTES`` of batches before a thread (or, in the
ring, a worker process) builds it, so the disk reads ahead of the gathers whatever the order.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ...errors import DlstoreError
from ...formats.readahead import batches_advised_ahead
from ..intraop import one_thread_here
from ..profiling_ranges import profiling_range
from .buffers import BatchBuffers
from .passes import PassPlan

# Bytes of batches whose samples are advised ahead of the one being built: a few of the
# disk's readahead units (8 MiB here), well under the memory a store too big to cache leaves.
ADVISE_AHEAD_BYTES = 32 << 20


class ThreadBackend:
    """Builds a pass's batches on ``threads`` threads, ``prefetch`` batches in flight, in sampler order.

    Args:
        dataset: a StoreDataset.
        threads: threads building batches (>= 1).
        prefetch: batches in flight (>= threads).
        batch_size: rows of a full batch (sizes the buffers).
        pin_memory: build into page-locked buffers.
    """

    name = "threads"

    def __init__(self, dataset: Any, *, threads: int, prefetch: int, batch_size: int | None, pin_memory: bool):
        self.dataset = dataset
        self.threads = threads
        self.prefetch = max(prefetch, threads)
        self.batch_size = batch_size
        # in flight, the one the user holds and the one before it (still bound to the loop
        # variable while next() runs), one for a last, smaller batch
        self.buffers = BatchBuffers(self.prefetch + 3, pin=pin_memory)

    def begin(self, run: PassPlan) -> Iterator[tuple[Any, Any]]:
        self.dataset.open()          # any error about the store here, in the caller's thread
        return self._batches(run)

    def _build(self, indices: Any, seed: int) -> tuple[Any, Any]:
        with profiling_range("dlstore.build_batch"):   # in the builder thread: read + host transforms
            shape = self.dataset.batch_shape(len(indices))
            out = self.buffers.take(shape) if shape is not None else None
            generator = torch.Generator()
            generator.manual_seed(seed)
            return self.dataset.get_batch(indices, generator=generator, out=out)

    def _batches(self, run: PassPlan) -> Generator[tuple[Any, Any], None, None]:
        batches, ahead = advised(run.batches, self.dataset, self.batch_size)
        # each thread builds a batch on its own: torch's ops in it start no intra-op team (see intraop)
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="dlstore-loader",
                                  initializer=_advised_builder if ahead else one_thread_here)
        pending: deque[Future] = deque()

        def submit(k: int, indices: Any) -> None:
            pending.append(pool.submit(self._build, indices, run.seed(k)))

        try:
            for k, indices in itertools.islice(batches, self.prefetch):
                submit(k, indices)
            while pending:
                nxt = next(batches, None)
                if nxt is not None:
                    submit(*nxt)
                # yielded straight from the future: this frame keeps no reference to the batch
                # the user holds, so its buffer is free as soon as the user lets go of it
                yield pending.popleft().result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        """Nothing outlives a pass."""

    def describe(self) -> str:
        return f"threads={self.threads}, prefetch={self.prefetch}"


def advised(batches: Iterator[tuple[int, Any]], dataset: Any, batch_size: int | None
            ) -> tuple[Iterator[tuple[int, Any]], bool]:
    """``batches``, each one's samples advised to the kernel ahead when the dataset advises its reads
    (the second value: whether it does)."""
    if not dataset.advises_reads:
        return batches, False
    shape = dataset.shape
    sample = int(np.prod(shape)) if shape else 64 << 10
    return _advised_ahead(batches, dataset, sample * (batch_size or 1)), True


def _advised_ahead(batches: Iterator[tuple[int, Any]], dataset: Any,
                   batch_bytes: float) -> Iterator[tuple[int, Any]]:
    """``batches`` unchanged, each one's samples advised (``dataset.prefetch``) ``ADVISE_AHEAD_BYTES``
    worth of batches before it is yielded."""
    ahead = int(min(64, max(1, ADVISE_AHEAD_BYTES // max(batch_bytes, 1))))
    window: deque[tuple[int, Any]] = deque()
    for item in batches:
        try:
            dataset.prefetch(item[1])
        except DlstoreError:     # advice only: building that batch raises the error, in its turn
            pass
        window.append(item)
        if len(window) > ahead:
            yield window.popleft()
    yield from window


def _advised_builder() -> None:
    one_thread_here()
    batches_advised_ahead()   # the reader's own advice of each batch would repeat _advised_ahead's
