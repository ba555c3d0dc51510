"""The device stage of ``loader(device=...)``: uint8 host batches moved to a device and finished there.

``dlstore.loader(ds, batch_size, device="cuda")`` cuts the dataset's read-time transforms in
two (``StoreDataset.host_stage``): the host stage (random crops and flips on uint8, built by
the loader's back-end) and the device stage (the float tail: ``ToDtype``, ``Normalize`` and
every op after them). Only uint8 crosses the worker boundary, the pinned buffers and the
host-to-device copy: a quarter of the bytes of a float32 batch.

Per batch, in the thread that iterates the loader::

    host batch (uint8, from a thread or worker)
      -> copy into ring slot j (pinned on CUDA; the slot's last H2D copy waited for first)
      -> side stream: slot j -> device, non_blocking; event E_j recorded (slot j free once E_j is done)
                      device stage (ToDtype + Normalize as one kernel, ...); event "ready" recorded
      -> the user's stream waits for "ready"; the tensors are record_stream'ed on it
         (the caching allocator then reuses their memory only after the user's work on them)

Batch k+1 is issued before batch k is handed out, so its copy and device stage overlap the
training step on batch k. The device stage's draws come from a generator seeded with batch
k's device seed (``PassPlan.seed``): independent of the batches before, so a resumed pass
skips them unbuilt. On a device without streams (``"cpu"``) the same steps run
synchronously: that is how the tests exercise this path without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import torch

from ...errors import ArgumentError
from ...transforms.batch import BatchNormalize
from ..device_decode import DeviceDecode, EncodedBatch
from ..profiling_ranges import profiling_range
from .passes import PassPlan
from .seeds import DEVICE_STREAM

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Ring slots: batch k+1 is being copied while batch k+2 is staged; one spare so staging
# rarely waits for a copy.
RING_SLOTS = 3


def with_dtype(steps: Sequence[Any], dtype: torch.dtype | None) -> list[Any]:
    """``steps`` with a final ``BatchNormalize`` writing ``dtype`` directly (it computes in float32
    and rounds once, so this equals a cast afterwards, without the float32 intermediate)."""
    steps = list(steps)
    last = steps[-1] if steps else None
    if dtype is not None and isinstance(last, BatchNormalize) and last.dtype != dtype:
        steps[-1] = BatchNormalize(last.mean, last.std, dtype=dtype, scale=last.scale, divide=last.divide)
    return steps


class _Normalize:
    """``BatchNormalize`` with its mean and std already on the device: the same float32 operations in
    the same order (so the same bits), without a host-to-device copy of them per batch -- from
    pageable memory such a copy would make the host wait for everything queued on the stream."""

    def __init__(self, op: BatchNormalize, device: torch.device):
        self.op = op
        self.mean = self.std = None
        if op.mean is not None:
            self.mean = torch.tensor(op.mean, dtype=torch.float32, device=device).view(-1, 1, 1)
            self.std = torch.tensor(op.std, dtype=torch.float32, device=device).view(-1, 1, 1)

    def __call__(self, images: torch.Tensor, generator: Any = None) -> torch.Tensor:
        if self.mean is None or self.mean.numel() not in (1, images.shape[1]):
            return self.op(images, generator)           # BatchNormalize checks and says what is wrong
        x = images.to(torch.float32)
        if x is images:
            x = x.clone()
        self.op.scale_(x, images)          # v2's multiply by the reciprocal, or v1's division
        x.sub_(self.mean).div_(self.std)
        return x.to(self.op.dtype)

    def __repr__(self) -> str:
        return repr(self.op)


class _Ring:
    """A few reused host buffers to copy from (page-locked when ``pin``); slot j is written again only
    after the copy recorded in its event is complete."""

    def __init__(self, slots: int, pin: bool):
        self.pin = pin
        self.buffers: list[torch.Tensor | None] = [None] * slots
        self.events: list[Any] = [None] * slots
        self.next = 0

    def stage(self, images: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Copy ``images`` into the next slot; (slot, a view of it shaped as ``images``)."""
        j = self.next
        self.next = (j + 1) % len(self.buffers)
        if self.events[j] is not None:
            self.events[j].synchronize()              # its last host-to-device copy has read it
            self.events[j] = None
        buf = self.buffers[j]
        n = images.numel()
        if buf is None or buf.numel() < n or buf.dtype != images.dtype:
            buf = torch.empty(n, dtype=images.dtype, pin_memory=self.pin)
            self.buffers[j] = buf
        view = buf[:n].view(images.shape)
        view.copy_(images)
        return j, view

    def release_after(self, j: int, event: Any) -> None:
        self.events[j] = event


