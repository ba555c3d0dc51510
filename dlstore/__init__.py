"""dlstore: precomputed image stores and fast loaders for PyTorch training.

The public API, re-exported; nothing else happens here.
"""

from .bench import BenchReport, run_bench
from .convert import ConvertResult, convert
from .dataset import StoreDataset, loader, open_dataset
from .distributed import DistributedError
from .errors import (
    ConversionInterrupted,
    DecodeError,
    DeviceMemoryError,
    DlstoreError,
    SourceError,
    StaticMismatchError,
    StoreBusyError,
    StoreCorruptError,
    StoreExistsError,
    TransformSpecError,
    UnknownFormatError,
    VariableShapeError,
)
from .gpu import GPUDataset, GPULoader
from .profiling import TimedDataset, profile_loader
from .transforms import (
    BatchCompose,
    BatchCutout,
    BatchNormalize,
    BatchRandomCrop,
    BatchRandomHorizontalFlip,
    BatchRandomResizedCrop,
    HybridTransform,
    parse_static,
    split_transforms,
)
from .tuning import cpu_info, tune

__version__ = "0.1.0"

__all__ = [
    "BenchReport",
    "BatchCompose",
    "BatchCutout",
    "BatchNormalize",
    "BatchRandomCrop",
    "BatchRandomHorizontalFlip",
    "BatchRandomResizedCrop",
    "HybridTransform",
    "ConversionInterrupted",
    "ConvertResult",
    "DecodeError",
    "DeviceMemoryError",
    "DistributedError",
    "DlstoreError",
    "GPUDataset",
    "GPULoader",
    "SourceError",
    "StaticMismatchError",
    "StoreBusyError",
    "StoreCorruptError",
    "StoreDataset",
    "StoreExistsError",
    "TimedDataset",
    "TransformSpecError",
    "UnknownFormatError",
    "VariableShapeError",
    "convert",
    "loader",
    "cpu_info",
    "open_dataset",
    "parse_static",
    "split_transforms",
    "profile_loader",
    "run_bench",
    "tune",
]
