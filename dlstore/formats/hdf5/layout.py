"""HDF5 stores: one ``.h5`` file readable with plain ``h5py``.

On-disk layout of ``NAME.h5`` (format version 1)::

    /                      root group; attribute "dlstore" = the manifest, UTF-8 JSON string
    /labels                int64 (N,), contiguous            label of sample i; -1 if unlabelled
    # fixed-shape store (the static spec fixes (C, H, W)):
    /images                uint8 (N, C, H, W), chunks (1, C, H, W), optional lzf/gzip filter
    # variable-shape store:
    /images                vlen uint8 (N,), chunks (1024,)   sample i's CHW bytes, flattened
    /shapes                int64 (N, 3), chunks (1024, 3)    C, H, W of sample i
    /crc32                 uint32 (N,)                       CRC32 of sample i's bytes (check="sample")
    /offsets               int64 (N,)                        byte offset of sample i in this file (fixed
                                                             shape, uncompressed; checked against the chunk
                                                             index before use: see reader.py)
    /targets               int64 or float32 (N, K)           target vectors (only where converted from them)

Why this layout:
  * one sample per chunk: a random read touches exactly one chunk, and compression
    (``--compression lzf|gzip``) works per sample, so reading one sample never decompresses
    its neighbours.
  * ``images`` is resizable along N (the writer does not know N in advance); the file is
    written with ``libver=("v110", "latest")``, so the chunk index is an extensible array
    (O(1) lookup) instead of a B-tree; any HDF5 >= 1.10 (2016) reads it.
  * variable-shape samples use HDF5's own variable-length type, so
    ``f["images"][i].reshape(f["shapes"][i])`` is the whole decoder. HDF5 filters cannot
    compress variable-length data (only its heap pointers), so compression is refused for
    variable-shape stores rather than silently not applied.
  * no pickled or object attributes: the manifest is a plain string attribute.

Checksums (manifest ``checksums.files``; what each covers is spelt out in ``layout["hashed"]``
so ``dlstore verify`` can recompute them): ``samples`` = sha256 of every sample's CHW bytes
concatenated in sample order (the same digest an LMDB store of the same source records),
``labels`` = sha256 of the int64 little-endian labels, ``shapes`` = sha256 of the int64
little-endian shapes, ``targets`` = sha256 of the little-endian target vectors.

Reading in place: with one uncompressed chunk per sample (the default), chunks of several whole
samples, or a contiguous /images, every sample is a run of bytes at a known offset of the file
(the recorded ``/offsets`` where they agree with the chunk index, else the chunk index itself,
read once per reader with ``chunk_iter``), so a batch is gathered from a map
of the file (``reader.py``; ``read_path`` "in place"); filtered chunks (lzf, gzip, shuffle),
chunks that split a sample, a chunk never written, a virtual dataset and variable-length
samples read through h5py (``read_path`` "native", ``read_path_reason`` says which).

Reading: the file opens read-only, lazily, once per process, with the file locking of a plain
``h5py.File(path, "r")``, which can then share the file with an open dataset (``opening``
says how, and what happens where locks are not supported). The chunk cache is sized for
random access to one-sample chunks: a chunk is reused only when the same sample is read
again, which the OS page cache already serves, so fixed-shape stores get no chunk cache
(read natively, uncompressed samples are read with ``read_direct_chunk`` straight into the
output array, bypassing HDF5's selection machinery and the cache); chunks of several samples
read natively get a cache of two chunks (a batch is read in file order, so each chunk is
decoded once); variable-shape stores cache all chunks of heap pointers (16 bytes per sample,
up to 64 MiB). ``chunk_cache_bytes=`` chooses.
"""

from __future__ import annotations

import numpy as np

FORMAT = "hdf5"
FORMAT_VERSION = 1
SUFFIXES = (".h5", ".hdf5")
# keyword options of Reader, see open_dataset(reader_options=)
READER_OPTIONS = ("chunk_cache_bytes", "willneed", "readahead", "in_place")
MANIFEST_ATTR = "dlstore"
COMPRESSIONS = ("none", "lzf", "gzip")
LIBVER = ("v110", "latest")
VLEN_CHUNK = 1024
INT_DTYPE = np.dtype("<i8")
DEFAULT_BATCH_BYTES = 64 << 20  # sample bytes buffered before a write
MAX_POINTER_CACHE = 64 << 20
MAX_CHUNK_CACHE = 256 << 20   # default chunk cache where a chunk holds several samples: two chunks, at most this
