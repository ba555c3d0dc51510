"""``DeviceLoader``: uint8 batches from the host stage, moved to a device, finished there.

``dlstore.loader(ds, batch_size, device="cuda")`` cuts the dataset's read-time
transforms in two (``planner.stages``): the host stage (random crops and flips on
uint8, in the loader's threads or worker processes) and the device stage (the
float tail: ``ToDtype``, ``Normalize`` and every op after them). Only uint8
crosses the worker boundary, the pinned buffers and the host-to-device copy: a
quarter of the bytes of a float32 batch.

Per batch, in the main process::

    host batch (uint8, from a thread or worker)
      -> copy into ring slot j (pinned on CUDA; the slot's last H2D copy waited for first)
      -> side stream: slot j -> device, non_blocking; event E_j recorded (slot j free once E_j is done)
                      device stage (ToDtype + Normalize as one kernel, ...); event "ready" recorded
      -> the user's stream waits for "ready"; the tensors are record_stream'ed on it
         (the caching allocator then reuses their memory only after the user's work on them)

Batch k+1 is issued before batch k is handed out, so its copy and device stage
overlap the training step on batch k. No ring slot is ever handed out: the user
gets the device tensors, which the loader never writes again. On a device
without streams (``"cpu"``) the same steps run synchronously: that is how the
tests exercise this path without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ...errors import ArgumentError, ArgumentTypeError
from ...transforms.batch import BatchNormalize, BatchTransform
from ...transforms.equivalents import batch_steps
from ...transforms.planner import stages
from ..device_decode import DeviceDecode, EncodedBatch, decodes_on_device
from ..passes import LoaderIterator, PassState
from ..profiling_ranges import profiling_range

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Ring slots: batch k+1 is being copied while batch k+2 is staged; one spare so staging
# rarely waits for a copy.
RING_SLOTS = 3


def host_stage(dataset: Any, *, records_to: torch.device | None = None) -> tuple[Any, list[Any]]:
    """``dataset`` cut at the end of its host stage, and its device stage as batch steps.

    With ``records_to`` (a device), a JPEG store whose batches can be decoded there
    (``device_decode.decodes_on_device``) is cut before the decode: its host batches are
    EncodedBatches, and the first device step (a DeviceDecode) decodes and crops them.

    The device stage is the float tail of the dataset's transform (a HybridTransform's
    ``device_ops``; for a torchvision pipeline, the ops from the first float-producing
    one on) followed by the dataset's ``batch_transform`` (which runs after the
    transform, so it stays after it). When there is none, ``dataset`` itself is
    returned. Otherwise a dataset of the same store and class whose batch path stops
    at the host stage: it shares the reader (with its options and open handles) and
    the target transform.

    Returns:
        (host dataset, device steps): each step a BatchTransform / batch callable
        ``step(images, generator)``, or a per-sample torchvision op (run sample by sample).
    """
    hybrid = dataset.hybrid
    # a plain callable is one op, kept whole on the host
    host_ops, device_ops = stages(hybrid if hybrid is not None else dataset.transform)
    steps = batch_steps(device_ops)
    if dataset.batch_transform is not None:
        steps.append(_Batched(dataset.batch_transform))
    records = records_to is not None and getattr(dataset, "decode_crop", None) is not None   # checked on the view
    if not steps and not records:
        return dataset, []
    if hybrid is not None:
        host_transform: Any = hybrid.host_only()
    elif host_ops:
        from torchvision.transforms import v2

        host_transform = v2.Compose(host_ops)
    else:
        host_transform = None
    # check="none": the reader below is the dataset's own, already checked as it asked
    view = type(dataset)(dataset.path, transform=host_transform, target_transform=dataset.target_transform,
                         check="none", reduced_decode=dataset.reduced_decode)
    view.reader, view.check = dataset.reader, dataset.check
    if records and decodes_on_device(view):
        view.records_out = True
        steps.insert(0, DeviceDecode(view.reader, view.decode_crop))
    return view, steps


class _Batched:
    """A dataset's ``batch_transform`` as a device step: called on the whole batch."""

    def __init__(self, fn: Any):
        self.fn = fn

    def __call__(self, images: torch.Tensor, generator: Any = None) -> torch.Tensor:
        return self.fn(images, generator)

    def __repr__(self) -> str:
        return repr(self.fn)


def with_dtype(steps: Sequence[Any], dtype: torch.dtype | None) -> list[Any]:
    """``steps`` with a final ``BatchNormalize`` writing ``dtype`` directly (it computes in float32
    and rounds once, so this equals a cast afterwards, without the float32 intermediate)."""
    steps = list(steps)
    last = steps[-1] if steps else None
    if dtype is not None and isinstance(last, BatchNormalize) and last.dtype != dtype:
        steps[-1] = BatchNormalize(last.mean, last.std, dtype=dtype, scale=last.scale)
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
        if self.op.scale and not images.is_floating_point():
            x.mul_(1.0 / torch.iinfo(images.dtype).max)
        x.sub_(self.mean).div_(self.std)
        return x.to(self.op.dtype)

    def __repr__(self) -> str:
        return repr(self.op)


def _random(step: Any) -> bool:
    return not isinstance(step, (BatchNormalize, _Normalize, DeviceDecode))   # DeviceDecode: drawn on the host


