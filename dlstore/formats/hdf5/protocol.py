"""``Hdf5Format``: the hdf5 package as one ``formats.protocol.Format`` object."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ...errors import DlstoreError
from ..protocol import Format, Seal
from ..integrity import SEAL_MAGIC, check_userblock_seal
from ..manifest import dumps
from ..verdicts import verdict
from .layout import COMPRESSIONS, FORMAT, FORMAT_VERSION, MANIFEST_ATTR, READER_OPTIONS, SUFFIXES
from .opening import open_readonly
from .reader import Hdf5Reader, check_seal, read_manifest
from .writer import Hdf5Writer

SIGNATURE = b"\x89HDF\r\n\x1a\n"
# What dlstore writes inside an HDF5 file: its datasets and groups, and the root's attributes.
STORE_NAME = re.compile(r"images|labels|crc32|shapes|targets|provenance(/[a-z]+)?")
ROOT_ATTRS = (MANIFEST_ATTR,)


class Hdf5Format(Format):
    """HDF5 stores: one ``.h5`` file readable with plain ``h5py``."""

    name = FORMAT
    version = FORMAT_VERSION
    suffixes = SUFFIXES
    reader_options = READER_OPTIONS
    Writer = Hdf5Writer
    Reader = Hdf5Reader
    dataset_class = "HDF5Dataset"
    title = "an HDF5 store"
    library = "HDF5"
    keeps_parts = True
    compressions = tuple(name for name in COMPRESSIONS if name != "none")

    def detect(self, path: Path) -> bool:
        if not path.is_file():
            return False
        with open(path, "rb") as f:
            head = f.read(520)
        # HDF5 looks for its signature at 0, 512, 1024, ...; dlstore's own files have a 512-byte
        # user block (the seal, see integrity) -- or its damaged remains: a sealed store is an
        # HDF5 store even when its signature is gone, so that the damage is reported as such.
        return head[:8] == SIGNATURE or head[512:520] == SIGNATURE or head.startswith(b"dlstore-seal ")

    def read_manifest(self, path: Path) -> dict[str, Any]:
        return read_manifest(Path(path))

    def check_seal(self, path: str | os.PathLike) -> Seal | None:
        return check_seal(path)

    def check_manifest_seal(self, path: str | os.PathLike) -> Seal | None:
        return None   # the manifest is an attribute inside the sealed file

    def assemble_parts(self, parts: list[Path], counts: list[int], staged: Path,
                       parts_folder: str) -> tuple[dict[str, Any], dict[str, str]]:
        from .assembly import assemble_parts

        return assemble_parts(parts, counts, staged, parts_folder)

    def write_manifest(self, staged: Path, manifest: dict[str, Any]) -> None:
        import h5py

        with h5py.File(staged, "r+") as f:
            f.attrs[MANIFEST_ATTR] = dumps(manifest)
        with open(staged, "rb+") as f:
            os.fsync(f.fileno())

    def recognises(self, path: Path) -> bool:
        if not path.is_file():
            return False
        with open(path, "rb") as f:
            head = f.read(len(SEAL_MAGIC))
        return head == SEAL_MAGIC or head[:8] == SIGNATURE

    def not_as_written(self, path: Path, *, damaged: bool) -> str | None:
        with open(path, "rb") as f:
            sealed = f.read(len(SEAL_MAGIC)) == SEAL_MAGIC
        damage = check_userblock_seal(path) if sealed else "unsealed"
        if damage is None:
            return None
        try:
            with open_readonly(path) as f:
                if not sealed and MANIFEST_ATTR not in f.attrs:
                    return "an HDF5 file without a dlstore manifest"
                additions = _additions(f)
        except (OSError, KeyError, RuntimeError, ValueError, DlstoreError) as exc:   # (h5py, on damaged metadata)
            if not sealed:
                return f"an HDF5 file dlstore cannot read ({exc})"
            return verdict(self.title, [], f"{damage}; HDF5 cannot read it ({exc})", damaged)
        return verdict(self.title, additions, None if damage == "unsealed" else damage, damaged)


def _additions(f: Any) -> list[str]:
    """The datasets, groups and attributes of an open HDF5 file that dlstore never writes."""
    found = [f"attribute {name!r} of /" for name in f.attrs if name not in ROOT_ATTRS]

    def visit(name: str, obj: Any) -> None:
        if not STORE_NAME.fullmatch(name):
            found.append(f"{'group' if hasattr(obj, 'keys') else 'dataset'} /{name}")
        found.extend(f"attribute {key!r} of /{name}" for key in obj.attrs)

    f.visititems(visit)
    return found
