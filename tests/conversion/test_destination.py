"""What a conversion may replace: ``overwrite`` takes only a store dlstore wrote, and the
destination never is, contains or lies inside the source. Each refusal is checked against the
filesystem: every byte that was there before is there after, and nothing new appears."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import h5py
import lmdb
import numpy as np
import pytest
import torch
from _helpers import LastItemDoes
from click.testing import CliRunner

import dlstore
from dlstore.cli import main
from dlstore.errors import NotAStoreError, StoreExistsError
from dlstore.formats.ownership import not_a_store
from dlstore.sources.demo import make_image_folder

FORMATS = ["shards", "lmdb", "hdf5"]


@pytest.fixture
def imgs(tmp_path):
    return make_image_folder(tmp_path / "imgs", classes=2, per_class=3, size=(20, 16))


def snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` (the root included) with its sha256, "dir" or the link target."""
    out = {}
    for path in [root, *sorted(root.rglob("*"))]:
        key = str(path.relative_to(root.parent))
        if path.is_symlink():
            out[key] = "link:" + os.readlink(path)
        elif path.is_dir():
            out[key] = "dir"
        else:
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def convert_api(src, dst, fmt, **kw):
    dlstore.convert(src, dst, store_format=fmt, overwrite=True, workers=0, progress=False, **kw)


def convert_cli(src, dst, fmt, **kw):
    result = CliRunner().invoke(main, ["convert", str(src), str(dst), "--format", fmt, "--overwrite",
                                       "--workers", "0", "--quiet"])
    assert result.exit_code == 2, result.output
    raise NotAStoreError(result.output)   # the message, for the same assertions as the API's


@pytest.fixture(params=["api", "cli"])
def run(request):
    return convert_api if request.param == "api" else convert_cli


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_folder_that_is_not_a_store_is_refused(imgs, tmp_path, run, fmt):
    mydata = tmp_path / "mydata"
    mydata.mkdir()
    (mydata / "notes.txt").write_text("precious")
    before = snapshot(tmp_path)
    with pytest.raises(NotAStoreError, match=r"replaces only a dlstore store.*notes\.txt"):
        run(imgs, mydata, fmt)
    assert snapshot(tmp_path) == before   # no staging, no lock file, nothing moved aside


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_source_itself_is_refused(imgs, tmp_path, run, fmt):
    before = snapshot(tmp_path)
    with pytest.raises(NotAStoreError, match="is the source itself"):
        run(imgs, imgs, fmt)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_parent_of_the_source_is_refused(tmp_path, run, fmt):
    parent = tmp_path / "parent"
    src = make_image_folder(parent / "src", classes=2, per_class=2, size=(12, 12))
    (parent / "other.txt").write_text("also precious")
    before = snapshot(tmp_path)
    with pytest.raises(NotAStoreError, match="contains the source"):
        run(src, parent, fmt)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["inner.shards", "inner.lmdb", "inner.h5", "class_00/inner.shards"])
def test_a_store_inside_the_scanned_source_folder_is_refused(imgs, tmp_path, run, name):
    fmt = {".shards": "shards", ".lmdb": "lmdb", ".h5": "hdf5"}[Path(name).suffix]
    before = snapshot(tmp_path)
    with pytest.raises(NotAStoreError, match="lies inside the source folder"):
        run(imgs, imgs / name, fmt)
    assert snapshot(tmp_path) == before   # no store, no staging, no lock file among the images


def test_a_store_beside_its_list_file_is_fine_but_not_the_list_itself(imgs, tmp_path):
    listing = imgs / "train.csv"
    listing.write_text("".join(f"{p.relative_to(imgs)},{i % 2}\n" for i, p in enumerate(sorted(imgs.rglob("*.jpg")))))
    dst = imgs / "train.shards"   # inside the list's folder: the list names its files, nothing scans the folder
    dlstore.convert(listing, dst, workers=0, progress=False)
    assert len(dlstore.open_dataset(dst)) == 6
    before = snapshot(tmp_path)
    with pytest.raises(NotAStoreError, match="is the source itself"):
        dlstore.convert(listing, listing, store_format="hdf5", overwrite=True, workers=0, progress=False)
    with pytest.raises(NotAStoreError, match="contains the source"):
        dlstore.convert(listing, imgs, store_format="lmdb", overwrite=True, workers=0, progress=False,
                        root=tmp_path)
    assert snapshot(tmp_path) == before


def _plain_hdf5(path: Path) -> None:
    with h5py.File(path, "w") as f:
        f["images"] = np.arange(12, dtype=np.uint8).reshape(1, 1, 3, 4)
        f.attrs["author"] = "me"


def _plain_lmdb(path: Path) -> None:
    env = lmdb.open(str(path), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"0", b"my sample")
    env.close()


@pytest.mark.parametrize("case", ["plain-hdf5", "plain-lmdb", "plain-file", "symlink-to-store",
                                  "store-with-a-user-file", "lmdb-store-with-a-user-file"])
