"""The parts a distributed HDF5 store maps: present, held open, and the ones it was assembled with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...errors import StoreCorruptError
from .opening import open_readonly


def check_virtual_sources(path: Path, images: Any) -> None:
    """StoreCorruptError unless every file an HDF5 virtual dataset maps (h5py ``virtual_sources``) exists.

    A store assembled by a distributed conversion maps /images onto per-rank files next to
    it; HDF5 reads a missing one as zeros, silently, so check that they are all there.
    """
    for source in images.virtual_sources():
        name = Path(source.file_name)
        if not (name if name.is_absolute() else path.parent / name).is_file():
            raise StoreCorruptError(
                f"{path}: /images maps samples to {path.parent / name}, which is missing: the "
                f"store's per-rank files (the {name.parent} folder) must stay next to {path.name}; "
                "move or copy them together")


def hold_virtual_sources(path: Path, images: Any, layout: dict[str, Any]) -> None:
    """Have HDF5 open every source file of the virtual dataset ``images`` now (one sample of each),
    and check that they are the parts the store was assembled with (``layout``: its manifest's).

    HDF5 opens a source when a read first touches it, and reads a missing one as zeros,
    silently: a reader that has read rank 0's samples and not yet rank 1's would read zeros
    for those once an overwrite deleted the old parts folder. Opened here, they stay open
    (HDF5 keeps a virtual dataset's sources open while the dataset is), like the inodes the
    other formats' readers hold.

    HDF5 finds a source by its name, ``DST.parts/part-RRRRR.h5``, and an overwrite publishes
    the new store's parts under those names before its main file: a reader opening the old
    main file in between would read the new parts under the old labels (or fail on a shorter
    part). So each part's own manifest must hold the checksums the main file recorded for it
    (``layout["virtual"]["parts"]``), checked once the sources are held: a part swapped before
    HDF5 opened it is still swapped then. Stores assembled before these were recorded are not
    checked.
    """
    check_virtual_sources(path, images)
    virtual = layout.get("virtual", {})
    start = 0
    for part in virtual.get("parts", []):
        if int(part["count"]) > 0:
            images[start]
        start += int(part["count"])
    for part in virtual.get("parts", []):
        if int(part["count"]) > 0 and "checksums" in part \
                and _part_checksums(path, virtual, part) != part["checksums"]:
            raise _foreign_part(path, virtual, part, f"its checksums differ from those {path.name} records")


def _part_checksums(path: Path, virtual: dict[str, Any], part: dict[str, Any]) -> Any:
    """The checksums a part's own manifest records (``checksums.files``), opening it by name."""
    file = path.parent / str(virtual.get("folder")) / str(part["file"])
    try:
        with open_readonly(file) as f:   # (with the flags HDF5 holds it under as the main file's source)
            text = f.attrs.get("dlstore")
        return json.loads(text)["checksums"]["files"]
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise StoreCorruptError(f"{file}: not a readable part of {path} ({type(exc).__name__}: {exc}); convert "
                                "the store again or restore a copy of it with its parts folder") from exc


def _foreign_part(path: Path, virtual: dict[str, Any], part: dict[str, Any], why: str) -> StoreCorruptError:
    file = Path(str(virtual.get("folder"))) / str(part["file"])
    return StoreCorruptError(
        f"{path}: /images maps {file}, which is not the part this store was assembled with ({why}): the store "
        "was replaced (converted again with overwrite) while this reader opened it, and its new parts are in "
        f"place before its new {path.name}; open the store again. If this persists, {file.parent} holds another "
        "store's parts or was damaged: run dlstore verify, convert again or restore a copy")
