"""``LmdbFormat``: the lmdb package as one ``formats.protocol.Format`` object."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import lmdb

from ...errors import DlstoreError
from ..protocol import Format, Seal
from ..integrity import check_sidecar_seal
from ..verdicts import store_folder, verdict
from .environment import shared
from .layout import FORMAT, FORMAT_VERSION, MANIFEST_KEY, READER_OPTIONS, SUFFIXES
from .reader import LmdbReader, check_seal, read_manifest
from .writer import LmdbWriter

DATA_FILE = "data.mdb"
# Every name an LMDB store folder holds, and what dlstore writes inside the environment besides
# the sample keys 0..N-1.
STORE_ENTRY = re.compile(r"data\.mdb(\.sha256)?|lock\.mdb")
STORE_KEY = re.compile(rb"__(dlstore|labels|shapes|crc32|targets|provenance_[a-z]+)__")


class LmdbFormat(Format):
    """LMDB stores: one key per sample in an LMDB environment, readable with plain ``lmdb``."""

    name = FORMAT
    version = FORMAT_VERSION
    suffixes = SUFFIXES
    reader_options = READER_OPTIONS
    Writer = LmdbWriter
    Reader = LmdbReader
    dataset_class = "LMDBDataset"
    title = "an LMDB store"
    library = "LMDB"
    merges_parts = True

    def detect(self, path: Path) -> bool:
        if path.is_dir():
            return (path / DATA_FILE).is_file()
        return path.is_file() and path.name == DATA_FILE

    def read_manifest(self, path: Path) -> dict[str, Any]:
        return read_manifest(Path(path))

    def check_seal(self, path: str | os.PathLike) -> Seal | None:
        return check_seal(path)

    def check_manifest_seal(self, path: str | os.PathLike) -> Seal | None:
        return None   # the manifest is a key inside the sealed data file

    def merge_reader(self, part: Path) -> LmdbReader:
        """A reader of one part, for merging its records in order (read ahead: every page is read)."""
        return LmdbReader(part, readahead=True)

    def recognises(self, path: Path) -> bool:
        return path.is_dir() and DATA_FILE in os.listdir(path)

    def not_as_written(self, path: Path, *, damaged: bool) -> str | None:
        problem = store_folder(path, self.name, STORE_ENTRY, lambda names: _marked(path))
        if problem is not None:
            return problem
        return verdict(self.title, *_contents(path), damaged)


def _contents(path: Path) -> tuple[list[str], str | None]:
    """(keys dlstore did not write, what differs from the seal) of a recognised LMDB store."""
    damage = check_sidecar_seal(path / DATA_FILE)
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
                if STORE_KEY.fullmatch(key) or (key.isdigit() and len(key) == 10
                                                and (count is None or int(key) < count)):
                    continue
                additions.append(f"key {key.decode('utf-8', 'backslashreplace')!r}")
    except (lmdb.Error, DlstoreError) as exc:
        return additions, f"{damage}; LMDB cannot list its keys ({exc})"
    return additions, (None if damage == "unsealed" and not additions else damage)


def _marked(path: Path) -> bool | str:
    try:   # this process's environment if a reader has one open (py-lmdb allows one open per process)
        with shared(path, readahead=False).begin() as txn:
            return txn.get(MANIFEST_KEY) is not None or "an LMDB database without a dlstore manifest"
    except (lmdb.Error, DlstoreError) as exc:
        return f"an LMDB environment dlstore cannot read ({exc})"
