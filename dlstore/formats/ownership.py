"""Is what stands at a path a store dlstore wrote, byte for byte? ``overwrite`` replaces only that.

A conversion with ``overwrite=True`` renames the old store aside and deletes it,
so it must never take a user's folder, file or source images for a store. A
store is recognised by what only dlstore puts there (each format's ``Format.recognises``),
and a store folder must hold nothing else (a file someone saved into it is theirs)::

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
Where it does not, the file is searched for what dlstore never writes (each format's
``Format.not_as_written``, in its package, knows its names)::

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

import os
from pathlib import Path

from . import all_formats
from .verdicts import listing


def not_a_store(path: Path, *, damaged: bool = False) -> str | None:
    """None where ``path`` holds a dlstore store (of any format) exactly as dlstore wrote it, else what
    is there instead. ``damaged``: a store that differs from its seal, holding nothing dlstore can
    name as someone's addition, counts as one (``overwrite="damaged"``)."""
    path = Path(path)
    if path.is_symlink():
        return f"a symbolic link (to {os.readlink(path)}); give the real path, or remove the link yourself"
    if not (path.is_dir() or path.is_file()):
        return "something that is neither a file nor a folder" if path.exists() else None
    names = sorted(os.listdir(path)) if path.is_dir() else []
    if path.is_dir() and not names:
        return "an empty folder (not one dlstore wrote); remove it yourself (rmdir) or choose another destination"
    for fmt in all_formats():
        if fmt.recognises(path):
            return fmt.not_as_written(path, damaged=damaged)
    if path.is_dir():
        return f"a folder that is not a dlstore store (it holds {listing(names)})"
    return f"a file that is not a dlstore store ({path.stat().st_size:,} bytes)"


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
