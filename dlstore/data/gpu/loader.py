"""The loader of a :class:`~dlstore.data.gpu.GPUDataset`: batches indexed and augmented on the device.

The transform it takes is what ``open_dataset`` takes (a torchvision pipeline,
a :class:`HybridTransform`) or dlstore batch transforms, or any callable. It
becomes a list of steps (``_plan``), run on each gathered group of batches:

* ops with a batch equivalent (``hybrid.batch_steps``) run per batch, with
  independent parameters per sample; torchvision ops without one run on each
  sample in turn (``_PerSample``);
* ops that move or overwrite pixels (crop, flip, resized crop, cutout) and
  per-sample torchvision ops see what torchvision would see: the uint8 pixels.
  Where the dataset holds its data converted (fp16, maybe normalised) the
  moving ops run on those values with their fill values mapped through the same
  conversion, so that padding is black in pixel space exactly as in
  torchvision; per-sample torchvision ops cannot run there and are refused;
* the dataset's conversion (uint8 -> ``dtype``, normalised) runs after the
  pixel ops where the data are held as uint8 (``dtype=torch.uint8``,
  ``on_overflow="uint8"`` or ``"stream"``), or before the first step that needs
  converted values (a ``BatchNormalize``, a plain callable).

The result is torchvision's per sample followed by the conversion, exactly
(fp16: torchvision's float32 values rounded once), except a resized crop on
data held converted: it resamples the converted values rather than uint8
pixels, within 1.05 / (255 * std) + 2**-10 * |value| of torchvision's
(tests/fidelity holds every path to this).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import queue
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ...errors import ArgumentError, TransformSpecError
from ...transforms.batch import (
    BatchCompose,
    BatchCutout,
    BatchNormalize,
    BatchRandomCrop,
    BatchRandomHorizontalFlip,
    BatchRandomResizedCrop,
    BatchTransform,
)
from ...transforms.hybrid import (
    HybridTransform,
    _flatten,
    batch_steps,
    strip_static_prefix,
)
from ..passes import STATE_VERSION, LoaderIterator
from .fused import FusedGather, unpadded_crop
from .partition import epoch_order, per_rank

if TYPE_CHECKING:
    from .dataset import GPUDataset

# Served bytes per group of batches that the loader gathers and augments in one go.
GROUP_BYTES = 64 << 20


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


# Batch transforms that move or overwrite pixels: in torchvision they run on uint8 samples.
_PIXEL_OPS = (BatchRandomCrop, BatchRandomHorizontalFlip, BatchRandomResizedCrop, BatchCutout)


def _is_torchvision(t: Any) -> bool:
    return type(t).__module__.startswith("torchvision.")


class _PerSample:
    """A torchvision op without a batch equivalent, run on each sample of a batch in turn.

    It draws from torch's global generators, as torchvision does; ``sample`` draws
    one seed for them from the loader's generator, and ``apply`` runs the op on
    every sample with the global generators so seeded (restoring them after):
    draws reproducible from the loader's seed, independent per sample.
    """

    def __init__(self, op: Any):
        self.op = op

    def sample(self, shape: Any, *, generator: torch.Generator | None = None,
               device: Any = "cpu") -> dict[str, torch.Tensor]:
        return {"seed": torch.randint(0, 2**62, (), generator=generator, device=device)}

    def apply(self, images: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        seed = int(params["seed"])
        device = images.device
        cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.default_generator.manual_seed(seed)
            if cuda:
                torch.cuda.default_generators[cuda[0]].manual_seed(seed)
            out = [self.op(x) for x in images]
        shapes = sorted({tuple(x.shape) for x in out})
        if len(shapes) > 1:
            raise TransformSpecError(f"{self.op!r} gave samples of different shapes {shapes[:4]}; the GPU loader "
                                     f"stacks every batch into one tensor")
        return torch.stack(out)

    def __call__(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.apply(images, self.sample(images.shape, generator=generator, device=images.device))

    def __repr__(self) -> str:
        return f"_PerSample({self.op!r})"


def _per_sample(step: Any) -> bool:
    """Whether ``step`` draws independent randomness per sample (dlstore batch transforms and
    per-sample loops do), so that running it on several batches at once changes nothing but
    the random stream."""
    if isinstance(step, BatchCompose):
        return all(_per_sample(t) for t in step.transforms)
    return isinstance(step, (BatchTransform, _PerSample))


def _accepts_generator(transform: Callable[..., Any]) -> bool:
    """Whether ``transform`` declares a parameter named ``generator`` that can be passed by keyword
    (``**kwargs`` does not count: torch modules forward them to ``forward``, which refuses it)."""
    try:
        params = inspect.signature(transform).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    p = params.get("generator")
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def _atoms(transform: Any) -> list[Any]:
    """``transform`` as a flat list of ops: torchvision ops, batch transforms, other callables."""
    if transform is None:
        return []
    if isinstance(transform, HybridTransform):
        return list(transform.dynamic_ops)
    if isinstance(transform, BatchCompose):
        return [a for t in transform.transforms for a in _atoms(t)]
    if isinstance(transform, (list, tuple)):
        return [a for t in transform for a in _atoms(t)]
    if _is_torchvision(transform):
        return _flatten(transform)
    if isinstance(transform, torch.nn.Sequential):
        return [a for t in transform for a in _atoms(t)]
    if not callable(transform):
        raise TransformSpecError(f"the GPU loader's transform must be callable (a torchvision transform or "
                                 f"pipeline, a HybridTransform, a dlstore batch transform or a function), got "
                                 f"{type(transform).__name__} {transform!r}")
    return [transform]


def _steps(transform: Any) -> list[Any]:
    """The ops of ``transform`` in order, torchvision ops replaced by their batch equivalents."""
    atoms = _atoms(transform)
    steps: list[Any] = []
    run: list[Any] = []    # consecutive torchvision ops: mapped together (ToDtype + Normalize merge)
    for a in atoms + [None]:
        if a is not None and _is_torchvision(a):
            run.append(a)
            continue
        steps += batch_steps(run)
        run = []
        if a is not None:
            steps.append(a)
    return steps


def _served_fill(op: BatchTransform, ds: GPUDataset) -> BatchTransform:
    """``op`` with its fill values mapped from pixel values to the dataset's served values."""
    from torchvision.transforms.v2 import functional as F

    c = ds.shape[0]
    fill = list(op.fill) if isinstance(op.fill, tuple) else op.fill   # type: ignore[attr-defined]
    if isinstance(op, BatchRandomCrop):
        if op.padding_mode != "constant":
            return op
        # the value torchvision pads a uint8 image with
        pixel = F.pad(torch.zeros((c, 1, 1), dtype=torch.uint8), [1, 0, 0, 0], fill=fill)[:, 0, 0]
    else:
        # the value F.erase / masked_fill write into a uint8 image
        pixel = torch.tensor(fill).to(torch.uint8).expand(c).clone()
    served = ds._finish(pixel.view(1, c, 1, 1).to(ds.device)).view(c).tolist()
    mapped = copy.copy(op)
    mapped.fill = tuple(served)  # type: ignore[attr-defined]
    return mapped


