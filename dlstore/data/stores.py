"""The per-format dataset classes and ``open_dataset``, which picks one by the store's contents.

``ShardsDataset``, ``LMDBDataset`` and ``HDF5Dataset`` are :class:`StoreDataset` bound to
one format (opening another format's store with one raises WrongFormatError naming the
right class); ``open_dataset`` detects the format and returns the matching one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from .. import formats
from ..errors import ArgumentTypeError
from .dataset import StoreDataset


class ShardsDataset(StoreDataset):
    """A :class:`StoreDataset` over a ``.shards`` store (memory-mapped tensor shards)."""

    FORMAT = "shards"


class LMDBDataset(StoreDataset):
    """A :class:`StoreDataset` over an ``.lmdb`` store (``reader_options={"readahead": bool}``)."""

    FORMAT = "lmdb"


class HDF5Dataset(StoreDataset):
    """A :class:`StoreDataset` over an ``.h5`` store (``reader_options={"chunk_cache_bytes": int}``)."""

    FORMAT = "hdf5"



def dataset_class(fmt: str) -> type[StoreDataset]:
    """The dataset class of format ``fmt``: the class its ``Format`` names (``dataset_class``)."""
    name = formats.get_format(fmt).dataset_class
    return next(cls for cls in (ShardsDataset, LMDBDataset, HDF5Dataset) if cls.__name__ == name)


def open_dataset(
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
) -> StoreDataset:
    """Open a store written by ``dlstore convert`` as a map-style Dataset of the matching class.

    The format is detected from the contents (``ShardsDataset``, ``LMDBDataset``
    or ``HDF5Dataset`` is returned, each a :class:`StoreDataset`).

    Args:
        path: a ``.shards`` folder, an ``.lmdb`` folder or an ``.h5`` file.
        transform: dynamic transform applied to each uint8 CHW tensor at read time,
            or a :class:`HybridTransform` (its static part must match the store's;
            its dynamic part runs, per batch where possible through ``dlstore.loader``).
            A whole torchvision pipeline whose leading ops are the store's static ops
            runs without them (they made the stored samples; see ``strip_static_prefix``).
        target_transform: applied to each int label.
        batch_transform: ``t(images, generator=None)`` run once per (B, C, H, W)
            batch by ``get_batch`` / ``dlstore.loader``, after ``transform``.
        reader_options: passed to the format's Reader: ``{"readahead": False}`` for
            LMDB (default: on when the store is under half the RAM),
            ``{"chunk_cache_bytes": N}`` for HDF5.
        check: integrity check on read. ``"none"`` (default): reads trust the files
            (``dlstore verify`` checks them). ``"open"``: each shards data file's
            sha256 is checked the first time this process maps it; an LMDB or HDF5
            data file is checked against its seal before the library sees it (which
            also keeps damaged metadata from crashing or hanging LMDB/HDF5). A
            mismatch raises StoreCorruptError naming the file and its samples.
            ``"sample"``: every sample read (``get``, batches, ranges; the stored
            record, before any decoding) is checked against the CRC32 recorded for
            it at conversion; a mismatch raises StoreCorruptError naming the file and
            the damaged sample indices (labels and shapes are checked against their
            sha256 once, at open). A store converted before the sums existed
            raises UsageError (use ``"open"`` or convert again). See
            docs/robustness.md for the cost of each mode.
        reduced_decode: a JPEG store whose ``transform`` begins with ``RandomResizedCrop``:
            batches (``get_batch``, ``dlstore.loader``) decode each record at the smallest DCT
            scale (1/2, 1/4, 1/8) at which its drawn box still holds the output size. Faster on
            large records, not the exact pixels (docs/reading.md measures it); off by default.
        static_mismatch: ``"error"`` (default): a leading deterministic op of ``transform`` that differs
            from the store's recorded static stage (another resize size, another crop) raises
            StaticMismatchError naming both; ``"allow"`` runs it on the stored samples anyway, and the
            plan (``repr(ds)``) says so.
        class_to_idx: the class name -> label mapping the caller's labels follow (``ImageFolder(...)
            .class_to_idx`` or timm's reader's of the source folder, a model's saved mapping): a store whose
            labels differ is refused. None (default): no check.

    Raises:
        FileNotFoundError: nothing at ``path``.
        UnknownFormatError: ``path`` is not a store.
        StoreCorruptError: the manifest is missing, damaged, too new, or disagrees with the data.
        UsageError: ``check="sample"`` on a store without per-sample sums.
        StaticMismatchError: ``transform`` is a hybrid whose static part differs from the store's,
            or a pipeline that begins with some of the store's static ops but not all, or
            with one of them under other settings.
        ArgumentError: ``class_to_idx`` differs from the store's labels; names the first differing class
            and the class order to convert with (``class_order=``).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(f"open_dataset takes the path of a store (str or os.PathLike), got "
                                f"{type(path).__name__}")
    cls = dataset_class(formats.detect_format(path))
    return cls(path, transform=transform, target_transform=target_transform, batch_transform=batch_transform,
               reader_options=reader_options, check=check, reduced_decode=reduced_decode,
               static_mismatch=static_mismatch, class_to_idx=class_to_idx)
