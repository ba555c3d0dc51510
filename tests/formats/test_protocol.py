"""The ``Format`` protocol: each format package implements it in full, and what it declares is true.

Each declaration is checked against the format itself (its Writer's signature, the files a
converted store holds, the format's own library), not against a copy of the declaration.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import h5py
import lmdb
import pytest

import dlstore
from dlstore import formats
from dlstore.errors import ArgumentError, UnknownFormatError
from dlstore.formats.protocol import FIELDS, Format

SUFFIX = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}


@pytest.fixture(scope="module")
def stores(rgb_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("protocol")
    return {name: dlstore.convert(rgb_folder, root / f"s{SUFFIX[name]}", static="resize=16,center_crop=16",
                                  workers=0, progress=False).path for name in formats.names()}


def _writer_keywords(fmt: Format) -> set[str]:
    params = inspect.signature(fmt.Writer.__init__).parameters
    return {name for name, p in params.items() if p.kind == p.KEYWORD_ONLY}


def test_a_format_missing_part_of_the_protocol_cannot_be_made():
    members = {name: getattr(formats.get_format("shards"), name) for name in (
        "name", "version", "suffixes", "reader_options", "Writer", "Reader", "dataset_class", "title", "library")}

    class Partial(Format):   # no detection, manifest, seals or ownership
        locals().update(members)

    with pytest.raises(TypeError, match="abstract"):
        Partial()


@pytest.mark.parametrize("name", ["shards", "lmdb", "hdf5"])
def test_the_registry_returns_each_format_whole(name):
    fmt = formats.get_format(name)
    assert isinstance(fmt, Format) and fmt.name == name and fmt is formats.get_format(name)
    assert {s: name for s in fmt.suffixes} == {s: n for s, n in formats.SUFFIXES.items() if n == name}
    assert formats.format_for_destination(f"x{fmt.suffixes[0]}") == name
    assert getattr(dlstore, fmt.dataset_class).FORMAT == name   # the public class it names
    assert set(fmt.reader_options) <= set(inspect.signature(fmt.Reader.__init__).parameters)
    assert fmt.fields == FIELDS == ("image", "target")


def test_an_unknown_name_is_refused_with_the_valid_ones():
    with pytest.raises(UnknownFormatError, match="shards, lmdb, hdf5"):
        formats.get_format("zarr")


def test_detection_tells_each_store_from_the_others(stores, tmp_path):
    for name, path in stores.items():
        claimed = [fmt.name for fmt in formats.all_formats() if fmt.detect(path)]
        assert claimed == [name], (path, claimed)
        assert [fmt.name for fmt in formats.all_formats() if fmt.recognises(path)] == [name]
        assert formats.get_format(name).not_as_written(path, damaged=False) is None
        assert type(dlstore.open_dataset(path)).__name__ == formats.get_format(name).dataset_class
    (tmp_path / "folder").mkdir()
    (tmp_path / "file.h5").write_bytes(b"not hdf5")
    for path in (tmp_path / "folder", tmp_path / "file.h5"):
        assert not any(fmt.detect(path) or fmt.recognises(path) for fmt in formats.all_formats())


def test_the_writer_takes_what_the_format_declares(tmp_path):
    for fmt in formats.all_formats():
        assert ("shard_size" in _writer_keywords(fmt)) == fmt.sized_data_files, fmt
        for compression in ("lzf", "gzip"):
            path = tmp_path / f"{fmt.name}-{compression}{fmt.suffixes[0]}"
            try:
                fmt.Writer(path, shape=(3, 4, 4), compression=compression).close()
                taken = True
            except ArgumentError:
                taken = False
            assert taken == (compression in fmt.compressions), (fmt, compression)


def test_seals_and_checksums_are_where_the_format_says(stores):
    for name, path in stores.items():
        fmt = formats.get_format(name)
        manifest = fmt.read_manifest(path)
        assert manifest["format"] == name and manifest["format_version"] == fmt.version
        recorded = set(manifest["checksums"]["files"])
        data_files = {p.name for p in path.iterdir()} if path.is_dir() else set()
        assert (recorded <= data_files) == fmt.file_checksums, (name, recorded)   # a sha256 per data file
        for check in (fmt.check_seal, fmt.check_manifest_seal):
            seal = check(path)
            assert seal is None or (seal[0].is_file() and seal[1] is None), (name, check, seal)
        assert (fmt.check_seal(path) is None) == (fmt.library == "numpy")   # no C library to protect


def test_the_library_named_reads_the_data_file(stores):
    open_with = {"HDF5": lambda p: h5py.File(p, "r").close(),
                 "LMDB": lambda p: lmdb.open(str(p), readonly=True, lock=False).close()}
    for name, path in stores.items():
        fmt = formats.get_format(name)
        if fmt.library in open_with:
            open_with[fmt.library](path)
        else:
            assert fmt.library == "numpy" and json.loads((path / "manifest.json").read_text())["format"] == name


def test_only_formats_that_move_their_parts_assemble_them(tmp_path):
    for fmt in formats.all_formats():
        overridden = type(fmt).assemble_parts is not Format.assemble_parts
        assert overridden != fmt.merges_parts, fmt
        assert (type(fmt).write_manifest is not Format.write_manifest) == overridden, fmt
        if fmt.merges_parts:
            with pytest.raises(NotImplementedError):
                fmt.assemble_parts([], [], tmp_path / "x", "x.parts")


def test_detecting_a_shards_store_imports_no_other_format(stores):
    # Detection asks the formats in registry order and imports each only when it is asked: a shards
    # store's readers (and their worker processes) never pay for importing h5py or lmdb.
    code = ("import sys, dlstore; ds = dlstore.open_dataset(sys.argv[1]); ds[0]; "
            "print(sorted(m for m in ('h5py', 'lmdb') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(stores["shards"])], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
