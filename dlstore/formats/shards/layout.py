"""Memory-mapped tensor shards: a folder of ``.npy`` files readable with plain numpy.

On-disk layout of ``NAME.shards/`` (format version 1)::

    manifest.json          the store manifest (see dlstore.manifest)
    manifest.json.sha256   its sha256 (sha256sum format): every other file's digest is in the manifest
    labels.npy             int64 (N,)                      label of sample i; -1 if unlabelled
    targets.npy            int64 or float32 (N, K)         target vector of sample i (stores of target
                                                           vectors only; their labels are -1, see targets)
    # fixed-shape store (the static spec fixes (C, H, W)):
    shard-00000.npy        uint8 (k, C, H, W)              samples [0, k)
    shard-00001.npy        uint8 (k, C, H, W)              samples [k, 2k) ... last one shorter
    # variable-shape store:
    data-00000.bin         raw uint8 bytes, samples back to back, each C*H*W in CHW order
    index.npy              int64 (N, 5): file number, byte offset, C, H, W of sample i
    crc32.npy              uint32 (N,): CRC32 of sample i's bytes (see integrity, check="sample")

Why this layout:
  * ``.npy`` with a plain uint8 dtype: ``numpy.load(f, mmap_mode="r")`` maps it
    with no copy and no pickle; sample i is a view into the page cache.
  * ``k = shard_size // sample_bytes`` samples per shard (default ~1 GiB), so a
    shard is a unit of checksum, of copy and of resume.
  * the ``.npy`` header is reserved at a fixed 128 bytes so the last shard's
    sample count can be written once it is known, without moving the data; the
    data thus starts 64-byte aligned.
  * variable shapes go to flat ``.bin`` files plus an int64 index: no per-sample
    file, no pickle, one ``memmap`` per file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import ArgumentError, StoreCorruptError

FORMAT = "shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
HEADER_BYTES = 128
DEFAULT_SHARD_SIZE = 1 << 30


def npy_header(count: int, shape: tuple[int, ...]) -> bytes:
    """A version 1.0 ``.npy`` header for uint8 ``(count, *shape)``, padded to HEADER_BYTES."""
    full = (count, *shape)
    text = "{'descr': '|u1', 'fortran_order': False, 'shape': (%s), }" % (
        ", ".join(str(d) for d in full) + ("," if len(full) == 1 else "")
    )
    prefix = b"\x93NUMPY\x01\x00"
    body_len = HEADER_BYTES - len(prefix) - 2
    if len(text) + 1 > body_len:
        raise ArgumentError(f"sample shape {shape} too long for a {HEADER_BYTES}-byte npy header; "
                            "resize samples to a smaller (C, H, W)")
    body = text.ljust(body_len - 1).encode("latin1") + b"\n"
    return prefix + body_len.to_bytes(2, "little") + body


def load_npy(path: Path, mmap: bool) -> np.ndarray:
    try:
        # "c" (copy-on-write): zero-copy like "r", but torch.from_numpy accepts it without a
        # non-writable warning; nothing is ever written back to the file.
        return np.load(path, mmap_mode="c" if mmap else None, allow_pickle=False)
    except FileNotFoundError:
        raise StoreCorruptError(f"{path}: missing data file named in the manifest") from None
    except Exception as exc:
        # tokenize.TokenError, EOFError, ... on damaged files; all mean the same to the user.
        raise StoreCorruptError(f"{path}: unreadable .npy file ({type(exc).__name__}: {exc})") from exc


SUFFIXES = (".shards",)
READER_OPTIONS = ("readahead", "willneed")   # keyword options of Reader, see open_dataset(reader_options=)
