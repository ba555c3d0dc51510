"""LMDB stores: one key per sample in an LMDB environment, readable with plain ``lmdb``.

On-disk layout of ``NAME.lmdb/`` (an LMDB environment folder, format version 1)::

    data.mdb, lock.mdb     the LMDB environment (one unnamed database)

    key (ASCII bytes)      value
    ---------------------  ----------------------------------------------------------
    b"0000000000"          sample 0: raw uint8 bytes in CHW order, C*H*W of them
    b"0000000001"          sample 1 ...                    (keys: index, 10 digits)
    ...
    b"__dlstore__"         the manifest, UTF-8 JSON (see dlstore.manifest)
    b"__labels__"          int64 little-endian (N,): label of sample i; -1 if unlabelled
    b"__shapes__"          int64 little-endian (N, 3): C, H, W of sample i
                           (variable-shape stores only; fixed-shape stores take the
                           shape from the manifest's sample.shape)
    b"__crc32__"           uint32 little-endian (N,): CRC32 of sample i's value (check="sample")
    b"__targets__"         .npy bytes of the (N, K) int64/float32 target vectors (only where converted from them)

Why this layout:
  * zero-padded decimal keys sort in sample order, so the writer appends with ``MDB_APPEND``
    (no page splits, a compact file) and a reader scanning a cursor meets samples in order;
    reserved keys start with ``__``, which sorts after every digit.
  * values are the bare pixels (no header, no pickle): ``np.frombuffer(value, np.uint8)
    .reshape(shape)`` is the whole decoder, in any language.
  * shapes of a variable-shape store live in one ``__shapes__`` value rather than a
    per-sample header, so every sample value has the same meaning.

Checksums (manifest ``checksums.files``; what each covers is spelt out in ``layout["hashed"]``
so ``dlstore verify`` can recompute them): ``samples`` = sha256 of the values of keys 0..N-1
concatenated in key order (the same digest an HDF5 store of the same source records),
``labels`` = sha256 of the ``__labels__`` value, ``shapes`` = sha256 of the ``__shapes__``
value, ``targets`` = sha256 of the little-endian target vectors.

Writing: samples are committed in batched write transactions (64 MiB by default). The map
starts small and doubles whenever LMDB reports ``MDB_MAP_FULL`` (the failed transaction is
retried), so any store that fits the disk can be written. Syncing is deferred to the end: the
store is published by rename only after a final ``fsync``, so a crash leaves only a staging folder.

Reading in place: every value is one run of bytes in ``data.mdb`` (in its leaf page, or in
consecutive overflow pages), whatever order the keys were put in, so a fixed-shape batch is
gathered from a map of the file at the values' places, found in the B-tree's leaf pages
(``reader.py``; ``read_path`` "in place"). Written with ``MDB_APPEND`` in key order, the
values also lie in index order, so a block of consecutive samples is one range of the file
(what block shuffle and its window advice assume); ``dlstore info`` says whether a store's do.

Reading: the environment is opened ``readonly=True, lock=False`` (a published store never
changes in place: it is replaced by rename, so readers need no lock table), lazily, once per
process. ``readahead`` defaults to True when the data file is smaller than half the memory
(physical, or the process's cgroup limit: the page cache will hold it, and readahead fills it
with fewer, larger reads) and to False otherwise (random reads of a store bigger than memory:
readahead would evict pages still needed for neighbours that are not); pass ``readahead=`` to choose.
"""

from __future__ import annotations

import numpy as np

FORMAT = "lmdb"
FORMAT_VERSION = 1
SUFFIXES = (".lmdb",)
READER_OPTIONS = ("readahead", "willneed", "in_place")   # keyword options of Reader, see open_dataset(reader_options=)
KEY_DIGITS = 10
MANIFEST_KEY = b"__dlstore__"
LABELS_KEY = b"__labels__"
SHAPES_KEY = b"__shapes__"
SUMS_KEY = b"__crc32__"
INT_DTYPE = np.dtype("<i8")
DEFAULT_MAP_SIZE = 1 << 30  # initial map; doubles on MDB_MAP_FULL
DEFAULT_BATCH_BYTES = 64 << 20  # sample bytes per write transaction


def sample_key(i: int) -> bytes:
    """The key of sample ``i`` (``b"0000000042"``)."""
    return b"%010d" % i
