"""dlstore: precomputed image stores and fast loaders for PyTorch training.

The core API, re-exported; nothing else happens here. Tools (bench, tune,
profile) live in ``dlstore.tools``, batch transforms in ``dlstore.transforms``.

Layers, imported one way only::

    cli -> tools, conversion, data -> formats -> transforms, sources -> errors, _system

The exceptions are imported here; the rest on first use (``dlstore.convert``
imports torch then), so that ``import dlstore`` and ``dlstore --help`` cost
no torch import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    ArgumentError,
    ArgumentTypeError,
    ConversionInterrupted,
    DecodeError,
    DeviceMemoryError,
    DiskFullError,
    DistributedError,
    DlstoreError,
    MeasurementError,
    NotAStoreError,
    SampleIndexError,
    SharedMemoryError,
    SourceChangedError,
    SourceError,
    StateMismatchError,
    StaticMismatchError,
    StoreBusyError,
    StoreCorruptError,
    StoreExistsError,
    StoreNotFoundError,
    StoreWriteError,
    SystemProbeError,
    TransformSpecError,
    UnknownFormatError,
    UsageError,
    VariableShapeError,
    WorkerError,
    WriterKilledError,
    WrongFormatError,
)

if TYPE_CHECKING:
    from .conversion import ConvertResult, convert
    from .data import (
        BlockShuffleSampler,
        GPUDataset,
        HDF5Dataset,
        LMDBDataset,
        Loader,
        ShardsDataset,
        StoreDataset,
        loader,
        open_dataset,
    )
    from .data.profiling_ranges import profiling_range
    from .tools.verification import VerifyReport, verify
    from .transforms import HybridTransform, ResizeMax, split_transforms

__version__ = "0.3.0"

# public name -> the module it comes from (imported when the name is first used)
_LAZY = {
    "ConvertResult": "dlstore.conversion",
    "convert": "dlstore.conversion",
    "BlockShuffleSampler": "dlstore.data",
    "GPUDataset": "dlstore.data",
    "HDF5Dataset": "dlstore.data",
    "LMDBDataset": "dlstore.data",
    "Loader": "dlstore.data",
    "ShardsDataset": "dlstore.data",
    "StoreDataset": "dlstore.data",
    "loader": "dlstore.data",
    "open_dataset": "dlstore.data",
    "profiling_range": "dlstore.data.profiling_ranges",
    "VerifyReport": "dlstore.tools.verification",
    "verify": "dlstore.tools.verification",
    "HybridTransform": "dlstore.transforms",
    "ResizeMax": "dlstore.transforms",
    "split_transforms": "dlstore.transforms",
}

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "BlockShuffleSampler",
    "ConversionInterrupted",
    "ConvertResult",
    "DecodeError",
    "DeviceMemoryError",
    "DiskFullError",
    "DistributedError",
    "DlstoreError",
    "GPUDataset",
    "HDF5Dataset",
    "HybridTransform",
    "LMDBDataset",
    "Loader",
    "MeasurementError",
    "NotAStoreError",
    "ResizeMax",
    "SampleIndexError",
    "ShardsDataset",
    "SharedMemoryError",
    "SourceChangedError",
    "SourceError",
    "StateMismatchError",
    "StaticMismatchError",
    "StoreBusyError",
    "StoreCorruptError",
    "StoreDataset",
    "StoreExistsError",
    "StoreNotFoundError",
    "StoreWriteError",
    "SystemProbeError",
    "TransformSpecError",
    "UnknownFormatError",
    "UsageError",
    "VariableShapeError",
    "VerifyReport",
    "WorkerError",
    "WriterKilledError",
    "WrongFormatError",
    "convert",
    "loader",
    "open_dataset",
    "profiling_range",
    "split_transforms",
    "verify",
]


# subpackages reachable as attributes (``dlstore.tools.tune``) after a plain ``import dlstore``
_SUBPACKAGES = ("conversion", "data", "formats", "sources", "tools", "transforms")


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    if name not in _LAZY:
        raise AttributeError(f"module 'dlstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value   # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBPACKAGES))
