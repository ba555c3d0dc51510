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
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from .. import formats
from ..errors import ArgumentTypeError, StoreCorruptError, TransformSpecError, UsageError, WrongFormatError
from ..sources.origins import OriginPairs
from ..transforms import compiled
from ..transforms.batch import BatchRandomCrop, BatchRandomHorizontalFlip
from ..transforms.functional import VECTORISED_MAX_PIXELS, crop_flip_loop, crop_flip_windows
from ..transforms.hybrid import HybridTransform
from ..transforms.planner import plan
from ..transforms.static import describe
from .decode_crop import decode_crop_batch, split_decode_crop
from .device_decode import draw_encoded
from .indices import sample_index, sample_indices
from .profiling_ranges import profiling_range
from .store_reader import check_mode, open_reader

# Batch buffers of at least this size are recycled in the main process (see _new_batch).
_POOL_MIN_BYTES = 4 << 20
_POOL_SIZE = 4
_FORMAT_CLASSES: dict[str, str] = {}   # format -> the name of its class (ShardsDataset, ...), see stores.py


class StoreDataset(Dataset):
    """Map-style dataset over a dlstore store of any format.

    Reading methods: ``read(i)`` / ``read_batch(indices)`` give samples as
    stored (no transform); ``ds[i]`` / ``get_batch(indices)`` apply the dynamic
    transforms. ``ShardsDataset``, ``LMDBDataset`` and ``HDF5Dataset`` are this
    class bound to one format.

    Attributes:
        classes: class names in label order (empty for an unlabelled store).
        class_to_idx: name -> label.
        targets: the label of every sample (list of int), as ``ImageFolder.targets``; for a
            store of target vectors, the (N, K) int64 or float32 numpy array of them (``ds[i]``
            then gives a (K,) tensor as the target, ``get_batch`` a (B, K) tensor).
        manifest: the store's manifest (dict).
        shape: (C, H, W) of every sample, or None for a variable-shape store.
        already_applied: the leading ops of a whole pipeline given as ``transform`` that the
            store's static spec stands for, so they do not run (empty when none).
        decode_crop: on a JPEG/PNG store, the leading RandomResizedCrop that ``get_batch`` runs as
            each record decodes (``decode_crop``; ``reduced_decode=True``: at a DCT scale), or None.
        batch_rest: the batch ops ``get_batch`` runs after the read, past those it runs inside it
            (a leading crop and flip, or the flip after ``decode_crop``); ``batch_transform`` last.

    Samples of fixed-shape shards stores are zero-copy views of a private
    copy-on-write memory map: nothing is read until the tensor is used, and an
    in-place change never reaches the file (but does persist in that process, so
    a transform that works in place should ``clone()`` first).

    ``transform`` may be a :class:`HybridTransform`: the store's static spec must
    then equal the hybrid's static part, and only its dynamic part runs. A whole
    torchvision pipeline that begins with the store's static ops does not run them
    again (``strip_static_prefix``): ``already_applied`` lists the ops skipped,
    ``hybrid`` the plan (the store's static part, the rest as its dynamic part) and
    ``repr`` both; one that begins with only some of them, or with one under other
    settings (a bicubic Resize on a bilinear store), raises StaticMismatchError. Through
    ``get_batch`` (what ``dlstore.loader`` calls) the trailing ops of the dynamic
    part that have a batch equivalent run once per batch (``batch_ops``); the
    rest run per sample (``per_sample_ops``). ``batch_transform`` runs after them.
    """

    FORMAT: str | None = None   # set by the format-specific subclasses
    records_out = False         # get_batch hands out records and drawn boxes (device_decode.py), not pixels

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("FORMAT") is not None:   # a format's own class: named in WrongFormatError
            _FORMAT_CLASSES.setdefault(cls.FORMAT, cls.__name__)

    def __init__(
        self,
        path: str | os.PathLike,
        transform: Callable[[torch.Tensor], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        *,
        batch_transform: Callable[..., torch.Tensor] | None = None,
        reader_options: dict[str, Any] | None = None,
        check: str = "none",
        reduced_decode: bool = False,
    ):
        self.check = check_mode(check)
        self.reduced_decode = bool(reduced_decode)
        if not isinstance(path, (str, os.PathLike)):
            raise ArgumentTypeError(f"{type(self).__name__} takes the path of a store (str or os.PathLike), "
                                    f"got {type(path).__name__}")
        for name, fn in (("transform", transform), ("target_transform", target_transform),
                         ("batch_transform", batch_transform)):
            if fn is not None and not callable(fn):
                raise ArgumentTypeError(f"{name} must be callable (a torchvision transform, a HybridTransform or "
                                        f"a function), got {type(fn).__name__} {fn!r}")
        self.path = Path(path)
        self.format = formats.detect_format(self.path)
        if self.FORMAT is not None and self.format != self.FORMAT:
            raise WrongFormatError(
                f"{self.path} is a {self.format} store, not {self.FORMAT}: open it with "
                f"dlstore.{_FORMAT_CLASSES.get(self.format, 'StoreDataset')} or dlstore.open_dataset (which "
                "detects the format)")
        self.reader = open_reader(self.path, self.format, reader_options, check)
        self.format_reader = getattr(self.reader, "raw", self.reader)   # the StoreReader under any decoding
        self.manifest: dict[str, Any] = self.reader.manifest
        vectors = getattr(self.format_reader, "targets", None)   # (N, K) target vectors, or None: int labels
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
        self._labels = labels if vectors is None else vectors   # what each sample's target is read from
        self.targets: list[int] | np.ndarray = labels.tolist() if vectors is None else vectors
        sample = self.manifest["sample"]
        shape = sample["shape"] if sample["encoding"] == "raw" else sample.get("decoded_shape")
        self.shape: tuple[int, int, int] | None = tuple(shape) if shape is not None else None
        planned = plan(transform, self.manifest.get("static") or [], where=self.path)
        self.hybrid: HybridTransform | None = planned.hybrid
        # The leading ops of a whole pipeline that the store already applied: not run again.
        self.already_applied: list[Any] = planned.already_applied
        self.transform = planned.transform
        self.target_transform = target_transform
        self.batch_transform = batch_transform
        self.per_sample_ops, self.batch_ops = planned.split(fixed_shape=self.shape is not None)
        # An encoded store's leading RandomResizedCrop: drawn from the headers, run as each record decodes
        self.decode_crop, self.per_sample_ops, self.batch_ops = split_decode_crop(
            self.reader, self.per_sample_ops, self.batch_ops)
        if batch_transform is not None:
            self.batch_ops.append(batch_transform)
        # Leading crop (constant padding) and flip run inside the copy that assembles the batch.
        self._fused_crop: BatchRandomCrop | None = None
        self._fused_flip: BatchRandomHorizontalFlip | None = None
        rest = list(self.batch_ops)
        if self.shape is not None and not self.per_sample_ops and self.decode_crop is None:
            if rest and isinstance(rest[0], BatchRandomCrop) and rest[0].padding_mode == "constant" \
                    and isinstance(rest[0].fill, int) and 0 <= rest[0].fill <= 255:
                self._fused_crop = rest.pop(0)
            if rest and isinstance(rest[0], BatchRandomHorizontalFlip):
                self._fused_flip = rest.pop(0)
        if self.decode_crop is not None and rest and isinstance(rest[0], BatchRandomHorizontalFlip):
            self._fused_flip = rest.pop(0)                  # flipped in the copy of each crop
        self.batch_rest = rest
        # Loader threads (dlstore.loader(threads=...)) call get_batch at once: each thread has
        # its own padded buffer of the vectorised gather, and the pool's check-and-take is locked.
        self._local = threading.local()                           # .scratch: see crop_flip_windows
        self._pool: list[np.ndarray] = []                          # batch buffers, see _new_batch
        self._pool_lock = threading.Lock()
        self._pool_size = _POOL_SIZE   # a ThreadLoader raises it to cover the batches it keeps in flight
        self._pool_wants: list[int] = []   # what each live pass asked of _keep_buffers

    @property
    def origins(self) -> Any:
        """Where each sample came from (``Origins``: a path relative to the source root, or the
        source index); read from the store on first use."""
        origins = self.__dict__.get("_origins")
        if origins is None:
            origins = self.format_reader.origins()
            if origins is None:
                raise UsageError(f"{self.path}: this store records no provenance (converted by an older "
                                 "dlstore); convert it again to get samples/imgs")
            self.__dict__["_origins"] = origins
        return origins

    @property
    def samples(self) -> Sequence[tuple[str | int, int]]:
        """``(path, target)`` of every sample, as ``ImageFolder.samples``: the source file (its path
        under the source root recorded at conversion), or the source index for datasets and arrays."""
        root = self.manifest["source"].get("root")
        return OriginPairs(self.origins, self._labels, root if isinstance(root, str) else None)

    @property
    def imgs(self) -> Sequence[tuple[str | int, int]]:
        """Same as ``samples`` (ImageFolder's older name)."""
        return self.samples

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_local"], state["_pool_lock"]   # scratch memory is per process, never pickled
        state.update(_pool=[], _pool_wants=[], _pool_size=_POOL_SIZE)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()
        self._pool_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._labels)

    def _index(self, i: int) -> int:
        return sample_index(self.path, i, len(self._labels))

    def _indices(self, indices: Sequence[int]) -> np.ndarray:
        return sample_indices(self.path, indices, len(self._labels))

    def read(self, i: int) -> torch.Tensor:
        """Sample ``i`` as stored: uint8 (C, H, W), before any transform."""
        return torch.from_numpy(self.reader.get(self._index(i)))

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        i = self._index(i)
        image: Any = torch.from_numpy(self.reader.get(i))
        label: Any = int(self._labels[i]) if self._labels.ndim == 1 else torch.tensor(self._labels[i])
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

        The samples are read in one call of the reader (``get_many``: one transaction, reads in
        file order, every sample's readahead first when ``willneed`` is on); the result equals
        ``[ds[i] for i in indices]``. Fixed-shape shards samples come back as views of the memory
        map, so the DataLoader's ``default_collate`` (``torch.stack``) is the one and only copy.
        """
        if self.batch_transform is not None and self.shape is not None:
            batch, labels_t = self.get_batch(indices)
            labels_out = (labels_t.tolist() if isinstance(labels_t, torch.Tensor) and labels_t.ndim == 1
                          else list(labels_t))
            return list(zip(batch.unbind(0), labels_out))
        idx = self._indices(indices).tolist()
        images = self._per_sample_inputs(idx)
        labels = self._labels[idx].tolist() if self._labels.ndim == 1 else list(torch.from_numpy(self._labels[idx]))
        if self.transform is None and self.target_transform is None and self.batch_transform is None:
            return list(zip(images, labels))
        out = []
        for image, label in zip(images, labels):
            if self.transform is not None:
                image = self.transform(image)
            if self.batch_transform is not None:   # (variable shapes: no batch to run it on once)
                image = self.batch_transform(image[None])[0]
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
            if ``target_transform`` returns non-numbers); for a store of target vectors,
            a (B, K) tensor of their dtype (int64 or float32).
        """
        idx = self._indices(indices)
        if self.decode_crop is not None and self.records_out:     # decoded where the batch goes
            with profiling_range("dlstore.read"):
                images = draw_encoded(self.reader, idx.tolist(), self.decode_crop, generator, self._fused_flip)
        elif self.decode_crop is not None:
            with profiling_range("dlstore.read"):      # decode + RandomResizedCrop, record by record
                images = decode_crop_batch(self.reader, idx.tolist(), self.decode_crop, generator, self._new_batch,
                                           flip=self._fused_flip, reduced=self.reduced_decode)
        elif self.shape is not None and not self.per_sample_ops:
            with profiling_range("dlstore.read"):      # with the fused crop/flip, inside the one copy
                images = self._gather(idx, generator)
        else:
            with profiling_range("dlstore.read"):
                samples = self._per_sample_inputs(idx.tolist())
            with profiling_range("dlstore.host_transforms"):
                for op in self.per_sample_ops:
                    samples = [op(x) for x in samples]
                images = _stack(samples, self.path)
        with profiling_range("dlstore.host_transforms"):
            for op in self.batch_rest:
                images = op(images, generator)
        labels: Any = torch.from_numpy(self._labels[idx])
        if self.target_transform is not None and labels.ndim == 2:   # target vectors: one (K,) tensor each
            out = [self.target_transform(v) for v in labels]
            labels = torch.stack(out) if all(isinstance(v, torch.Tensor) for v in out) else out
        elif self.target_transform is not None:
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
        padding = crop.padding_for(h, w) if crop is not None else (0, 0, 0, 0)
        fill = crop.fill if crop is not None else 0
        if crop is not None:
            params = crop.sample((b, c, h, w), generator=generator)
            tops, lefts = params["top"].numpy(), params["left"].numpy()
        else:
            tops = lefts = np.zeros(b, dtype=np.int64)
        flips = flip.sample((b, c, th, tw), generator=generator)["flip"].numpy() if flip is not None \
            else np.zeros(b, dtype=bool)
        fast = compiled.available()
        if not fast and th * tw <= VECTORISED_MAX_PIXELS and hasattr(self.reader, "get_batch"):
            batch, self._local.scratch = crop_flip_windows(self.reader.get_batch, idx, self.shape, (th, tw), tops,
                                                           lefts, flips, padding, fill,
                                                           getattr(self._local, "scratch", None))
            return batch
        out = self._new_batch((b, c, th, tw))
        if not fast:
            crop_flip_loop(self.reader.get_many(idx.tolist()), out.numpy(), tops, lefts, flips, padding, fill)
            return out
        # one GIL-free call for the batch (numba, the `fast` extra), reading the samples in
        # place where the reader can say where they are (shards), else its get_many copies/views
        located = self.reader.sample_addresses(idx) if hasattr(self.reader, "sample_addresses") else None
        if located is not None:
            addresses, _mapped = located          # _mapped: kept mapped until the kernel returns
            compiled.crop_flip_at(addresses, self.shape, out.numpy(), tops, lefts, flips, padding, fill)
        else:
            compiled.crop_flip(self.reader.get_many(idx.tolist()), out.numpy(), tops, lefts, flips, padding, fill)
        return out

    @property
    def fuses_crop_flip(self) -> bool:
        """True when get_batch runs a leading RandomCrop / HorizontalFlip inside its copy (the
        kernel of ``dlstore.transforms.compiled`` where numba imports, else the pure one)."""
        return self.decode_crop is None and (self._fused_crop is not None or self._fused_flip is not None)

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
        with self._pool_lock:   # two loader threads must not both take the same free buffer
            pool = self._pool
            for k in range(len(pool)):
                # references: the list and getrefcount's argument. Any more: a batch tensor (or a
                # view of one) handed out earlier still uses this memory.
                if pool[k].nbytes == nbytes and sys.getrefcount(pool[k]) <= 2:
                    buf = pool.pop(k)
                    pool.append(buf)                             # most recently used last
                    return torch.from_numpy(buf.reshape(shape))
            if len(pool) >= self._pool_size:
                pool.pop(0)                                      # forget the oldest; its user keeps it
            buf = np.empty(nbytes, dtype=np.uint8)
            pool.append(buf)
            return torch.from_numpy(buf.reshape(shape))

    def _per_sample_inputs(self, idx: list[int]) -> list[torch.Tensor]:
        """Samples ``idx`` as tensors for per-sample transforms. An encoded store's come as
        torchvision decodes them, (C, H, W) views of (H, W, C) memory, without a copy to
        contiguous (which cost as much as the resize of RandomResizedCrop)."""
        read = getattr(self.reader, "get_many_views", self.reader.get_many)
        return [torch.from_numpy(a) for a in read(idx)]

    def _keep_buffers(self, count: int) -> Callable[[], None]:
        """Pool at least ``count`` batch buffers until the returned function is called: a loader
        pass keeps that many in use at once. Passes that overlap (two loaders of one dataset,
        in threads or stepped in turn) each keep theirs; the last one's end restores the default."""
        with self._pool_lock:
            self._pool_wants.append(count)
            self._pool_size = max([_POOL_SIZE, *self._pool_wants])

        def release() -> None:
            with self._pool_lock:
                self._pool_wants.remove(count)
                self._pool_size = max([_POOL_SIZE, *self._pool_wants])
        return release

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.shape)) if self.shape else "variable"
        text = (f"{type(self).__name__}({str(self.path)!r}, format={self.format}, samples={len(self)}, "
                f"classes={len(self.classes)}, shape={shape}")
        if self.already_applied and self.hybrid is not None:
            runs = ", ".join(map(repr, self.hybrid.dynamic_ops)) or "nothing"
            text += (f"; static (in store): {describe(self.hybrid.static_spec)}, so not run again: "
                     f"{', '.join(type(t).__name__ for t in self.already_applied)}; runs: [{runs}]")
        return text + ")"


def _stack(samples: list[torch.Tensor], path: Path) -> torch.Tensor:
    shapes = {tuple(x.shape) for x in samples}
    if len(shapes) > 1:
        raise TransformSpecError(
            f"{path}: cannot batch samples of different shapes {sorted(shapes)[:4]}; give the dynamic "
            f"part an op that fixes the size (RandomResizedCrop, RandomCrop, Resize to HxW), or convert "
            f"with a size-fixing static op (center_crop=...)")
    return torch.stack(samples)