def run_steps(steps: Sequence[Any], images: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The device stage on a (B, C, H, W) batch: batch steps once, per-sample ops sample by sample."""
    for step in steps:
        if isinstance(step, (BatchTransform, _Batched, _Normalize)):
            images = step(images, generator)
        else:
            images = torch.stack([step(x) for x in images])
    return images


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


class DeviceLoader:
    """Iterates ``(images, labels)`` on ``device``: the host loader's uint8 batches, moved and finished there.

    What ``dlstore.loader(..., device=...)`` returns. ``len()``, re-iteration per
    epoch and ``sampler.set_epoch`` / ``set_epoch`` behave as on the host loader.

    Args:
        host: the loader of the host stage (a ThreadLoader or DataLoader yielding uint8 batches).
        device: where batches go (any torch device).
        steps: the device stage (see ``host_stage``).
        dtype: the float dtype of the output (None: what the pipeline produces); a result
            that is still uint8 (no float op in the device stage) stays uint8.
        channels_last: return images in ``torch.channels_last`` memory format.
        generator: seeds the random draws of device steps (drawn from only when a device
            step is random; None: torch's default generator).
    """

    def __init__(self, host: Any, device: str | torch.device, steps: Sequence[Any], *,
                 dtype: torch.dtype | None = None, channels_last: bool = False,
                 generator: torch.Generator | None = None, ring: int = RING_SLOTS):
        if dtype is not None and dtype not in DTYPES:
            raise ArgumentError(f"dtype must be one of {', '.join(map(str, DTYPES))} (or None: the "
                                f"pipeline's own), got {dtype!r}")
        if not isinstance(channels_last, bool):
            raise ArgumentTypeError(f"channels_last must be True or False, got {channels_last!r}")
        self.host_loader = host
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.steps = with_dtype(steps, dtype)
        self.dtype = dtype
        self.channels_last = channels_last
        self.generator = generator
        self.ring = ring
        self._state = PassState()

    @property
    def sampler(self) -> Any:
        """The host loader's batch sampler (``loader.sampler.set_epoch(epoch)``)."""
        batch_sampler = getattr(self.host_loader, "batch_sampler", None)   # a ThreadLoader's
        return batch_sampler if batch_sampler is not None else self.host_loader.sampler

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch on the host loader (its seeds and the distributed shuffle)."""
        if hasattr(self.host_loader, "set_epoch"):
            self.host_loader.set_epoch(epoch)
        elif hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.host_loader)

    def _epoch(self) -> int:
        return self.host_loader._epoch()

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands in its epoch (see ``ThreadLoader.state_dict``): the batches it
        handed out, not those the host stage has built ahead."""
        return self._state.state_dict(self.generator, self._epoch())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next pass skips the batches already handed out."""
        self.set_epoch(self._state.load_state_dict(state, len(self)))

    def _generator(self) -> torch.Generator | None:
        if not any(_random(s) for s in self.steps):
            return None                  # the host draws stay exactly those of device=None
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    def __iter__(self) -> Iterator[tuple[torch.Tensor, Any]]:
        return LoaderIterator(self._batches())

    def _batches(self) -> Iterator[tuple[torch.Tensor, Any]]:
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None
        steps = [_Normalize(s, self.device) if isinstance(s, BatchNormalize) else s for s in self.steps]
        decode = steps.pop(0) if steps and isinstance(steps[0], DeviceDecode) else None
        ring = _Ring(self.ring, pin=cuda)
        epoch = self._epoch()
        skip = self._state.begin(self.generator, epoch)
        generator = self._generator()
        # Resumed: the host stage skips the batches handed out, unbuilt, unless the device stage
        # draws randomness of its own, which depends on every batch before: then they go through
        # it again, unseen.
        replay = skip if generator is not None else 0
        if skip - replay:
            self.host_loader._state.skip_next(self.generator, skip - replay, epoch)

        def issue(batch: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any, Any]:
            images, labels = batch
            encoded = images if decode is not None and isinstance(images, EncodedBatch) else None
            j, slot = ring.stage(images) if encoded is None else (None, None)
            del batch, images                             # the host buffer is free for the next batch
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
                    if isinstance(labels, torch.Tensor) and cuda:
                        # pinned (torch's caching host allocator keeps the block until the copy is done):
                        # from pageable memory the copy would first wait for everything on the stream
                        labels = labels.pin_memory().to(self.device, non_blocking=True)
                    elif isinstance(labels, torch.Tensor):
                        labels = labels.to(self.device)
                with profiling_range("dlstore.device_transforms"):
                    x = run_steps(steps, x, generator)
                if self.dtype is not None and x.is_floating_point() and x.dtype != self.dtype:
                    x = x.to(self.dtype)
                if self.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                ready = None
                if cuda:
                    ready = torch.cuda.Event()
                    ready.record(stream)
            return x, labels, ready

        def hand_out(x: torch.Tensor, labels: Any, ready: Any) -> tuple[torch.Tensor, Any]:
            if ready is not None:
                user = torch.cuda.current_stream(self.device)
                user.wait_event(ready)
                x.record_stream(user)    # allocated on the side stream, used on the user's
                if isinstance(labels, torch.Tensor):
                    labels.record_stream(user)
            return x, labels

        batches = iter(self.host_loader)
        for _ in range(replay):
            issue(next(batches))
        first = next(batches, None)
        if first is None:
            self._state.end()
            return
        pending = issue(first)
        del first
        for batch in batches:
            following = issue(batch)     # overlaps the user's step on the batch handed out next
            del batch
            out, pending = pending, following
            self._state.served += 1
            yield hand_out(*out)
            del out
        self._state.served += 1
        yield hand_out(*pending)
        self._state.end()

    def __repr__(self) -> str:
        steps = ", ".join(map(repr, self.steps)) or "none"
        return (f"DeviceLoader(device={self.device}, dtype={self.dtype}, channels_last={self.channels_last}, "
                f"device stage=[{steps}], host={self.host_loader!r})")
