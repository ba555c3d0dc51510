"""One map-style Dataset for every store format.

``open_dataset(path)`` detects the format, validates the manifest (cheap checks
only) and returns a :class:`StoreDataset` yielding ``(uint8 CHW tensor, int
label)``, like ``ImageFolder`` followed by the store's static transforms and
``PILToTensor``. Data handles open lazily in each process that reads (after a
DataLoader worker starts), never before a fork.

The batch path: ``loader(dataset, batch_size, ...)`` hands whole index lists
to ``StoreDataset.get_batch``, which assembles the batch in one copy from the
reader's per-sample views (applying a random crop and flip inside that copy
when the dynamic part starts with them), runs per-sample ops only where an op
has no batch equivalent, then the batch transforms once per batch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler, get_worker_info
from torch.utils.data.distributed import DistributedSampler

from . import formats
from .codecs import DecodingReader
from .errors import StaticMismatchError, StoreCorruptError, TransformSpecError
from .transforms import (
    BatchRandomCrop,
    BatchRandomHorizontalFlip,
    HybridTransform,
    _flatten,
    batch_plan,
    describe,
    parse_static,
)

# Below this many pixels per sample numpy's strided copy flips faster than a torch flip
# (per-call overhead dominates); above it torch's vectorised flip wins (measured, 2-core CPU).
_TORCH_FLIP_MIN_PIXELS = 4096
# Up to this many output pixels per sample the fused crop/flip runs vectorised (three passes,
# no per-sample Python); above it a per-sample loop of single slice copies is faster.
_VECTORISED_MAX_PIXELS = 64 * 64
# Batch buffers of at least this size are recycled in the main process (see _new_batch).
_POOL_MIN_BYTES = 4 << 20
_POOL_SIZE = 4


class StoreDataset(Dataset):
    """Map-style dataset over a dlstore store.

    Attributes:
        classes: class names in label order (empty for an unlabelled store).
        class_to_idx: name -> label.
        targets: the label of every sample (list of int), as ``ImageFolder.targets``.
        manifest: the store's manifest (dict).
        shape: (C, H, W) of every sample, or None for a variable-shape store.

    Samples of fixed-shape shards stores are zero-copy views of a private
    copy-on-write memory map: nothing is read until the tensor is used, and an
    in-place change never reaches the file (but does persist in that process, so
    a transform that works in place should ``clone()`` first).

    ``transform`` may be a :class:`HybridTransform`: the store's static spec must
    then equal the hybrid's static part, and only its dynamic part runs. Through
    ``get_batch`` (what ``dlstore.loader`` calls) the trailing ops of the dynamic
    part that have a batch equivalent run once per batch (``batch_ops``); the
    rest run per sample (``per_sample_ops``). ``batch_transform`` runs after them.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        transform: Callable[[torch.Tensor], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        *,
        batch_transform: Callable[..., torch.Tensor] | None = None,
        reader_options: dict[str, Any] | None = None,
    ):
        self.path = Path(path)
        self.format = formats.detect_format(self.path)
        module = formats.get_format(self.format)
        try:
            self.reader = module.Reader(self.path, **(reader_options or {}))
        except TypeError as exc:
            if not reader_options:
                raise
            raise ValueError(f"{self.path}: reader_options {sorted(reader_options)} do not apply to "
                             f"{self.format} stores ({exc}); lmdb takes readahead=, hdf5 takes "
                             "chunk_cache_bytes=") from None
        self.manifest: dict[str, Any] = self.reader.manifest
        if self.manifest["sample"]["encoding"] != "raw":  # JPEG/PNG records, decoded with PIL on read
            self.reader = DecodingReader(self.reader)
        self.classes: list[str] = list(self.manifest["classes"])
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        labels = np.asarray(self.reader.labels, dtype=np.int64)
        n_classes = len(self.classes)
        valid = (labels >= 0) & (labels < n_classes) if n_classes else labels == -1
        if not valid.all():
            bad = int(np.argmin(valid))
            raise StoreCorruptError(
                f"{self.path}: label {int(labels[bad])} of sample {bad} is out of range for "
                f"{n_classes} classes")
        self._labels = labels
        self.targets: list[int] = labels.tolist()
        sample = self.manifest["sample"]
        shape = sample["shape"] if sample["encoding"] == "raw" else sample.get("decoded_shape")
        self.shape: tuple[int, int, int] | None = tuple(shape) if shape is not None else None
        self.hybrid: HybridTransform | None = None
        if isinstance(transform, HybridTransform):
            _check_static(self.path, self.manifest, transform)
            self.hybrid = transform
            ops = transform.dynamic_ops
            transform = transform.dynamic
        elif transform is not None and type(transform).__module__.startswith("torchvision."):
            ops = _flatten(transform)
        else:
            ops = [] if transform is None else [transform]
        self.transform = transform
        self.target_transform = target_transform
        self.batch_transform = batch_transform
        self.per_sample_ops, self.batch_ops = batch_plan(ops, fixed_shape=self.shape is not None)
        if batch_transform is not None:
            self.batch_ops.append(batch_transform)
        # Leading crop (constant padding) and flip run inside the copy that assembles the batch.
        self._fused_crop: BatchRandomCrop | None = None
        self._fused_flip: BatchRandomHorizontalFlip | None = None
        rest = list(self.batch_ops)
        if self.shape is not None and not self.per_sample_ops:
            if rest and isinstance(rest[0], BatchRandomCrop) and rest[0].padding_mode == "constant" \
                    and isinstance(rest[0].fill, int) and 0 <= rest[0].fill <= 255:
                self._fused_crop = rest.pop(0)
            if rest and isinstance(rest[0], BatchRandomHorizontalFlip):
                self._fused_flip = rest.pop(0)
        self._batch_rest = rest
        self._scratch: tuple[tuple, np.ndarray] | None = None   # padded buffer of the vectorised gather
        self._pool: list[np.ndarray] = []                          # batch buffers, see _new_batch

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_scratch"] = None    # scratch memory is per process, never pickled to workers
        state["_pool"] = []
        return state

    def __len__(self) -> int:
        return len(self._labels)

    def _index(self, i: int) -> int:
        n = len(self._labels)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for a store of {n} samples")
        return i

    def _indices(self, indices: Sequence[int]) -> np.ndarray:
        """``_index`` for a whole batch, vectorised: int64 array, negatives wrapped, range-checked."""
        n = len(self._labels)
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        idx = np.where(idx < 0, idx + n, idx)
        bad = (idx < 0) | (idx >= n)
        if bad.any():
            raise IndexError(f"index {int(np.asarray(indices).reshape(-1)[np.argmax(bad)])} out of range "
                             f"for a store of {n} samples")
        return idx

    def get_image(self, i: int) -> torch.Tensor:
        """Sample ``i`` as stored: uint8 (C, H, W), before any transform."""
        return torch.from_numpy(self.reader.get(self._index(i)))

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        i = self._index(i)
        image: Any = torch.from_numpy(self.reader.get(i))
        label: Any = int(self._labels[i])
        if self.transform is not None:
            image = self.transform(image)
        if self.batch_transform is not None:
            image = self.batch_transform(image[None])[0]
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    def read_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor | list[torch.Tensor], torch.Tensor]:
        """Samples ``indices`` before transforms: a (B, C, H, W) uint8 tensor for a
        fixed-shape store (one gather, no per-sample tensors), else a list of
        (C, H, W) tensors; and the int64 labels."""
        idx = self._indices(indices)
        labels = torch.from_numpy(self._labels[idx])
        if self.shape is not None and hasattr(self.reader, "get_batch"):
            return torch.from_numpy(self.reader.get_batch(idx)), labels
        return [torch.from_numpy(self.reader.get(int(i))) for i in idx], labels

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, Any]]:
        """Batched read used by DataLoader (torch >= 2.1 calls it with the whole batch).

        Fixed-shape shards samples come back as views of the memory map, so the
        DataLoader's ``default_collate`` (``torch.stack``) is the one and only copy.
        """
        if self.batch_transform is not None:
            batch, labels_t = self.get_batch(indices)
            labels_out = labels_t.tolist() if isinstance(labels_t, torch.Tensor) else list(labels_t)
            return list(zip(batch.unbind(0), labels_out))
        idx = self._indices(indices).tolist()
        images = [torch.from_numpy(a) for a in self.reader.get_many(idx)]
        labels = self._labels[idx].tolist()
        if self.transform is None and self.target_transform is None:
            return list(zip(images, labels))
        out = []
        for image, label in zip(images, labels):
            if self.transform is not None:
                image = self.transform(image)
            if self.target_transform is not None:
                label = self.target_transform(label)
            out.append((image, label))
        return out

    def get_batch(self, indices: Sequence[int], generator: torch.Generator | None = None
                  ) -> tuple[torch.Tensor, Any]:
        """Samples ``indices`` with the dynamic transforms applied, as one batch.

        The batch is assembled in one copy from the reader's per-sample views;
        a leading random crop (constant padding) and horizontal flip are applied
        inside that copy. Per-sample ops (those without a batch equivalent) run
        next, then the batch ops, once.

        Args:
            indices: sample indices.
            generator: CPU generator for the random parameters; None uses torch's
                default one (seeded per worker by the DataLoader).

        Returns:
            (images, labels): a (B, C, H, W) tensor and an int64 (B,) tensor (a list
            if ``target_transform`` returns non-numbers).
        """
        idx = self._indices(indices)
        if self.shape is not None and not self.per_sample_ops:
            images = self._gather(idx, generator)
        else:
            samples = [torch.from_numpy(a) for a in self.reader.get_many(idx.tolist())]
            for op in self.per_sample_ops:
                samples = [op(x) for x in samples]
            images = _stack(samples, self.path)
        for op in self._batch_rest:
            images = op(images, generator)
        labels: Any = torch.from_numpy(self._labels[idx])
        if self.target_transform is not None:
            out = [self.target_transform(int(v)) for v in labels]
            labels = torch.as_tensor(out) if all(isinstance(v, (int, float)) for v in out) else out
        return images, labels

    def _gather(self, idx: np.ndarray, generator: torch.Generator | None) -> torch.Tensor:
        """One copy from the store into a new (B, C, H, W) batch, with the fused crop/flip."""
        crop, flip = self._fused_crop, self._fused_flip
        if crop is None and flip is None:
            if hasattr(self.reader, "get_batch"):
                out = self._new_batch((len(idx), *self.shape))  # type: ignore[misc]
                self.reader.get_batch(idx, out=out.numpy())
                return out
            return _stack([torch.from_numpy(a) for a in self.reader.get_many(idx.tolist())], self.path)
        b = len(idx)
        c, h, w = self.shape  # type: ignore[misc]
        # Draw in the order BatchCompose([crop, flip]) draws, so fused == unfused for one seed.
        th, tw = crop.size if crop is not None else (h, w)
        padding = crop.padding if crop is not None else (0, 0, 0, 0)
        fill = crop.fill if crop is not None else 0
        if crop is not None:
            params = crop.sample((b, c, h, w), generator=generator)
            tops, lefts = params["top"].numpy(), params["left"].numpy()
        else:
            tops = lefts = np.zeros(b, dtype=np.int64)
        flips = flip.sample((b, c, th, tw), generator=generator)["flip"].numpy() if flip is not None \
            else np.zeros(b, dtype=bool)
        if th * tw <= _VECTORISED_MAX_PIXELS and hasattr(self.reader, "get_batch"):
            return self._gather_windows(idx, tops, lefts, flips, (th, tw), padding, fill)
        return self._gather_loop(idx, tops, lefts, flips, (th, tw), padding, fill)

    def _new_batch(self, shape: tuple[int, ...]) -> torch.Tensor:
        """An uninitialised uint8 tensor for a batch.

        In a DataLoader worker it lives in shared memory (allocated as torch's
        default_collate allocates it), so handing it to the main process copies
        nothing. In the main process it reuses a buffer that no tensor refers to
        any more: a fresh allocation of a large batch (over glibc's 32 MiB mmap
        limit, e.g. 256x3x224x224) is page-faulted and zeroed by the kernel on
        first touch, which costs more than the copy itself (measured 5-10x).
        """
        if get_worker_info() is not None:
            elem = torch.empty(0, dtype=torch.uint8)
            storage = elem._typed_storage()._new_shared(int(np.prod(shape)), device="cpu")
            return elem.new(storage).resize_(*shape)
        nbytes = int(np.prod(shape))
        if nbytes < _POOL_MIN_BYTES:
            return torch.empty(shape, dtype=torch.uint8)
        pool = self._pool
        for k in range(len(pool)):
            # references: the list and getrefcount's argument. Any more: a batch tensor (or a
            # view of one) handed out earlier still uses this memory.
            if pool[k].nbytes == nbytes and sys.getrefcount(pool[k]) <= 2:
                buf = pool.pop(k)
                pool.append(buf)                             # most recently used last
                return torch.from_numpy(buf.reshape(shape))
        if len(pool) >= _POOL_SIZE:
            pool.pop(0)                                      # forget the oldest; its user keeps it
        buf = np.empty(nbytes, dtype=np.uint8)
        pool.append(buf)
        return torch.from_numpy(buf.reshape(shape))

    def _gather_loop(self, idx: np.ndarray, tops: np.ndarray, lefts: np.ndarray, flips: np.ndarray,
                     size: tuple[int, int], padding: tuple[int, int, int, int], fill: int) -> torch.Tensor:
        """Per sample, one slice copy from the reader's view into the batch (large images:
        the copy dominates the Python overhead)."""
        b = len(idx)
        c, h, w = self.shape  # type: ignore[misc]
        th, tw = size
        out = self._new_batch((b, c, th, tw))
        o = out.numpy()
        torch_flip = th * tw >= _TORCH_FLIP_MIN_PIXELS
        # Window of every sample in image coordinates, its part inside the image (s*) and where
        # that part lands in the output (d*), computed for the whole batch at once.
        y = tops.astype(np.int64) - padding[1]
        x = lefts.astype(np.int64) - padding[0]
        sy0, sy1 = np.maximum(y, 0), np.minimum(y + th, h)
        sx0, sx1 = np.maximum(x, 0), np.minimum(x + tw, w)
        dy0, dy1, dx0, dx1 = sy0 - y, sy1 - y, sx0 - x, sx1 - x
        # a flipped sample is read from its flipped image, where the window is mirrored
        fsx0, fsx1 = np.where(flips, w - sx1, sx0), np.where(flips, w - sx0, sx1)
        fdx0, fdx1 = np.where(flips, tw - dx1, dx0), np.where(flips, tw - dx0, dx1)
        empty = (sy1 <= sy0) | (sx1 <= sx0)                          # window wholly in the padding
        rows = zip(sy0.tolist(), sy1.tolist(), fsx0.tolist(), fsx1.tolist(), dy0.tolist(), dy1.tolist(),
                   fdx0.tolist(), fdx1.tolist(), flips.tolist(), empty.tolist())
        for j, (view, r) in enumerate(zip(self.reader.get_many(idx.tolist()), rows)):
            a0, a1, b0, b1, e0, e1, f0, f1, flipped, nothing = r
            oj = o[j]
            if nothing:
                oj[...] = fill
                continue
            # padding: fill only the strips the image does not cover
            if e0:
                oj[:, :e0] = fill
            if e1 < th:
                oj[:, e1:] = fill
            if f0:
                oj[:, e0:e1, :f0] = fill
            if f1 < tw:
                oj[:, e0:e1, f1:] = fill
            view = np.asarray(view)   # a plain ndarray: slicing a np.memmap runs Python code
            if flipped:
                # torch flips a whole contiguous sample ~2x faster than a strided window (measured)
                if torch_flip and view.flags.writeable and view.flags.c_contiguous:
                    view = torch.from_numpy(view).flip(-1).numpy()
                else:
                    view = view[..., ::-1]
            oj[:, e0:e1, f0:f1] = view[:, a0:a1, b0:b1]
        return out

    def _gather_windows(self, idx: np.ndarray, tops: np.ndarray, lefts: np.ndarray, flips: np.ndarray,
                        size: tuple[int, int], padding: tuple[int, int, int, int], fill: int) -> torch.Tensor:
        """Vectorised (small images: no per-sample Python). The samples are gathered into a
        padded scratch buffer, flipped ones flipped on the way; then one fancy index over a
        strided view of every crop window copies each sample's window into the batch."""
        b = len(idx)
        c, h, w = self.shape  # type: ignore[misc]
        th, tw = size
        left, top, right, bottom = padding
        ph, pw = h + top + bottom, w + left + right
        key = (c, ph, pw, fill)
        scratch = self._scratch
        if scratch is None or scratch[0] != key or len(scratch[1]) < b:
            scratch = (key, np.full((b, c, ph, pw), fill, dtype=np.uint8))   # border stays `fill`
            self._scratch = scratch
        buf = scratch[1]
        # flipped samples go to the end of the buffer; pos[j] is where sample j went
        order = np.argsort(flips, kind="stable")
        n_plain = b - int(flips.sum())
        pos = np.empty(b, dtype=np.int64)
        pos[order] = np.arange(b)
        # torch's copy_ into the strided interior is ~2x numpy's for short rows (measured)
        interior = torch.from_numpy(buf)[:, :, top:top + h, left:left + w]
        if n_plain:
            interior[:n_plain].copy_(torch.from_numpy(self.reader.get_batch(idx[order[:n_plain]])))
        if n_plain < b:
            interior[n_plain:b].copy_(torch.from_numpy(self.reader.get_batch(idx[order[n_plain:]])).flip(-1))
        # a flipped sample's window, read from its flipped image, starts at pw - tw - left
        x = np.where(flips, pw - tw - lefts, lefts)
        sb, sc, sh, sw = buf.strides
        windows = np.lib.stride_tricks.as_strided(
            buf, shape=(len(buf), ph - th + 1, pw - tw + 1, c, th, tw), strides=(sb, sh, sw, sc, sh, sw),
            writeable=False)
        return torch.from_numpy(windows[pos, tops, x])

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.shape)) if self.shape else "variable"
        return (f"StoreDataset({str(self.path)!r}, format={self.format}, samples={len(self)}, "
                f"classes={len(self.classes)}, shape={shape})")


