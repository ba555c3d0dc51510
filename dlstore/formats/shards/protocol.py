"""``ShardsFormat``: the shards package as one ``formats.protocol.Format`` object."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from ...errors import StoreCorruptError
from ..checks import safe_member
from ..protocol import Format, Seal
from ..integrity import check_sidecar_seal, seal_sidecar
from ..manifest import dumps
from ..verdicts import store_folder, verdict
from ..synced import sha256_file, write_synced
from .layout import FORMAT, FORMAT_VERSION, MANIFEST_NAME, READER_OPTIONS, SUFFIXES
from .reader import ShardReader, check_manifest_seal, read_manifest
from .writer import ShardWriter

# Every name a shards store folder holds (see layout.py).
STORE_ENTRY = re.compile(
    r"manifest\.json(\.sha256)?|labels\.npy|targets\.npy|index\.npy|crc32\.npy"
    r"|shard-\d{5,}\.npy|data-\d{5,}\.bin|provenance-[a-z]+\.npy")


class ShardsFormat(Format):
    """Memory-mapped tensor shards: a folder of ``.npy`` files readable with plain numpy."""

    name = FORMAT
    version = FORMAT_VERSION
    suffixes = SUFFIXES
    reader_options = READER_OPTIONS
    Writer = ShardWriter
    Reader = ShardReader
    dataset_class = "ShardsDataset"
    title = "a shards store"
    library = "numpy"
    sized_data_files = True
    file_checksums = True

    def detect(self, path: Path) -> bool:
        return path.is_dir() and (path / MANIFEST_NAME).is_file()

    def read_manifest(self, path: Path) -> dict[str, Any]:
        return read_manifest(Path(path))

    def check_seal(self, path: str | os.PathLike) -> Seal | None:
        return None   # no C library reads the files: each one's sha256 is in the manifest

    def check_manifest_seal(self, path: str | os.PathLike) -> Seal | None:
        return check_manifest_seal(path)   # the manifest is the one file without a digest in it

    def assemble_parts(self, parts: list[Path], counts: list[int], staged: Path,
                       parts_folder: str) -> tuple[dict[str, Any], dict[str, str]]:
        from .assembly import assemble_parts

        return assemble_parts(parts, staged)

    def write_manifest(self, staged: Path, manifest: dict[str, Any]) -> None:
        write_synced(staged / MANIFEST_NAME, dumps(manifest).encode("utf-8"))
        seal_sidecar(staged / MANIFEST_NAME)

    def recognises(self, path: Path) -> bool:
        return path.is_dir() and bool({MANIFEST_NAME, MANIFEST_NAME + ".sha256"} & set(os.listdir(path)))

    def not_as_written(self, path: Path, *, damaged: bool) -> str | None:
        problem = store_folder(path, self.name, STORE_ENTRY, lambda names: _marked(path, names))
        if problem is not None:
            return problem
        return verdict(self.title, [], _damage(path), damaged)


def _marked(path: Path, names: list[str]) -> bool | str:
    if MANIFEST_NAME + ".sha256" in names:
        return True   # only dlstore writes it: the store is ours even if manifest.json is damaged
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_bytes())
    except (OSError, ValueError):
        return "a folder whose manifest.json is not a readable dlstore manifest"
    return isinstance(manifest, dict) and "dlstore_manifest" in manifest


def _damage(path: Path) -> str | None:
    """None if manifest.json matches its seal and every file it records its sha256, else what differs."""
    problem = check_sidecar_seal(path / MANIFEST_NAME)
    if problem not in (None, "unsealed"):
        return f"manifest.json: {problem}"
    try:
        files = json.loads((path / MANIFEST_NAME).read_bytes())["checksums"]["files"]
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
