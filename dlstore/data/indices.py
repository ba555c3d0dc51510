"""A dataset's indices follow Python's sequence rules; a store's readers take positions only.

``ds[-1]`` is the last sample, as for a list; the readers (``formats/reader.py``) take
0..N-1 and refuse anything else, so the dataset wraps negative indices before it asks.
Out-of-range and non-integer indices are errors naming the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArgumentTypeError, SampleIndexError


def sample_index(path: Path, i: Any, n: int) -> int:
    """``i`` as a position 0..n-1 of the dataset of ``n`` samples at ``path`` (negatives wrapped)."""
    if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
        raise ArgumentTypeError(f"{path}: sample index must be an int, got {type(i).__name__} {i!r}")
    given = i = int(i)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise SampleIndexError(f"{path}: index {given} out of range for a dataset of {n} samples "
                               f"(valid: -{n}..{n - 1})")
    return i


def sample_indices(path: Path, indices: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    """``sample_index`` for a whole batch, vectorised: a flat int64 array of positions."""
    given = np.asarray(indices)
    if given.size and given.dtype.kind not in "iu":
        raise ArgumentTypeError(f"{path}: sample indices must be ints, got {given.dtype} "
                                f"({given.reshape(-1)[:4].tolist()}...)")
    idx = given.astype(np.int64, copy=False).reshape(-1)
    idx = np.where(idx < 0, idx + n, idx)
    bad = (idx < 0) | (idx >= n)
    if bad.any():
        raise SampleIndexError(f"{path}: index {int(given.reshape(-1)[np.argmax(bad)])} out of range for a "
                               f"dataset of {n} samples (valid: -{n}..{n - 1})")
    return idx
