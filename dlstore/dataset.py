"""One map-style Dataset for every store format.

``open_dataset(path)`` detects the format, validates the manifest (cheap checks
only) and returns a :class:`StoreDataset` yielding ``(uint8 CHW tensor, int
label)``, like ``ImageFolder`` followed by the store's static transforms and
``PILToTensor``. Data handles open lazily in each process that reads (after a
DataLoader worker starts), never before a fork.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from . import formats
from .errors import StoreCorruptError


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
    """

    def __init__(
        self,
        path: str | os.PathLike,
        transform: Callable[[torch.Tensor], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
    ):
        self.path = Path(path)
        self.format = formats.detect_format(self.path)
        self.reader = formats.get_format(self.format).Reader(self.path)
        self.manifest: dict[str, Any] = self.reader.manifest
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
        shape = self.manifest["sample"]["shape"]
        self.shape: tuple[int, int, int] | None = tuple(shape) if shape is not None else None
        self.transform = transform
        self.target_transform = target_transform

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

    def get_image(self, i: int) -> torch.Tensor:
        """Sample ``i`` as stored: uint8 (C, H, W), before any transform."""
        return torch.from_numpy(self.reader.get(self._index(i)))

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        i = self._index(i)
        image: Any = torch.from_numpy(self.reader.get(i))
        label: Any = int(self._labels[i])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label

    def read_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor | list[torch.Tensor], torch.Tensor]:
        """Samples ``indices`` before transforms: a (B, C, H, W) uint8 tensor for a
        fixed-shape store (one gather, no per-sample tensors), else a list of
        (C, H, W) tensors; and the int64 labels."""
        idx = np.fromiter((self._index(i) for i in indices), dtype=np.int64, count=len(indices))
        labels = torch.from_numpy(self._labels[idx])
        if self.shape is not None and hasattr(self.reader, "get_batch"):
            return torch.from_numpy(self.reader.get_batch(idx)), labels
        return [torch.from_numpy(self.reader.get(int(i))) for i in idx], labels

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, Any]]:
        """Batched read used by DataLoader (torch >= 2.1 calls it with the whole batch).

        Fixed-shape shards samples come back as views of the memory map, so the
        DataLoader's ``default_collate`` (``torch.stack``) is the one and only copy.
        """
        idx = [self._index(i) for i in indices]
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

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.shape)) if self.shape else "variable"
        return (f"StoreDataset({str(self.path)!r}, format={self.format}, samples={len(self)}, "
                f"classes={len(self.classes)}, shape={shape})")


def open_dataset(
    path: str | os.PathLike,
    transform: Callable[[torch.Tensor], Any] | None = None,
    target_transform: Callable[[int], Any] | None = None,
) -> StoreDataset:
    """Open a store written by ``dlstore convert`` as a map-style Dataset.

    Args:
        path: a ``.shards`` folder, an ``.lmdb`` folder or an ``.h5`` file.
        transform: dynamic transform applied to each uint8 CHW tensor at read time.
        target_transform: applied to each int label.

    Raises:
        FileNotFoundError: nothing at ``path``.
        UnknownFormatError: ``path`` is not a store.
        StoreCorruptError: the manifest is missing, damaged, too new, or disagrees with the data.
    """
    return StoreDataset(path, transform=transform, target_transform=target_transform)