def open_dataset(
    path: str | os.PathLike,
    transform: Callable[[torch.Tensor], Any] | None = None,
    target_transform: Callable[[int], Any] | None = None,
    *,
    batch_transform: Callable[..., torch.Tensor] | None = None,
    reader_options: dict[str, Any] | None = None,
) -> StoreDataset:
    """Open a store written by ``dlstore convert`` as a map-style Dataset.

    Args:
        path: a ``.shards`` folder, an ``.lmdb`` folder or an ``.h5`` file.
        transform: dynamic transform applied to each uint8 CHW tensor at read time,
            or a :class:`HybridTransform` (its static part must match the store's;
            its dynamic part runs, per batch where possible through ``dlstore.loader``).
        target_transform: applied to each int label.
        batch_transform: ``t(images, generator=None)`` run once per (B, C, H, W)
            batch by ``get_batch`` / ``dlstore.loader``, after ``transform``.
        reader_options: passed to the format's Reader: ``{"readahead": False}`` for
            LMDB (default: on when the store is under half the RAM),
            ``{"chunk_cache_bytes": N}`` for HDF5.

    Raises:
        FileNotFoundError: nothing at ``path``.
        UnknownFormatError: ``path`` is not a store.
        StoreCorruptError: the manifest is missing, damaged, too new, or disagrees with the data.
        StaticMismatchError: ``transform`` is a hybrid whose static part differs from the store's.
    """
    return StoreDataset(path, transform=transform, target_transform=target_transform,
                        batch_transform=batch_transform, reader_options=reader_options)