def test_foreign_things_under_store_names_are_refused(imgs, tmp_path, run, case):
    if case == "plain-hdf5":
        dst, fmt = tmp_path / "mine.h5", "hdf5"
        _plain_hdf5(dst)
        why = "HDF5 file without a dlstore manifest"
    elif case == "plain-lmdb":
        dst, fmt = tmp_path / "mine.lmdb", "lmdb"
        _plain_lmdb(dst)
        why = "LMDB database without a dlstore manifest"
    elif case == "plain-file":
        dst, fmt = tmp_path / "mine.h5", "hdf5"
        dst.write_bytes(b"my own bytes")
        why = "file that is not a dlstore store"
    elif case == "symlink-to-store":
        real = tmp_path / "real.lmdb"
        dlstore.convert(imgs, real, workers=0, progress=False)
        dst, fmt = tmp_path / "link.lmdb", "lmdb"
        dst.symlink_to(real)
        why = "symbolic link"
    else:
        fmt = "shards" if case == "store-with-a-user-file" else "lmdb"
        dst = tmp_path / f"store.{fmt}"
        dlstore.convert(imgs, dst, workers=0, progress=False)
        (dst / "my-results.csv").write_text("epoch,acc\n1,0.9\n")
        why = r"also holds entries dlstore did not write \(my-results\.csv\)"
    before = snapshot(tmp_path)
    with pytest.raises(NotAStoreError, match=why):
        run(imgs, dst, fmt)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["fixed", "variable", "jpeg", "vectors"])
def test_every_kind_of_store_is_recognised_and_replaced(imgs, varsize_folder, tmp_path, fmt, kind):
    """Each layout a writer produces (the names of its files) is one ``overwrite`` recognises."""
    dst = tmp_path / f"s.{ {'shards': 'shards', 'lmdb': 'lmdb', 'hdf5': 'h5'}[fmt] }"
    if kind == "vectors":
        images = torch.randint(0, 256, (5, 3, 8, 8), dtype=torch.uint8).numpy()
        targets = np.random.default_rng(0).random((5, 3), dtype=np.float32)
        make = lambda: dlstore.convert((images, targets), dst, workers=0, progress=False, overwrite=True)  # noqa: E731
    else:
        src = varsize_folder if kind == "variable" else imgs
        static = None if kind == "variable" else "center_crop=12"
        make = lambda: dlstore.convert(src, dst, static=static, encoding="jpeg" if kind == "jpeg" else "raw",  # noqa: E731
                                       workers=0, progress=False, overwrite=True)
    make()
    assert not_a_store(dst) is None
    first = snapshot(tmp_path)
    make()                                      # replaced: the same bytes again (conversion is deterministic)
    assert snapshot(tmp_path) == first
    assert not [p for p in tmp_path.iterdir() if "dlstore-" in p.name]   # no staging, lock or old copy left


