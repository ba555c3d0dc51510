"""HDF5 stores: one ``.h5`` file readable with plain ``h5py``.

``layout.py`` holds the on-disk layout (datasets, chunking, the seal, why); ``writer.py`` the
Writer that fills a staging file; ``reader.py`` the Reader and the manifest reader; ``opening.py``
how dlstore opens an HDF5 file (its locking); ``virtual.py`` and ``assembly.py`` the parts a
distributed store maps; ``protocol.py`` all of it as one ``Format``, ``FORMAT``.
"""

from .protocol import Hdf5Format
from .layout import COMPRESSIONS, FORMAT_VERSION, LIBVER, MANIFEST_ATTR, READER_OPTIONS, SUFFIXES, VLEN_CHUNK
from .reader import Hdf5Reader, check_seal, read_manifest
from .writer import Hdf5Writer

FORMAT = Hdf5Format()   # the package as one formats.protocol.Format: what the rest of dlstore uses

__all__ = ["COMPRESSIONS", "FORMAT", "FORMAT_VERSION", "LIBVER", "MANIFEST_ATTR", "READER_OPTIONS", "SUFFIXES",
           "VLEN_CHUNK", "Hdf5Format", "Hdf5Reader", "Hdf5Writer", "check_seal",
           "read_manifest"]
