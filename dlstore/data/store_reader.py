"""A dataset's reader: the format's Reader, opened with the dataset's reader options and integrity mode.

``open_reader`` checks ``reader_options`` against the options the format declares
(``reader_options`` of its ``Format``), applies ``check`` (``"open"``: the data file's seal
before the C library sees it, each shards file's sha256 when first mapped; ``"sample"``: every
record against its CRC32), and wraps the Reader of an encoded store in a ``DecodingReader``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import formats
from ..errors import (
    ArgumentError,
    ArgumentTypeError,
    StoreCorruptError,
)
from ..formats.encoding import DecodingReader

CHECKS = ("none", "open", "sample")


def check_mode(check: Any) -> str:
    """``check`` if it is one of CHECKS, else ArgumentError."""
    if check not in CHECKS:
        raise ArgumentError(f"check must be one of {', '.join(CHECKS)}, got {check!r}")
    return check


def open_reader(path: Path, fmt: str, reader_options: dict[str, Any] | None, check: str) -> Any:
    """The Reader of the ``fmt`` store at ``path`` (a DecodingReader over it for an encoded store)."""
    store_format = formats.get_format(fmt)
    if reader_options is not None and not isinstance(reader_options, dict):
        raise ArgumentTypeError(f"reader_options must be a dict of keyword options, got "
                                f"{type(reader_options).__name__} {reader_options!r}")
    options = dict(reader_options or {})
    unknown = sorted(set(options) - set(store_format.reader_options))
    if unknown:
        valid = ", ".join(f"{name}: {', '.join(formats.get_format(name).reader_options) or 'none'}"
                          for name in formats.names())
        raise ArgumentError(f"{path}: reader_options {unknown} do not apply to {fmt} stores "
                            f"(options per format: {valid})")
    seal = store_format.check_seal(path) if check == "open" else None
    if seal is not None:
        _check_sealed(seal)  # before the file reaches the C library (LMDB, HDF5)
    reader = store_format.Reader(path, **options)
    if check == "open" and hasattr(reader, "check_files"):
        reader.check_files = True   # shards: each file's sha256, when first mapped
    if check == "sample":
        reader.enable_sample_check()   # every record read is checked against its CRC32
    if reader.manifest["sample"]["encoding"] != "raw":  # JPEG/PNG records, decoded with PIL on read
        reader = DecodingReader(reader)
    return reader


def _check_sealed(seal: tuple[Path, str | None]) -> None:
    """check="open" on a store with a sealed data file (LMDB/HDF5): StoreCorruptError unless it matches."""
    data, problem = seal
    if problem == "unsealed":
        raise StoreCorruptError(f"{data}: has no seal (written before dlstore sealed stores), so "
                                "check='open' cannot check it; run dlstore verify on it, or convert it again")
    if problem is not None:
        raise StoreCorruptError(f"{data}: damaged (every sample it holds is suspect): {problem}; "
                                "convert again or restore a copy")