DAMAGE = {   # the file damaged, and where: past the HDF5 seal (its superblock), a page of data.mdb
    "shards": ("manifest.json", 0), "lmdb": ("data.mdb", 4096 + 64), "hdf5": (None, 600)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_damaged_store_is_replaced_only_when_said_to_be(imgs, tmp_path, run, fmt):
    """A store of ours that differs from its seal is still recognised as one, but ``overwrite=True``
    refuses it (it could hold someone's edits); ``overwrite="damaged"`` (--overwrite-damaged) replaces it."""
    dst = tmp_path / f"s.{ {'shards': 'shards', 'lmdb': 'lmdb', 'hdf5': 'h5'}[fmt] }"
    dlstore.convert(imgs, dst, workers=0, progress=False)
    name, offset = DAMAGE[fmt]
    damaged = dst if name is None else dst / name
    data = bytearray(damaged.read_bytes())
    data[offset:offset + 8] = bytes(b ^ 0xFF for b in data[offset:offset + 8])
    damaged.write_bytes(bytes(data))
    before = snapshot(tmp_path)
    with pytest.raises(NotAStoreError, match="differs from what dlstore wrote.*--overwrite-damaged"
                       if run is convert_cli else 'differs from what dlstore wrote.*overwrite="damaged"'):
        run(imgs, dst, fmt)
    assert snapshot(tmp_path) == before
    assert not_a_store(dst) is not None and not_a_store(dst, damaged=True) is None
    if run is convert_cli:
        result = CliRunner().invoke(main, ["convert", str(imgs), str(dst), "--format", fmt, "--overwrite-damaged",
                                           "--workers", "0", "--quiet"])
        assert result.exit_code == 0, result.output
    else:
        dlstore.convert(imgs, dst, workers=0, progress=False, overwrite="damaged")
    assert len(dlstore.open_dataset(dst, check="open")) == 6
    assert not_a_store(dst) is None


def test_a_destination_occupied_during_the_conversion_is_not_replaced(tmp_path):
    dst = tmp_path / "late.shards"
    with pytest.raises(NotAStoreError, match="notes.txt"):
        dlstore.convert(LastItemDoes(lambda: _occupy(dst)), dst, workers=0, progress=False, overwrite=True)
    assert (dst / "notes.txt").read_text() == "written during the conversion"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["late.shards"]


def test_without_overwrite_any_existing_path_is_refused(imgs, tmp_path):
    dst = tmp_path / "s.shards"
    dlstore.convert(imgs, dst, workers=0, progress=False)
    with pytest.raises(StoreExistsError, match="already exists") as err:
        dlstore.convert(imgs, dst, workers=0, progress=False)
    assert not isinstance(err.value, NotAStoreError)


# --- an empty folder, a read-only destination, sizes -----------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("overwrite", [False, True])
def test_an_empty_folder_at_the_destination_is_taken_saying_so(imgs, tmp_path, fmt, overwrite):
    """``mkdir out.shards`` first, then convert: the folder, empty, is used (as --overwrite would agree)."""
    dst = tmp_path / f"out.{ {'shards': 'shards', 'lmdb': 'lmdb', 'hdf5': 'h5'}[fmt] }"
    dst.mkdir()
    messages: list[str] = []
    dlstore.convert(imgs, dst, workers=0, progress=False, overwrite=overwrite, log=messages.append)
    assert messages == [f"{dst}: an empty folder; the store takes its place (the folder is removed, being empty)"]
    assert len(dlstore.open_dataset(dst)) == 6 and not_a_store(dst) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imgs", dst.name]


def test_the_command_line_takes_an_empty_folder_too(imgs, tmp_path):
    dst = tmp_path / "out.shards"
    dst.mkdir()
    result = CliRunner().invoke(main, ["convert", str(imgs), str(dst), "--workers", "0", "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"{dst}: an empty folder; the store takes its place")
    assert len(dlstore.open_dataset(dst)) == 6


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_empty_folder_filled_during_the_conversion_is_kept(tmp_path, overwrite):
    dst = tmp_path / "out.shards"
    dst.mkdir()
    with pytest.raises(StoreExistsError, match="notes.txt" if overwrite else "already exists"):
        dlstore.convert(LastItemDoes(lambda: (dst / "notes.txt").write_text("saved during the conversion")), dst, workers=0, progress=False, overwrite=overwrite)
    assert os.listdir(dst) == ["notes.txt"] and (dst / "notes.txt").read_text() == "saved during the conversion"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.shards"]


@pytest.fixture
def read_only(tmp_path):
    """A real read-only filesystem (a tmpfs mounted ro): root writes anywhere else."""
    import subprocess

    mnt = tmp_path / "ro"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or 'mount refused'})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("where", ["out.shards", "sub/out.h5"])
def test_a_read_only_destination_is_a_dlstore_error_naming_it(imgs, read_only, where):
    dst = read_only / where
    with pytest.raises(dlstore.StoreWriteError, match="Read-only file system") as err:
        dlstore.convert(imgs, dst, workers=0, progress=False)
    assert str(err.value).startswith(f"{dst}: cannot write in ") and "writable filesystem" in str(err.value)
    assert isinstance(err.value, OSError)
    result = CliRunner().invoke(main, ["convert", str(imgs), str(dst), "--workers", "0", "--quiet"])
    assert result.exit_code == 2 and result.output.startswith(f"error: {dst}: cannot write in "), result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert os.listdir(read_only) == []


def test_shard_size_takes_the_command_lines_sizes(imgs, tmp_path):
    """``shard_size="8MiB"`` means what ``--shard-size 8MiB`` means; the stores are the same."""
    api = tmp_path / "api.shards"
    dlstore.convert(imgs, api, static="center_crop=12", shard_size="1KiB", workers=0, progress=False)
    result = CliRunner().invoke(main, ["convert", str(imgs), str(tmp_path / "cli.shards"), "--static",
                                       "center_crop=12", "--shard-size", "1KiB", "--workers", "0", "--quiet"])
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in api.iterdir())
    assert len([n for n in names if n.startswith("shard-")]) == 3           # 1024 B / 432 B a sample: 2 each
    assert snapshot(api).values() and {n: snapshot(api)[f"api.shards/{n}"] for n in names} == \
        {n: snapshot(tmp_path / "cli.shards")[f"cli.shards/{n}"] for n in names}
    with pytest.raises(dlstore.ArgumentError, match="shard_size='lots'"):
        dlstore.convert(imgs, tmp_path / "x.shards", shard_size="lots", workers=0, progress=False)
    result = CliRunner().invoke(main, ["convert", str(imgs), str(tmp_path / "x.shards"), "--shard-size", "lots"])
    assert result.exit_code == 2 and "error: --shard-size lots: 'lots' is not a size" in result.output, result.output


def _occupy(dst: Path) -> None:
    """A user folder appears at ``dst`` during the conversion."""
    dst.mkdir()
    (dst / "notes.txt").write_text("written during the conversion")
