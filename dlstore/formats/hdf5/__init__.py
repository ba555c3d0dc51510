"""HDF5 stores: one ``.h5`` file readable with plain ``h5py``.

``layout.py`` holds the on-disk layout (datasets, chunking, the seal, why); ``writer.py`` the
Writer that fills a staging file; ``reader.py`` the Reader and the manifest reader.
"""

from .layout import COMPRESSIONS, FORMAT, FORMAT_VERSION, LIBVER, MANIFEST_ATTR, READER_OPTIONS, SUFFIXES, VLEN_CHUNK
from .reader import Hdf5Reader, check_seal, read_manifest
from .writer import Hdf5Writer

Writer = Hdf5Writer
Reader = Hdf5Reader

__all__ = ["COMPRESSIONS", "FORMAT", "FORMAT_VERSION", "LIBVER", "MANIFEST_ATTR", "READER_OPTIONS", "SUFFIXES",
           "VLEN_CHUNK", "Hdf5Reader", "Hdf5Writer", "Reader", "Writer", "check_seal", "read_manifest"]
