"""Format registry: name -> module holding that format's Writer, Reader and manifest reader.

Each format module provides ``FORMAT``, ``FORMAT_VERSION``, ``SUFFIXES``,
``Writer`` (fills a staging path), ``Reader`` (fetches sample i as a uint8 CHW
array; a ``reader.StoreReader``, which does the index checks, batch output and
sums for every format) and ``read_manifest(path)``. Modules are imported on first use, so
``import dlstore`` does not pay for h5py or lmdb.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

from ..errors import StoreNotFoundError, UnknownFormatError

_MODULES = {
    "shards": "dlstore.formats.shards",
    "lmdb": "dlstore.formats.lmdb",
    "hdf5": "dlstore.formats.hdf5",
}
# Destination suffix -> format, for `convert` without an explicit format and for detection.
SUFFIXES = {".shards": "shards", ".lmdb": "lmdb", ".h5": "hdf5", ".hdf5": "hdf5"}
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def names() -> list[str]:
    return list(_MODULES)


def get_format(name: str) -> ModuleType:
    """The module of format ``name``; ValueError listing the valid names otherwise."""
    if name not in _MODULES:
        raise UnknownFormatError(f"unknown store format {name!r}; valid: {', '.join(_MODULES)}")
    return importlib.import_module(_MODULES[name])


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
    if p.is_dir():
        if (p / "manifest.json").is_file():
            return "shards"
        if (p / "data.mdb").is_file():
            return "lmdb"
    elif p.is_file():
        with open(p, "rb") as f:
            head = f.read(520)
        # HDF5 looks for its signature at 0, 512, 1024, ...; dlstore's own files have a 512-byte
        # user block (the seal, see common) -- or its damaged remains: a sealed store is an
        # HDF5 store even when its signature is gone, so that the damage is reported as such.
        if head[:8] == _HDF5_SIGNATURE or head[512:520] == _HDF5_SIGNATURE or head.startswith(b"dlstore-seal "):
            return "hdf5"
        if p.name == "data.mdb":
            return "lmdb"
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
