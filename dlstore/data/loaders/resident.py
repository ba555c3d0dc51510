"""The resident back-end: batches of a :class:`~dlstore.data.gpu.GPUDataset` indexed and augmented on its device.

One pass: the sampler's batches (host indices, the same order rules as every back-end),
then, a group of batches at a time, a gather from the resident tensor (one fused gather,
or ``index_select`` and the transform's steps: ``gpu/steps.py``), handed out as slices; in
stream mode each batch is read from the store ahead, on a thread.

Groups: where every step draws per sample, ``group_batches`` batches (about 64 MiB of
output; 8 MiB on the CPU) are gathered and augmented in one go and handed out as slices:
far fewer kernel launches. Group g holds batches ``g*G .. g*G+G-1`` and draws from a
generator seeded with its first batch's seed, so a resumed pass rebuilds only the group it
stopped in (its batches before the resume point are built and not handed out).

On ``device="cpu"`` a group is built on the caller's thread alone (``intraop``) and stays
under glibc's 32 MiB mmap threshold, so its buffers reuse the memory the last group freed
instead of fresh pages for the kernel to fault in and zero (docs/shared-machines.md).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ...transforms.batch import BatchRandomCrop
from ...transforms.planner import draws_per_sample
from ..gpu.padding import NO_PADDING, unpadded_crop
from ..gpu.steps import choose_gather
from ..intraop import one_thread
from .passes import PassPlan

# Served bytes per group of batches that the loader gathers and augments in one go: on a GPU
# enough to amortise its kernel launches; on the CPU well under glibc's 32 MiB mmap
# threshold, with room for a conversion's float32 copy (see the module's docstring).
GROUP_BYTES = 64 << 20
CPU_GROUP_BYTES = 8 << 20


class ResidentBackend:
    """Serves a GPUDataset's batches from its device (see the module doc).

    Args:
        dataset: a GPUDataset (its ``steps``: the planned transform).
        batch_size: rows of a full batch (sizes the groups).
        prefetch: batches read ahead in stream mode.
        fused, compile: run crop + flip + the conversion as one gather (``gpu/fused.py``).
        channels_last: images in ``torch.channels_last`` memory format.
    """

    name = "resident"

    def __init__(self, dataset: Any, *, batch_size: int | None, prefetch: int, fused: bool | None,
                 compile: bool, channels_last: bool):
        self.dataset = dataset
        self.batch_size = batch_size or 1
        self.prefetch = max(1, prefetch)
        self.channels_last = channels_last
        self.steps = dataset.steps
        # The resident tensor the unfused path gathers from: the padded copy when the first
        # step is a crop with the dataset's padding (it then pads nothing), else the samples.
        self.held = dataset.held_samples()
        if self.steps and type(self.steps[0][0]) is BatchRandomCrop and dataset.padding != NO_PADDING:
            crop = unpadded_crop(self.steps[0][0], dataset)
            if crop is not self.steps[0][0]:
                self.steps = [(crop, True)] + self.steps[1:]
                self.held = dataset.data
        self.joint = getattr(dataset, "joint", None) if getattr(dataset, "fields", None) is not None else None
        if self.joint is not None:   # images with masks: gpu/joint.py, step by step
            self.gather, self.fused_reason = None, "a segmentation store's images and masks go step by step"
        else:
            self.gather, self.fused_reason = choose_gather(dataset, dataset.steps, fused=fused, compile=compile,
                                                           channels_last=channels_last)
        self.group_batches = self._group_size()

    @property
    def fused(self) -> bool:
        """Whether groups run as one fused gather (else ``fused_reason`` says why not)."""
        return self.gather is not None

    def _group_size(self) -> int:
        """Batches gathered and augmented together: 1 unless every step draws per sample."""
        ds = self.dataset
        if ds.mode == "stream" or not all(draws_per_sample(fn) or fn is ds.conversion for fn, _ in self.steps):
            return 1
        itemsize = torch.empty((), dtype=ds.dtype).element_size()
        sample = int(np.prod(ds.shape)) * itemsize
        limit = CPU_GROUP_BYTES if ds.device.type == "cpu" else GROUP_BYTES
        return max(1, limit // (sample * self.batch_size))

    def close(self) -> None:
        """Nothing outlives a pass."""

    def describe(self) -> str:
        gather = "fused gather" if self.fused else f"step by step ({self.fused_reason})"
        return f"device={self.dataset.device}, groups of {self.group_batches} batch(es), {gather}"

    def begin(self, run: PassPlan) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.dataset.mode == "stream":
            return self._stream(run)
        return self._groups(run)

    def _groups(self, run: PassPlan) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
        ds, size = self.dataset, self.group_batches
        generator = torch.Generator(device=ds.device)
        order = iter(run.order)
        # the group the resumed pass stopped in starts at a multiple of the group size
        start = run.first - run.first % size
        for _ in itertools.islice(order, start):
            pass
        while True:
            group = list(itertools.islice(order, size))
            if not group:
                return
            sizes = [len(indices) for _, indices in group]
            idx = torch.as_tensor(np.concatenate([np.asarray(i, dtype=np.int64) for _, i in group]),
                                  device=ds.device)
            generator.manual_seed(run.seed(group[0][0]))
            with self._build():
                if self.joint is not None:
                    images, labels = self._joint(self.held.index_select(0, idx), generator)
                else:
                    images = self.gather(idx, generator) if self.gather is not None \
                        else self._augment(self.held.index_select(0, idx), generator)
                    labels = ds.labels.index_select(0, idx)
            offset = 0
            for (k, _), n in zip(group, sizes):
                if k >= run.first:
                    yield images[offset:offset + n], labels[offset:offset + n]
                offset += n

    def _build(self) -> contextlib.AbstractContextManager:
        """On the CPU, a group's ops on the caller's thread alone (its count restored for the code between
        batches); on a GPU as it is (the host thread only launches kernels)."""
        return one_thread() if self.dataset.device.type == "cpu" else contextlib.nullcontext()

    def _augment(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A gathered group as held (uint8, or converted in preload mode) -> served and augmented."""
        for fn, takes_generator in self.steps:
            images = fn(images, generator=generator) if takes_generator else fn(images)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images

    def _joint(self, records: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """A gathered group of a segmentation store's records -> (images as served, masks)."""
        images, masks = self.joint(records, generator)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, masks

    def _stream(self, run: PassPlan) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
        ds = self.dataset
        generator = torch.Generator(device=ds.device)

        def read(item: tuple[int, Any]) -> tuple[int, np.ndarray, torch.Tensor]:
            k, indices = item
            idx = np.asarray(indices, dtype=np.int64)
            return k, idx, ds.read(idx)

        prefetcher = _Prefetcher(run.batches, read, depth=self.prefetch)
        try:
            for k, idx, host in prefetcher:
                images = host.to(ds.device, non_blocking=ds.pin)
                generator.manual_seed(run.seed(k))
                with self._build():
                    if self.joint is not None:
                        images, labels = self._joint(images, generator)
                    else:
                        labels = ds.labels.index_select(0, torch.as_tensor(idx, device=ds.device))
                        images = self._augment(images, generator)
                yield images, labels
        finally:
            prefetcher.close()


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