def _against_store(transform: Any, ds: GPUDataset) -> tuple[Any, list[Any]]:
    """``transform`` checked against the static spec of ``ds``'s store, as ``open_dataset`` checks it:
    (what runs, the leading ops of a whole pipeline that the store already applied)."""
    manifest = getattr(ds.source, "manifest", None)   # None: a dataset that is not a store
    if manifest is None:
        return transform, []
    where = getattr(ds.source, "path", None) or "the GPUDataset's store"
    skipped: list[Any] = []
    planned = strip_static_prefix(transform, manifest.get("static") or [], where=where)
    if planned is not None:
        transform, skipped = planned
    if isinstance(transform, HybridTransform):
        from ..dataset import _check_static

        _check_static(where, manifest, transform)
    return transform, skipped


def _plan(transform: Any, ds: GPUDataset) -> list[tuple[Callable[..., torch.Tensor], bool]]:
    """The steps a gathered group goes through: (callable, whether it takes ``generator=``).

    Includes the dataset's conversion (uint8 -> its dtype, normalised) at its place.
    """
    steps = _steps(transform)
    converts = ds.dtype != torch.uint8
    converted = converts and ds.mode == "preload"  # the data are held converted
    as_given = False   # an earlier step's output (not pixels) is what the following steps see
    plan: list[tuple[Callable[..., torch.Tensor], bool]] = []
    for op in steps:
        if isinstance(op, _PIXEL_OPS):
            if converted and not as_given and isinstance(op, (BatchRandomCrop, BatchCutout)):
                op = _served_fill(op, ds)
            plan.append((op, True))
        elif _is_torchvision(op):
            if converted and not as_given:
                raise TransformSpecError(
                    f"{type(op).__name__} has no batch equivalent, so it runs per sample on the pixels torchvision "
                    f"would give it, uint8; but this GPUDataset holds its data converted to "
                    f"{str(ds.dtype).removeprefix('torch.')}. Create it with dtype=torch.uint8 (and put "
                    f"v2.ToDtype / v2.Normalize at the end of the transform: they run per batch), or leave "
                    f"{type(op).__name__} out")
            plan.append((_PerSample(op), True))
        else:
            if isinstance(op, BatchNormalize) and op.mean is not None and ds.normalize is not None:
                raise TransformSpecError(
                    f"the transform normalises ({op!r}) but the GPUDataset already does (normalize="
                    f"{ds.normalize!r}): leave Normalize out of the transform, or create the GPUDataset "
                    f"without normalize= (dtype=torch.uint8 runs the whole pipeline per batch)")
            if converts and not converted:
                plan.append((ds._finish, False))
                converted = True
            plan.append((op, _accepts_generator(op)))
            as_given = True
    if converts and not converted:
        plan.append((ds._finish, False))
    return plan


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
    (see the module docstring): the same transforms ``open_dataset`` takes, with
    the same result as torchvision per sample followed by the dataset's
    conversion (``ToDtype(dtype, scale=True)`` and ``Normalize``); then
    optionally channels_last. A torchvision pipeline or :class:`HybridTransform`
    runs its ops with a batch equivalent per batch (independent parameters per
    sample) and the others on each sample in turn; dlstore batch transforms run
    as given; any other callable gets the converted batch, with
    ``generator=`` only if it declares a parameter of that name. When every step
    draws per sample (or there is no transform), the steps run on groups of
    ``group_batches`` batches (about 64 MiB of output) and the batches are
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
        dataset: GPUDataset,
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
        runs, self.already_applied = _against_store(transform, dataset)
        plan = _plan(runs, dataset)
        self._plan = plan
        self.channels_last = channels_last
        # The resident tensor the unfused path gathers from: the padded copy when the first
        # step is a crop with the dataset's padding (it then pads nothing), else the samples.
        self._held = dataset._samples()
        if self._plan and type(self._plan[0][0]) is BatchRandomCrop and dataset.padding != (0, 0, 0, 0):
            crop = unpadded_crop(self._plan[0][0], dataset)
            if crop is not self._plan[0][0]:
                self._plan = [(crop, True)] + self._plan[1:]
                self._held = dataset.data
        self._fused: FusedGather | None = None
        self.fused_reason = "fused=False"
        if fused is None and not (compile and dataset.device.type == "cuda"):
            # The eager fused gather (one element-wise index kernel) is slower than the
            # step-by-step path, whose crop copies whole windows; compiled, on CUDA, it
            # matches it (benchmarks/gpu_residency.py; figures in docs/gpu.md).
            self.fused_reason = "fused=None fuses only with compile=True on CUDA (eager, the unfused path is faster)"
        elif fused is not False:
            built = FusedGather.build(dataset, plan, channels_last=channels_last,
                                      compile=compile)
            if isinstance(built, str):
                if fused:
                    raise ArgumentError(f"fused=True, but this transform cannot run as one gather: {built}; "
                                        f"pass fused=None (fuse where it applies) or fused=False")
                self.fused_reason = built
            else:
                self._fused = built
                self.fused_reason = ""
        # by default the dataset's rank and world size (its share, when sharded)
        rank = dataset.rank if rank is None else rank
        world_size = dataset.world_size if world_size is None else world_size
        self.rank, self.world_size = _resolve_distributed(rank, world_size)
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
        if ds.mode == "stream" or not all(_per_sample(fn) or fn == ds._finish for fn, _ in self._plan):
            return 1
        itemsize = torch.empty((), dtype=ds.dtype).element_size()
        sample = int(np.prod(ds.shape)) * itemsize
        return max(1, GROUP_BYTES // (sample * self.batch_size))

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
            if self._fused is not None:
                images = self._fused(idx, self._aug_gen)
            else:
                images = self._augment(self._held.index_select(0, idx))
            labels = ds.labels.index_select(0, idx)
            for s in range(0, len(idx), self.batch_size):
                yield images[s:s + self.batch_size], labels[s:s + self.batch_size]

    def _aug_seed(self, epoch: int) -> int:
        """Seed of the augmentation generator in ``epoch``: differs per epoch and per rank, yet is reproducible."""
        return (self.seed * 1_000_003 + epoch * 7_919 + self.rank) % (2**63)

    def _augment(self, images: torch.Tensor) -> torch.Tensor:
        """A gathered group as held (uint8, or converted in preload mode) -> served and augmented."""
        for fn, takes_generator in self._plan:
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
            return ds._read_into(host_order[start:stop], ds._host_buffer(stop - start))

        prefetcher = _Prefetcher(batches, read, depth=self.prefetch)
        try:
            for (start, stop), host in zip(batches, prefetcher):
                images = host.to(ds.device, non_blocking=ds._pin)
                labels = ds.labels.index_select(0, order[start:stop])
                yield self._augment(images), labels
        finally:
            prefetcher.close()
