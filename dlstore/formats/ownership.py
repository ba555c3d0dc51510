"""Is what stands at a path a store dlstore wrote? ``overwrite`` replaces only that.

A conversion with ``overwrite=True`` renames the old store aside and deletes it,
so it must never take a user's folder, file or source images for a store. A
store is recognised by what only dlstore puts there, and a store folder must
hold nothing else (a file someone saved into it is theirs)::

    shards   a folder of shards entries only, with manifest.json carrying the
             "dlstore_manifest" field, or manifest.json.sha256 (the manifest damaged)
    lmdb     a folder of data.mdb (+ its seal data.mdb.sha256, lock.mdb) only, whose environment has the key
             __dlstore__
    hdf5     a file that starts with the dlstore seal (whole or damaged), or an
             HDF5 file whose root has the attribute "dlstore" (an unsealed store)

Anything else, symbolic links included (replacing one would leave its target
in place and the link gone), gets a description that the error shows.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..errors import DlstoreError
from .hdf5_open import open_readonly
from .integrity import SEAL_MAGIC

# Every name a shards store folder holds (see shards/layout.py).
_SHARDS_ENTRY = re.compile(
    r"manifest\.json(\.sha256)?|labels\.npy|targets\.npy|index\.npy|crc32\.npy"
    r"|shard-\d{5,}\.npy|data-\d{5,}\.bin|provenance-[a-z]+\.npy")
_LMDB_ENTRY = re.compile(r"data\.mdb(\.sha256)?|lock\.mdb")
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_SHOWN = 4   # foreign entries named in a message


def not_a_store(path: Path) -> str | None:
    """None where ``path`` holds a dlstore store (of any format), else what is there instead."""
    path = Path(path)
    if path.is_symlink():
        return f"a symbolic link (to {os.readlink(path)}); give the real path, or remove the link yourself"
    if path.is_dir():
        return _folder(path)
    if path.is_file():
        return _file(path)
    return "something that is neither a file nor a folder" if path.exists() else None


def _folder(path: Path) -> str | None:
    names = sorted(os.listdir(path))
    if not names:
        return "an empty folder (not one dlstore wrote); remove it yourself (rmdir) or choose another destination"
    if "manifest.json" in names or "manifest.json.sha256" in names:
        kind, entry, marked = "shards", _SHARDS_ENTRY, _shards_marked(path, names)
    elif "data.mdb" in names:
        kind, entry, marked = "lmdb", _LMDB_ENTRY, _lmdb_marked(path)
    else:
        return f"a folder that is not a dlstore store (it holds {_listing(names)})"
    foreign = [n for n in names if not entry.fullmatch(n)]
    if foreign:
        return (f"a {kind} store folder that also holds entries dlstore did not write ({_listing(foreign)}); "
                "move them out first")
    if marked is not True:
        return marked or f"a folder of {kind}-like files without a dlstore manifest"
    return None


def _shards_marked(path: Path, names: list[str]) -> bool | str:
    if "manifest.json.sha256" in names:
        return True   # only dlstore writes it: the store is ours even if manifest.json is damaged
    try:
        manifest = json.loads((path / "manifest.json").read_bytes())
    except (OSError, ValueError):
        return "a folder whose manifest.json is not a readable dlstore manifest"
    return isinstance(manifest, dict) and "dlstore_manifest" in manifest


def _lmdb_marked(path: Path) -> bool | str:
    import lmdb

    from ._lmdb_env import shared
    from .lmdb import MANIFEST_KEY
    try:   # this process's environment if a reader has one open (py-lmdb allows one open per process)
        with shared(path, readahead=False).begin() as txn:
            return txn.get(MANIFEST_KEY) is not None or "an LMDB database without a dlstore manifest"
    except (lmdb.Error, DlstoreError) as exc:
        return f"an LMDB environment dlstore cannot read ({exc})"


def _file(path: Path) -> str | None:
    with open(path, "rb") as f:
        head = f.read(len(SEAL_MAGIC))
    if head == SEAL_MAGIC:
        return None
    if head[:8] != _HDF5_SIGNATURE:
        size = path.stat().st_size
        return f"a file that is not a dlstore store ({size:,} bytes)"
    try:
        with open_readonly(path) as f:
            return None if "dlstore" in f.attrs else "an HDF5 file without a dlstore manifest"
    except (OSError, DlstoreError) as exc:
        return f"an HDF5 file dlstore cannot read ({exc})"


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