def _check_static(path: Path, manifest: dict[str, Any], hybrid: HybridTransform) -> None:
    stored = parse_static(manifest.get("static") or [])
    wanted = hybrid.static_spec
    if stored == wanted:
        return
    detail = ""
    if describe(stored) == describe(wanted):  # differ in a field describe() leaves out
        detail = f"\n  store:     {stored}\n  transform: {wanted}"
    raise StaticMismatchError(
        f"{path}: the store was converted with static transforms {describe(stored)!r}, but the hybrid "
        f"transform's static part is {describe(wanted)!r}{detail}. Training on it would not see the data "
        f"the pipeline describes. Convert again with dlstore.convert(src, {str(path)!r}, static=hybrid, "
        f"overwrite=True), or open it with a hybrid whose static part is {describe(stored)!r}.")


def _stack(samples: list[torch.Tensor], path: Path) -> torch.Tensor:
    shapes = {tuple(x.shape) for x in samples}
    if len(shapes) > 1:
        raise TransformSpecError(
            f"{path}: cannot batch samples of different shapes {sorted(shapes)[:4]}; give the dynamic "
            f"part an op that fixes the size (RandomResizedCrop, RandomCrop, Resize to HxW), or convert "
            f"with a size-fixing static op (center_crop=...)")
    return torch.stack(samples)


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
    dataset: StoreDataset,
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
) -> DataLoader:
    """A DataLoader that reads whole batches: one ``get_batch`` call per batch.

    A ``BatchSampler`` yields index lists; each worker assembles a batch in one
    copy, runs the batch transforms once on it and returns ``(images, labels)``
    tensors; no per-sample collate. Random parameters come from ``generator``
    with ``num_workers=0``, and in workers from torch's default generator, which
    the DataLoader seeds per worker from ``generator`` (or from the global seed):
    ``generator`` (or ``torch.manual_seed``) makes epochs reproducible.

    Args:
        dataset: a StoreDataset (``open_dataset``).
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
        seed: the distributed shuffle's seed; must be the same on every rank.
    """
    if not isinstance(dataset, StoreDataset):
        raise TypeError(f"dlstore.loader takes a StoreDataset (dlstore.open_dataset(path)), got "
                        f"{type(dataset).__name__}; for other datasets use torch.utils.data.DataLoader")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if distributed:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("loader(distributed=True) needs an initialised torch.distributed process group "
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
