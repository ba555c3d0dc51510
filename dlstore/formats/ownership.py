"""Is what stands at a path a store dlstore wrote, byte for byte? ``overwrite`` replaces only that.

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

A single-file store holds a user's additions inside its file (an h5py dataset or
attribute, an LMDB key), so a recognised store must also be what dlstore wrote: its
seal (``integrity``: the sha256 of data.mdb, of the HDF5 file past its user block; of
manifest.json, and the sha256 the manifest records of each shards file) must match.
Where it does not, the file is searched for what dlstore never writes (names below)::

    what differs                             outcome
    an addition, named                       refused, always (the data is the user's)
    nothing dlstore can name (damage: a      refused, unless the caller says the store is
    flipped byte, a truncated file, an       damaged (``damaged=True``: ``overwrite="damaged"``)
    edited sample)

Checking reads the whole old store once (sha256). Anything else, symbolic links
included (replacing one would leave its target in place and the link gone), gets a
description that the error shows.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from ..errors import DlstoreError, StoreCorruptError
from .checks import safe_member
from .hdf5_open import open_readonly
from .integrity import SEAL_MAGIC, check_sidecar_seal, check_userblock_seal
from .synced import sha256_file

# Every name a shards store folder holds (see shards/layout.py).
_SHARDS_ENTRY = re.compile(
    r"manifest\.json(\.sha256)?|labels\.npy|targets\.npy|index\.npy|crc32\.npy"
    r"|shard-\d{5,}\.npy|data-\d{5,}\.bin|provenance-[a-z]+\.npy")
_LMDB_ENTRY = re.compile(r"data\.mdb(\.sha256)?|lock\.mdb")
# What dlstore writes inside an LMDB environment (besides the sample keys 0..N-1) and an HDF5 file.
_LMDB_KEY = re.compile(rb"__(dlstore|labels|shapes|crc32|targets|provenance_[a-z]+)__")
_HDF5_NAME = re.compile(r"images|labels|crc32|shapes|targets|provenance(/[a-z]+)?")
_HDF5_ROOT_ATTRS = ("dlstore",)
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_SHOWN = 4   # foreign entries named in a message
_KINDS = {"shards": "a shards store", "lmdb": "an LMDB store", "hdf5": "an HDF5 store"}


def not_a_store(path: Path, *, damaged: bool = False) -> str | None:
    """None where ``path`` holds a dlstore store (of any format) exactly as dlstore wrote it, else what
    is there instead. ``damaged``: a store that differs from its seal, holding nothing dlstore can
    name as someone's addition, counts as one (``overwrite="damaged"``)."""
    path = Path(path)
    if path.is_symlink():
        return f"a symbolic link (to {os.readlink(path)}); give the real path, or remove the link yourself"
    if path.is_dir():
        return _folder(path, damaged)
    if path.is_file():
        return _file(path, damaged)
    return "something that is neither a file nor a folder" if path.exists() else None


def signature(path: Path) -> tuple:
    """What changes whenever anything at ``path`` changes (a file's or a folder's entries' inode, size,
    mtime and ctime: the kernel sets ctime on every change, and nobody can set it back)."""
    def stat(p: Path) -> tuple:
        st = p.lstat()
        return (p.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        return (stat(path), *(stat(p) for p in sorted(path.iterdir())))
    return (stat(path),)


def _verdict(kind: str, additions: list[str], damage: str | None, damaged: bool) -> str | None:
    """What a recognised store of ``kind`` is, where overwrite may not replace it; else None."""
    if additions:
        return (f"{_KINDS[kind]} that holds data dlstore did not write ({_listing(additions)}); move that "
                "data out first, or choose another destination")
    if damage is not None and not damaged:
        return (f"{_KINDS[kind]} that differs from what dlstore wrote ({damage}), with nothing dlstore can "
                'name as added: if it is damaged, pass overwrite="damaged" (--overwrite-damaged) to replace it')
    return None


def _folder(path: Path, damaged: bool) -> str | None:
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
    if kind == "shards":
        return _verdict(kind, [], _shards_damage(path), damaged)
    return _verdict(kind, *_lmdb_contents(path), damaged)


def _shards_damage(path: Path) -> str | None:
    """None if manifest.json matches its seal and every file it records its sha256, else what differs."""
    problem = check_sidecar_seal(path / "manifest.json")
    if problem not in (None, "unsealed"):
        return f"manifest.json: {problem}"
    try:
        files = json.loads((path / "manifest.json").read_bytes())["checksums"]["files"]
        expected = {safe_member(path, name): digest for name, digest in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, StoreCorruptError) as exc:
        return f"manifest.json: no readable checksums ({type(exc).__name__})"
    for member, digest in sorted(expected.items()):
        try:
            if sha256_file(member) != digest:
                return f"{member.name}: sha256 mismatch"
        except OSError as exc:
            return f"{member.name}: unreadable ({exc.strerror or exc})"
    return None


def _lmdb_contents(path: Path) -> tuple[list[str], str | None]:
    """(keys dlstore did not write, what differs from the seal) of a recognised LMDB store."""
    import lmdb

    from ._lmdb_env import shared
    from .lmdb import MANIFEST_KEY
    damage = check_sidecar_seal(path / "data.mdb")
    if damage is None:
        return [], None
    additions: list[str] = []
    try:
        with shared(path, readahead=False).begin() as txn:
            try:
                count = int(json.loads(txn.get(MANIFEST_KEY))["count"])
            except (TypeError, ValueError, KeyError):
                count = None
            for key in txn.cursor().iternext(keys=True, values=False):
                if _LMDB_KEY.fullmatch(key) or (key.isdigit() and len(key) == 10
                                                and (count is None or int(key) < count)):
                    continue
                additions.append(f"key {key.decode('utf-8', 'backslashreplace')!r}")
    except (lmdb.Error, DlstoreError) as exc:
        return additions, f"{damage}; LMDB cannot list its keys ({exc})"
    return additions, (None if damage == "unsealed" and not additions else damage)


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


def _file(path: Path, damaged: bool) -> str | None:
    with open(path, "rb") as f:
        head = f.read(len(SEAL_MAGIC))
    sealed = head == SEAL_MAGIC
    if not sealed and head[:8] != _HDF5_SIGNATURE:
        size = path.stat().st_size
        return f"a file that is not a dlstore store ({size:,} bytes)"
    damage = check_userblock_seal(path) if sealed else "unsealed"
    if damage is None:
        return None
    try:
        with open_readonly(path) as f:
            if not sealed and "dlstore" not in f.attrs:
                return "an HDF5 file without a dlstore manifest"
            additions = _hdf5_additions(f)
    except (OSError, KeyError, RuntimeError, ValueError, DlstoreError) as exc:   # (h5py, on damaged metadata)
        if not sealed:
            return f"an HDF5 file dlstore cannot read ({exc})"
        return _verdict("hdf5", [], f"{damage}; HDF5 cannot read it ({exc})", damaged)
    return _verdict("hdf5", additions, None if damage == "unsealed" else damage, damaged)


def _hdf5_additions(f: Any) -> list[str]:
    """The datasets, groups and attributes of an open HDF5 file that dlstore never writes."""
    found = [f"attribute {name!r} of /" for name in f.attrs if name not in _HDF5_ROOT_ATTRS]

    def visit(name: str, obj: Any) -> None:
        if not _HDF5_NAME.fullmatch(name):
            found.append(f"{'group' if hasattr(obj, 'keys') else 'dataset'} /{name}")
        found.extend(f"attribute {key!r} of /{name}" for key in obj.attrs)

    f.visititems(visit)
    return found


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
