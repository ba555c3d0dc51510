"""One map-style Dataset for every store format.

``open_dataset(path)`` detects the format, validates the manifest (cheap checks
only) and returns a :class:`StoreDataset` yielding ``(uint8 CHW tensor, int
label)``, like ``ImageFolder`` followed by the store's static transforms and
``PILToTensor``. Data handles open lazily in each process that reads (after a
DataLoader worker starts), never before a fork.

The batch path: ``loader(dataset, batch_size, ...)`` hands whole index lists to
``StoreDataset.get_batch(indices, generator=..., out=...)`` (``batch_path.py``):
one copy from the reader (a random crop and flip inside it when the dynamic part
starts with them), per-sample ops only where an op has no batch equivalent, then
the batch ops once per batch. The loader owns the memory the batch is written into.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .. import formats
from ..errors import ArgumentTypeError, StoreCorruptError, UsageError, WrongFormatError
from ..sources.class_order import check_class_to_idx
from ..sources.origins import OriginPairs
from ..transforms.planner import Plan, plan
from ..transforms.static import describe
from ..formats.fields import RecordFields
from ..transforms.joint import JointPlan, plan_joint
from .batch_path import BatchPath
from .joint_path import JointBatchPath
from .device_decode import DeviceDecode, decodes_on_device
from .indices import sample_index, sample_indices
from .store_reader import check_mode, open_reader


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
        reader: the store's reader (samples by index, as stored).
        shape: (C, H, W) of every sample, or None for a variable-shape store.
        transform: the read-time transform as given (assigning one plans it again, for every path).
        already_applied: the leading ops of a whole pipeline given as ``transform`` that the
            store's static spec stands for, so they do not run (empty when none).
        decode_crop: on a JPEG/PNG store, the leading RandomResizedCrop that ``get_batch`` runs as
            each record decodes (``reduced_decode=True``: at a DCT scale), or None.
        per_sample_ops, batch_ops: the dynamic part as ``get_batch`` runs it: ops per sample, then
            batch transforms (``batch_transform`` last), past ``decode_crop``.
        batch_rest: the batch ops ``get_batch`` runs after the read, past those it runs inside it
            (a leading crop and flip, or the flip after ``decode_crop``).

    Samples of fixed-shape shards stores are zero-copy views of a private
    copy-on-write memory map: nothing is read until the tensor is used, and an
    in-place change never reaches the file (but does persist in that process, so
    a transform that works in place should ``clone()`` first).

    ``transform`` may be a :class:`HybridTransform`: the store's static spec must
    then equal the hybrid's static part, and only its dynamic part runs. A whole
    torchvision pipeline that begins with the store's static ops does not run them
    again (``strip_static_prefix``); one that begins with only some of them, or with
    one under other settings, raises StaticMismatchError. ``repr`` shows the plan.
    """

    FORMAT: str | None = None   # set by the format-specific subclasses
    records_out = False         # get_batch hands out records and drawn boxes (device_decode.py), not pixels

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
        static_mismatch: str = "error",
        class_to_idx: dict[str, int] | None = None,
    ):
        self.check = check_mode(check)
        self.static_mismatch = static_mismatch
        self.reduced_decode = bool(reduced_decode)
        if not isinstance(path, (str, os.PathLike)):
            raise ArgumentTypeError(f"{type(self).__name__} takes the path of a store (str or os.PathLike), "
                                    f"got {type(path).__name__}")
        for name, fn in (("target_transform", target_transform), ("batch_transform", batch_transform)):
            _check_callable(name, fn)
        self.path = Path(path)
        self.format = formats.detect_format(self.path)
        if self.FORMAT is not None and self.format != self.FORMAT:
            raise WrongFormatError(
                f"{self.path} is a {self.format} store, not {self.FORMAT}: open it with "
                f"dlstore.{formats.get_format(self.format).dataset_class} or dlstore.open_dataset (which "
                "detects the format)")
        self.reader = open_reader(self.path, self.format, reader_options, check)
        self.manifest: dict[str, Any] = self.reader.manifest
        vectors = self.reader.targets   # (N, K) target vectors, or None: int labels
        self.classes: list[str] = list(self.manifest["classes"])
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        if class_to_idx is not None:   # the labels the caller trained with: refuse a store that permutes them
            check_class_to_idx(str(self.path), self.classes, class_to_idx, recorded=self.manifest.get("class_order"),
                               source_root=self.manifest["source"].get("root"))
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
        # a segmentation store's records hold the mask's planes after the image (formats.fields)
        self.fields = RecordFields.of(self.manifest, self.path)
        self.record_shape: tuple[int, int, int] | None = tuple(shape) if shape is not None else None
        self.shape: tuple[int, int, int] | None = (self.record_shape if self.fields is None
                                                   else self.fields.image_shape(self.record_shape))
        self.target_transform = target_transform
        self.batch_transform = batch_transform
        self.transform = transform        # planned by the setter

    # --- the plan -------------------------------------------------------------------------

    @property
    def transform(self) -> Any:
        return self._transform

    @transform.setter
    def transform(self, transform: Any) -> None:
        """Plan ``transform`` against the store for every read path (``ds[i]``, ``get_batch``, the device),
        as ``open_dataset(path, transform=...)`` plans it (timm's ``create_loader`` assigns it so)."""
        _check_callable("transform", transform)
        if self.fields is not None:   # a v2 pipeline for (Image, Mask): transforms.joint
            planned: Any = plan_joint(transform, self.manifest.get("static") or [], where=self.path,
                                      static_mismatch=self.static_mismatch)
        else:
            planned = plan(transform, self.manifest.get("static") or [], where=self.path,
                           static_mismatch=self.static_mismatch)      # refused here: nothing changes
        self._transform = transform
        self._use_plan(planned)

    def _use_plan(self, planned: Plan | JointPlan) -> None:
        self.plan = planned
        if isinstance(planned, JointPlan):
            self.hybrid, self.already_applied, self._sample_transform = None, [], planned.sample_transform
            self.batch_path = JointBatchPath(self.reader, self.record_shape, self.fields, planned, where=self.path)
            return
        self.hybrid = planned.hybrid
        self.already_applied: list[Any] = planned.already_applied
        self._sample_transform = planned.sample_transform      # what ds[i] runs: the whole plan, per sample
        per_sample, batch_ops = planned.split(fixed_shape=self.shape is not None)
        if self.batch_transform is not None:
            batch_ops.append(self.batch_transform)
        self.batch_path = BatchPath(self.reader, self.shape, per_sample, batch_ops,
                                    reduced_decode=self.reduced_decode, where=self.path)

    @property
    def per_sample_ops(self) -> list[Any]:
        return self.batch_path.per_sample_ops

    @property
    def batch_ops(self) -> list[Any]:
        path = self.batch_path
        fused = [op for op in (path.crop, path.flip) if op is not None]
        return fused + list(path.rest)

    @property
    def decode_crop(self) -> Any:
        return self.batch_path.decode_crop

    @property
    def batch_rest(self) -> list[Any]:
        return self.batch_path.rest

    @property
    def fuses_crop_flip(self) -> bool:
        """True when get_batch runs a leading RandomCrop / HorizontalFlip inside its copy."""
        return self.batch_path.fuses_crop_flip

    @property
    def threads_apply(self) -> bool:
        """Whether ``get_batch`` is work that threads run in parallel, reproducibly: a fixed-shape batch
        with no per-sample op (reads, GIL-free kernels, batch ops drawing from the given generator).
        Per-sample torchvision ops hold the GIL and draw from torch's global generator."""
        fixed = self.shape is not None or self.decode_crop is not None
        return fixed and not self.batch_path.python_ops

    # --- store-level facts a loader asks --------------------------------------------------

    @property
    def fingerprint(self) -> str:
        """What identifies the store's contents (its sample count and data checksums), wherever it lies."""
        content = json.dumps([self.manifest.get("count"), self.manifest.get("checksums")], sort_keys=True)
        return hashlib.sha256(content.encode()).hexdigest()[:16]

    @property
    def advises_reads(self) -> bool:
        """Whether the reader asks the kernel to read each batch ahead (``willneed``: a store that cannot stay cached)."""
        return bool(self.reader.willneed)

    def prefetch(self, indices: Sequence[int] | np.ndarray) -> bool:
        """Ask the kernel to read samples ``indices`` ahead (returns at once); False where the store
        cannot say where they lie."""
        return bool(self.reader.prefetch(self._indices(indices)))

    def open(self) -> None:
        """Open the reader's handles in this process now (they open on first use otherwise)."""
        self.reader.ensure_open()

    def batch_shape(self, n: int) -> tuple[int, ...] | None:
        """The (n, C, H, W) uint8 tensor ``get_batch`` can write its batch into (``out=``), or None when
        that shape is not known before reading."""
        return self.batch_path.out_shape(n)

    # --- samples --------------------------------------------------------------------------

    @property
    def origins(self) -> Any:
        """Where each sample came from (``Origins``: a path relative to the source root, or the
        source index); read from the store on first use."""
        origins = self.__dict__.get("_origins")
        if origins is None:
            origins = self.reader.origins()
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

    def __len__(self) -> int:
        return len(self._labels)

    def _indices(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        return sample_indices(self.path, indices, len(self._labels))

    def _target(self, i: int) -> Any:
        label: Any = int(self._labels[i]) if self._labels.ndim == 1 else torch.tensor(self._labels[i])
        return label if self.target_transform is None else self.target_transform(label)

    def read(self, i: int) -> Any:
        """Sample ``i`` as stored: uint8 (C, H, W), before any transform; of a segmentation store,
        (image, mask)."""
        record = torch.from_numpy(self.reader.get(sample_index(self.path, i, len(self._labels))))
        return record if self.fields is None else self.fields.split(record)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        i = sample_index(self.path, i, len(self._labels))
        if self.fields is not None:
            return self._pair(i)
        return self._transformed(torch.from_numpy(self.reader.get(i))), self._target(i)

    def _pair(self, i: int) -> tuple[Any, Any]:
        """(image, mask) of sample ``i``, the pipeline run on them as given (v2, on ``(Image, Mask)``)."""
        image, mask = self.fields.split(torch.from_numpy(self.reader.get(i)))
        if self._sample_transform is not None:
            from torchvision import tv_tensors

            image, mask = self._sample_transform(tv_tensors.Image(image), tv_tensors.Mask(mask))
            image, mask = image.as_subclass(torch.Tensor), mask.as_subclass(torch.Tensor)
        if self.batch_transform is not None:
            image = self.batch_transform(image[None])[0]
        return image, mask if self.target_transform is None else self.target_transform(mask)

    def _transformed(self, image: Any) -> Any:
        if self._sample_transform is not None:
            image = self._sample_transform(image)
        if self.batch_transform is not None:
            image = self.batch_transform(image[None])[0]
        return image

    def read_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor | list[torch.Tensor], torch.Tensor]:
        """Samples ``indices`` before transforms: a (B, C, H, W) uint8 tensor for a
        fixed-shape store (one gather, no per-sample tensors), else a list of
        (C, H, W) tensors; and the int64 labels."""
        idx = self._indices(indices)
        if self.fields is not None:
            if self.shape is not None:
                return self.fields.split(torch.from_numpy(self.reader.get_batch(idx)))
            pairs = [self.fields.split(torch.from_numpy(self.reader.get(int(i)))) for i in idx]
            return [image for image, _ in pairs], [mask for _, mask in pairs]
        labels = torch.from_numpy(self._labels[idx])
        if self.shape is not None:
            return torch.from_numpy(self.reader.get_batch(idx)), labels
        return [torch.from_numpy(self.reader.get(int(i))) for i in idx], labels

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, Any]]:
        """Batched read used by DataLoader (torch >= 2.1 calls it with the whole batch).

        The samples are read in one call of the reader (one transaction, reads in file order);
        the result equals ``[ds[i] for i in indices]``. Fixed-shape shards samples come back as
        views of the memory map, so the DataLoader's ``default_collate`` is the one copy.
        """
        idx = self._indices(indices).tolist()
        if self.fields is not None:
            return [self._pair(i) for i in idx]
        if self.batch_transform is not None and self.shape is not None and self._sample_transform is None:
            images: Any = self.get_batch(idx)[0].unbind(0)
        else:
            images = [self._transformed(x) for x in self.batch_path.read_for_ops(idx)]
        return [(image, self._target(i)) for image, i in zip(images, idx)]

    def get_batch(self, indices: Sequence[int] | np.ndarray, *, generator: torch.Generator | None = None,
                  out: torch.Tensor | None = None) -> tuple[Any, Any]:
        """Samples ``indices`` with the dynamic transforms applied, as one batch.

        Args:
            indices: sample indices.
            generator: CPU generator of the random parameters; None: torch's default one.
            out: a uint8 tensor of ``batch_shape(len(indices))`` to write the batch into (the
                caller's memory); the images returned are ``out`` unless a later op made a new tensor.

        Returns:
            (images, labels): a (B, C, H, W) tensor and an int64 (B,) tensor (a list if
            ``target_transform`` returns non-numbers); for a store of target vectors, a (B, K)
            tensor of their dtype (int64 or float32).
        """
        idx = self._indices(indices)
        if self.fields is not None:
            images, masks = self.batch_path.build(idx, generator, out)
            if self.target_transform is not None:
                done = [self.target_transform(m) for m in masks]
                masks = torch.stack(done) if all(isinstance(m, torch.Tensor) for m in done) else done
            return images, masks
        images = self.batch_path.build(idx, generator, out, records=self.records_out)
        labels: Any = torch.from_numpy(self._labels[idx])
        if self.target_transform is not None and labels.ndim == 2:   # target vectors: one (K,) tensor each
            done = [self.target_transform(v) for v in labels]
            labels = torch.stack(done) if all(isinstance(v, torch.Tensor) for v in done) else done
        elif self.target_transform is not None:
            done = [self.target_transform(int(v)) for v in labels]
            labels = torch.as_tensor(done) if all(isinstance(v, (int, float)) for v in done) else done
        return images, labels

    # --- the device stage -----------------------------------------------------------------

    def host_stage(self, *, records_to: torch.device | None = None) -> tuple[StoreDataset, list[Any]]:
        """This dataset cut at the end of its host stage, and its device stage as ops.

        The device stage is the float tail of the transform (a HybridTransform's ``device_ops``;
        for a torchvision pipeline, the ops from the first float-producing one on) followed by
        ``batch_transform``. The host dataset shares this one's reader and target transform. With
        ``records_to`` (a device), a JPEG store whose batches can be decoded there is cut before
        the decode: its host batches are EncodedBatches and the first device op decodes them.

        Returns:
            (host dataset: this one when nothing moves, device steps: each ``step(images, generator)``,
            torchvision ops as their batch equivalents or run per sample; a DeviceDecode first).
        """
        steps = self.plan.device_steps()
        if self.batch_transform is not None:
            steps.append(self.batch_transform)
        records = records_to is not None and self.decode_crop is not None
        if not steps and not records:
            return self, []
        view = copy.copy(self)            # the same reader and options; its own plan below
        view.batch_transform = None
        view._use_plan(self.plan.host_plan())
        if records and decodes_on_device(view):
            view.records_out = True
            steps.insert(0, DeviceDecode(view.reader, view.decode_crop))
        return view, steps

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.shape)) if self.shape else "variable"
        text = (f"{type(self).__name__}({str(self.path)!r}, format={self.format}, samples={len(self)}, "
                f"classes={len(self.classes)}, shape={shape}")
        if self.already_applied and self.hybrid is not None:
            runs = ", ".join(map(repr, self.hybrid.dynamic_ops)) or "nothing"
            text += (f"; static (in store): {describe(self.hybrid.static_spec)}, so not run again: "
                     f"{', '.join(type(t).__name__ for t in self.already_applied)}; runs: [{runs}]")
        text += ")"
        if self._transform is not None or self.batch_transform is not None:
            text += "\n" + self.plan.describe(fixed_shape=self.shape is not None)
            if self.decode_crop is not None:
                text += f"\n  the first, {self.decode_crop!r}, runs as each record decodes (decode_crop)"
            if self.batch_transform is not None:
                text += f"\n  then, per batch (batch_transform): {self.batch_transform!r}"
        return text


def _check_callable(name: str, fn: Any) -> None:
    if fn is not None and not callable(fn):
        raise ArgumentTypeError(f"{name} must be callable (a torchvision transform, a HybridTransform or "
                                f"a function), got {type(fn).__name__} {fn!r}")

