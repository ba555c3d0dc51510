"""dlstore: precomputed image stores and fast loaders for PyTorch training.

The public API, re-exported; nothing else happens here.
"""

from .convert import ConvertResult, convert
from .dataset import StoreDataset, open_dataset
from .errors import (
    ConversionInterrupted,
    DecodeError,
    DlstoreError,
    SourceError,
    StoreBusyError,
    StoreCorruptError,
    StoreExistsError,
    TransformSpecError,
    UnknownFormatError,
)
from .transforms import parse_static

__version__ = "0.1.0"

__all__ = [
    "ConversionInterrupted",
    "ConvertResult",
    "DecodeError",
    "DlstoreError",
    "SourceError",
    "StoreBusyError",
    "StoreCorruptError",
    "StoreDataset",
    "StoreExistsError",
    "TransformSpecError",
    "UnknownFormatError",
    "convert",
    "open_dataset",
    "parse_static",
]
