"""Format registry: name -> the ``Format`` object of that format's package (``formats.protocol``).

Each format is a package under ``formats/<name>/`` whose ``FORMAT`` implements the ``Format``
protocol in full: name, suffixes, detection, Writer, Reader, manifest and seal checks,
distributed-part assembly, what ``verify`` and ``overwrite`` need to know. Nothing outside
those packages and this registry branches on a format's name. Packages are imported on first
use, so ``import dlstore`` does not pay for h5py or lmdb.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path

from ..errors import StoreNotFoundError, UnknownFormatError
from .protocol import Format

# The one registry: format name -> its package (imported on first use).
_MODULES = {
    "shards": "dlstore.formats.shards",
    "lmdb": "dlstore.formats.lmdb",
    "hdf5": "dlstore.formats.hdf5",
}
# Destination suffix -> format, for `convert` without an explicit format and for detection; known
# without importing the packages (`dlstore convert --help`). Each Format's ``suffixes`` agree.
SUFFIXES = {".shards": "shards", ".lmdb": "lmdb", ".h5": "hdf5", ".hdf5": "hdf5"}


def names() -> list[str]:
    return list(_MODULES)


def get_format(name: str) -> Format:
    """The ``Format`` of format ``name``; ValueError listing the valid names otherwise."""
    if name not in _MODULES:
        raise UnknownFormatError(f"unknown store format {name!r}; valid: {', '.join(_MODULES)}")
    return importlib.import_module(_MODULES[name]).FORMAT


def all_formats() -> Iterator[Format]:
    """Every registered ``Format``, in registry order (which is also the order of detection), each
    imported as the iteration reaches it: detecting a shards store imports neither h5py nor lmdb."""
    return (get_format(name) for name in _MODULES)


def format_for_destination(dst: str | os.PathLike) -> str:
    """Format implied by a destination's suffix (``train.lmdb`` -> ``lmdb``)."""
    suffix = Path(dst).suffix.lower()
    if suffix not in SUFFIXES:
        raise UnknownFormatError(
            f"{dst}: cannot tell the format from the name; give one of "
            f"{', '.join(_MODULES)} (--format) or use a suffix {', '.join(SUFFIXES)}"
        )
    return SUFFIXES[suffix]


def detect_format(path: str | os.PathLike) -> str:
    """Format of an existing store, from its contents first and its suffix second."""
    p = Path(path)
    if p.is_dir() or p.is_file():
        for fmt in all_formats():
            if fmt.detect(p):
                return fmt.name
    elif not p.exists():
        raise StoreNotFoundError(f"{path}: no such store; check the path (a store is a .shards or .lmdb "
                                 "folder or an .h5 file)")
    suffix = p.suffix.lower()
    hint = f" (the name suggests {SUFFIXES[suffix]}, but its contents do not match: incomplete or damaged?)" \
        if suffix in SUFFIXES else ""
    raise UnknownFormatError(
        f"{path}: not a dlstore store; expected a shards folder with manifest.json, an LMDB "
        f"folder with data.mdb, or an HDF5 file{hint}"
    )