def _random(step: Any) -> bool:
    return not isinstance(step, (BatchNormalize, _Normalize, DeviceDecode))   # DeviceDecode: drawn on the host


class DeviceStage:
    """Moves a pass's host batches to ``device`` and runs the device steps there (see the module doc).

    Args:
        device: where batches go (any torch device).
        steps: the device stage (``StoreDataset.host_stage``): ``step(images, generator)`` each,
            a DeviceDecode first for a JPEG store decoded on the device.
        dtype: the float dtype of the output (None: what the pipeline produces); a result
            that is still uint8 (no float op in the device stage) stays uint8.
        channels_last: return images in ``torch.channels_last`` memory format.
    """

    def __init__(self, device: str | torch.device, steps: Sequence[Any], *, dtype: torch.dtype | None = None,
                 channels_last: bool = False, ring: int = RING_SLOTS):
        if dtype is not None and dtype not in DTYPES:
            raise ArgumentError(f"dtype must be one of {', '.join(map(str, DTYPES))} (or None: the "
                                f"pipeline's own), got {dtype!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.steps = with_dtype(steps, dtype)
        self.dtype = dtype
        self.channels_last = channels_last
        self.ring = ring
        self.random = any(_random(s) for s in self.steps)

    def batches(self, host: Iterator[tuple[Any, Any]], run: PassPlan) -> Generator[tuple[Any, Any], None, None]:
        """The pass's batches on the device, in order (``host``: its host batches from ``run.first`` on)."""
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None
        steps = [_Normalize(s, self.device) if isinstance(s, BatchNormalize) else s for s in self.steps]
        decode = steps.pop(0) if steps and isinstance(steps[0], DeviceDecode) else None
        ring = _Ring(self.ring, pin=cuda)
        generator = torch.Generator(device=self.device) if self.random else None

        def issue(k: int, batch: tuple[Any, Any]) -> tuple[torch.Tensor, Any, Any]:
            images, labels = batch
            encoded = images if decode is not None and isinstance(images, EncodedBatch) else None
            j, slot = ring.stage(images) if encoded is None else (None, None)
            del batch, images                             # the host buffer is free for the next batch
            if generator is not None:
                generator.manual_seed(run.seed(k, DEVICE_STREAM))
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                if encoded is not None:                   # records: decoded and cropped on the device
                    with profiling_range("dlstore.decode_on_device"):
                        x = decode(encoded, self.device)
                    del encoded
                with profiling_range("dlstore.copy_to_device"):
                    # non_blocking only from pinned memory on CUDA: elsewhere the slot may be rewritten next
                    if slot is not None:
                        x = slot.to(self.device, non_blocking=cuda) if self.device.type != "cpu" else slot.clone()
                    if slot is not None and cuda:
                        copied = torch.cuda.Event()
                        copied.record(stream)
                        ring.release_after(j, copied)
                    labels = self._labels_to_device(labels, cuda)
                with profiling_range("dlstore.device_transforms"):
                    for step in steps:
                        x = step(x, generator)
                if self.dtype is not None and x.is_floating_point() and x.dtype != self.dtype:
                    x = x.to(self.dtype)
                if self.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                ready = None
                if cuda:
                    ready = torch.cuda.Event()
                    ready.record(stream)
            return x, labels, ready

        k = run.first
        first = next(host, None)
        if first is None:
            return
        pending = issue(k, first)
        del first
        for batch in host:
            k += 1
            following = issue(k, batch)   # overlaps the user's step on the batch handed out next
            del batch
            out, pending = pending, following
            yield self._hand_out(*out)
            del out
        yield self._hand_out(*pending)

    def _labels_to_device(self, labels: Any, cuda: bool) -> Any:
        if isinstance(labels, torch.Tensor) and cuda:
            # pinned (torch's caching host allocator keeps the block until the copy is done):
            # from pageable memory the copy would first wait for everything on the stream
            return labels.pin_memory().to(self.device, non_blocking=True)
        if isinstance(labels, torch.Tensor):
            return labels.to(self.device)
        return labels

    def _hand_out(self, x: torch.Tensor, labels: Any, ready: Any) -> tuple[torch.Tensor, Any]:
        if ready is not None:
            user = torch.cuda.current_stream(self.device)
            user.wait_event(ready)
            x.record_stream(user)    # allocated on the side stream, used on the user's
            if isinstance(labels, torch.Tensor):
                labels.record_stream(user)
        return x, labels

    def describe(self) -> str:
        steps = ", ".join(map(repr, self.steps)) or "none"
        return f"device={self.device}, dtype={self.dtype}, device stage=[{steps}]"
