"""dlstore: precomputed image stores and fast loaders for PyTorch training.

The core API, re-exported; nothing else happens here. Tools (bench, tune,
profile) live in ``dlstore.tools``, batch transforms in ``dlstore.transforms``.

Layers, imported one way only::

    cli -> tools, conversion, data -> formats -> transforms, sources -> errors, _system
"""

from .conversion import ConvertResult, convert
from .data import (
    GPUDataset,
    HDF5Dataset,
    LMDBDataset,
    ShardsDataset,
    StoreDataset,
    loader,
    open_dataset,
)
from .errors import (
    ConversionInterrupted,
    DecodeError,
    DeviceMemoryError,
    DistributedError,
    DlstoreError,
    NotAStoreError,
    SharedMemoryError,
    SourceError,
    StaticMismatchError,
    StoreBusyError,
    StoreCorruptError,
    StoreExistsError,
    TransformSpecError,
    UnknownFormatError,
    VariableShapeError,
    WorkerError,
)
from .tools.verification import VerifyReport, verify
from .transforms import HybridTransform, split_transforms

__version__ = "0.1.0"

__all__ = [
    "ConversionInterrupted",
    "ConvertResult",
    "DecodeError",
    "DeviceMemoryError",
    "DistributedError",
    "DlstoreError",
    "GPUDataset",
    "HDF5Dataset",
    "HybridTransform",
    "LMDBDataset",
    "NotAStoreError",
    "ShardsDataset",
    "SharedMemoryError",
    "SourceError",
    "StaticMismatchError",
    "StoreBusyError",
    "StoreCorruptError",
    "StoreDataset",
    "StoreExistsError",
    "TransformSpecError",
    "UnknownFormatError",
    "VariableShapeError",
    "VerifyReport",
    "WorkerError",
    "convert",
    "loader",
    "open_dataset",
    "split_transforms",
    "verify",
]
