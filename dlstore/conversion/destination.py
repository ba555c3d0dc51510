"""Where a conversion writes, and what it may replace there.

A Writer fills a staging path next to the destination (``.NAME.dlstore-tmp``);
``publish`` renames it into place only when complete, so a store that exists
under its real name is a store that is whole. A lock (``lock``) makes a second
conversion to the same destination refuse instead of interleaving. With ``overwrite``, only a store
dlstore wrote is replaced (``formats.ownership``), and never the source.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import NotAStoreError, StoreExistsError
from ..formats.ownership import not_a_store, signature
from ..formats.synced import fsync_dir


def staging_path(dst: Path) -> Path:
    return dst.with_name(f".{dst.name}.dlstore-tmp")


def remove_path(path: Path) -> None:
    """Remove a file or folder tree if present."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def check_apart(dst: Path, src: Path, *, scanned: bool) -> None:
    """NotAStoreError if ``dst`` is the source ``src`` or contains it, or, for a folder that is
    scanned for images (``scanned``), lies inside it: the store would join the images (as a
    class folder) of the next conversion of that folder."""
    where, source = Path(os.path.realpath(dst)), Path(os.path.realpath(src))
    if where == source:
        problem = "is the source itself"
    elif where in source.parents:
        problem = f"contains the source {src}"
    elif scanned and source in where.parents:
        problem = (f"lies inside the source folder {src}: the store would be scanned as images of the "
                   "next conversion of that folder")
    else:
        return
    raise NotAStoreError(f"{dst}: the destination {problem}; write the store outside the source "
                         "(e.g. next to it); nothing was changed")


def check_destination(dst: Path, overwrite: bool | str, log: Callable[[str], None] | None = None, *,
                      seen: Any = None) -> Any:
    """StoreExistsError if something is at ``dst`` and it may not be replaced: ``overwrite`` is
    False, or what is there is not a dlstore store as dlstore wrote it (NotAStoreError, which says
    what it is; ``overwrite="damaged"`` also replaces a store of ours that differs from its seal).
    An empty folder is taken whatever ``overwrite`` says (``log`` says so): nothing is lost.

    Returns what was checked (``ownership.signature``); passed back as ``seen`` while ``dst`` has not
    changed since, the store's bytes are not read again.
    """
    if not (dst.exists() or dst.is_symlink()):
        return None
    if is_empty_folder(dst):
        if log is not None:
            log(f"{dst}: an empty folder; the store takes its place (the folder is removed, being empty)")
        return None
    if not overwrite:
        raise StoreExistsError(f"{dst}: already exists; pass overwrite=True (--overwrite) to replace it")
    checked = signature(dst)
    if seen is not None and checked == seen:
        return checked
    found = not_a_store(dst, damaged=overwrite == "damaged")
    if found is not None:
        raise NotAStoreError(f"{dst}: --overwrite (overwrite=True) replaces only a dlstore store, and this is "
                             f"{found}; nothing was changed")
    return checked


def is_empty_folder(path: Path) -> bool:
    try:
        return path.is_dir() and not path.is_symlink() and not any(os.scandir(path))
    except OSError:
        return False


def publish(staged: Path, dst: Path, overwrite: bool | str, *, seen: Any = None) -> None:
    """Move a complete staged store to ``dst``, replacing an old store if allowed (``seen``: what
    ``check_destination`` checked there before the conversion).

    The old store is renamed aside first and deleted after the new one is in
    place: a reader that already has the old files open keeps reading them
    (their inodes live on), and a new reader sees either the old store or the new
    one, never a mix. An empty folder is removed (``rmdir``: it fails if something arrived in it).
    """
    old = dst.with_name(f".{dst.name}.dlstore-old")
    if is_empty_folder(dst):
        try:
            os.rmdir(dst)
        except OSError:
            pass   # not empty any more: checked below like anything else there
    if dst.exists() or dst.is_symlink():
        check_destination(dst, overwrite, seen=seen)   # again: something else may have been put there meanwhile
        remove_path(old)
        os.replace(dst, old)
    os.replace(staged, dst)
    fsync_dir(dst.parent)
    remove_path(old)
