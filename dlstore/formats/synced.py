"""Writes that survive a crash: files fsynced before a store is published, and the per-sample
integers a resumable conversion appends at each checkpoint (PartialRows)."""

from __future__ import annotations

import hashlib
import os
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArgumentError, StoreCorruptError


def sha256_file(path: Path) -> str:
    """sha256 hex digest of a file's bytes, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (a store is published only after this)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(folder: Path) -> None:
    """fsync a folder, so the entries created or renamed in it survive a crash."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_npy_synced(path: Path, array: Any) -> str:
    """``np.save`` (never pickled) + fsync; return the file's sha256 for the manifest."""

    with open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    return sha256_file(path)


class PartialRows:
    """Rows of ``width`` int64 values saved beside a staging store, one checkpoint at a time.

    A writer keeps per-sample integers (a label; C, H, W; ...) in memory as a flat
    ``array('q')``, ``width`` values per sample. At each checkpoint ``append``
    writes the rows not saved yet and fsyncs them; on resume ``restore`` reads
    back the rows the checkpoint counts and cuts off any written after it.

    File layout (no header; the file never leaves the machine that writes it)::

        row r: int64 x width, native byte order   np.fromfile(path, np.int64).reshape(-1, width)
    """

    ITEMSIZE = 8

    def __init__(self, path: Path, width: int = 1):
        self.path = Path(path)
        self.width = int(width)
        self.saved = 0  # rows already in the file

    def append(self, values: array, rows: int) -> None:
        """Write rows ``[saved, rows)`` of ``values`` (flat, ``width`` per row) and fsync them."""
        if not self.saved <= rows <= len(values) // self.width:
            raise ArgumentError(f"{self.path}: cannot save up to row {rows}: {self.saved} rows are saved and "
                                f"{len(values) // self.width} held; rows must lie between the two")
        with open(self.path, "ab") as f:
            f.write(memoryview(values)[self.saved * self.width:rows * self.width])
            f.flush()
            os.fsync(f.fileno())
        self.saved = rows

    def restore(self, rows: int) -> array:
        """The first ``rows`` rows (flat), after truncating the file to them.

        A missing file is created empty when ``rows`` is 0 (a checkpoint before any
        row); a file holding fewer rows raises StoreCorruptError.
        """
        size = rows * self.width * self.ITEMSIZE
        try:
            with open(self.path, "r+b") as f:
                data = f.read(size)
                if len(data) == size:
                    f.truncate(size)  # rows appended after the checkpoint
        except FileNotFoundError:
            if rows:
                raise StoreCorruptError(f"{self.path}: missing, but the checkpoint counts {rows} rows; "
                                        "rerun without --resume to start over") from None
            self.path.touch()
            data = b""
        if len(data) < size:
            raise StoreCorruptError(
                f"{self.path}: holds {len(data) // (self.width * self.ITEMSIZE)} rows of {self.width} int64, "
                f"the checkpoint counts {rows}; rerun without --resume to start over")
        values = array("q")
        values.frombytes(data)
        self.saved = rows
        return values

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
