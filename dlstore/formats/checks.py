"""What a reader checks before it trusts a request or a store's metadata: indices, samples, the
output batch, the file names a manifest gives, a C library's errors."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArgumentError, DlstoreError, SampleIndexError, StoreCorruptError

# --- sample indices ----------------------------------------------------------------------
# Readers take positions 0..count-1 only: a negative index is refused like any other
# out-of-range one (SampleIndexError, an IndexError), never wrapped and never taken for
# damage. Python's negative indexing belongs to the Dataset (StoreDataset wraps, as a
# sequence does, then calls the reader with the position).

def check_index(path: Path, i: int, count: int) -> int:
    """``i`` as an int if ``0 <= i < count``, else SampleIndexError naming the store."""
    i = int(i)
    if not 0 <= i < count:
        raise SampleIndexError(f"{path}: index {i} out of range for a store of {count} samples "
                               f"(readers take 0..{count - 1}; negative indices are refused)")
    return i


def check_indices(path: Path, indices: Any, count: int) -> Any:
    """``indices`` as a flat int64 array, all within ``0..count-1``, else SampleIndexError."""

    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    if len(indices) and (indices.min() < 0 or indices.max() >= count):
        check_index(path, indices[(indices < 0) | (indices >= count)][0], count)
    return indices


def check_sample(where: Path, sample: np.ndarray, shape: tuple[int, ...] | None) -> None:
    """ArgumentError unless ``sample`` is a uint8 (C, H, W) array of the store's ``shape`` (None: any)."""
    if sample.dtype != np.uint8 or sample.ndim != 3:
        raise ArgumentError(f"{where}: sample must be a uint8 (C, H, W) array, got {sample.dtype} {sample.shape}")
    if shape is not None and tuple(sample.shape) != shape:
        raise ArgumentError(f"{where}: sample shape {tuple(sample.shape)} != store shape {shape}; "
                            "every sample of a fixed-shape store has its shape")


def batch_out(out: Any, n: int, shape: tuple[int, ...]) -> Any:
    """The (n, *shape) uint8 array a reader's ``get_batch`` fills: ``out`` checked, or a new one."""

    if out is None:
        return np.empty((n, *shape), dtype=np.uint8)
    if out.shape != (n, *shape) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ArgumentError(f"out must be a C-contiguous uint8 array of shape {(n, *shape)}, "
                            f"got {out.dtype} {out.shape}{'' if out.flags.c_contiguous else ' (not C-contiguous)'}; "
                            "pass out=None to get a new array")
    return out


@contextlib.contextmanager
def library_errors_as_damage(path: Path, errors: tuple[type[BaseException], ...] = (OSError, KeyError, RuntimeError)):
    """A C library's own errors while reading a published store's metadata (h5py: OSError "incorrect
    metadata checksum", KeyError "Unable to open object") mean a damaged file: StoreCorruptError naming it."""
    try:
        yield
    except DlstoreError:
        raise
    except errors as exc:
        raise StoreCorruptError(f"{path}: damaged: the library reports {type(exc).__name__}: {exc}; run dlstore "
                                "verify, then convert the store again or restore a copy") from exc


def safe_member(store: Path, name: Any) -> Path:
    """Path of a file a manifest names, refused if it could escape the store."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") \
            or "\x00" in name:
        raise StoreCorruptError(f"{store}: manifest names an unsafe file {name!r} (must be a plain name)")
    return store / name
