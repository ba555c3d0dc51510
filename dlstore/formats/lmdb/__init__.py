"""LMDB stores: one key per sample in an LMDB environment, readable with plain ``lmdb``.

``layout.py`` holds the on-disk layout (keys, encodings, why); ``writer.py`` the Writer that
fills a staging environment; ``reader.py`` the Reader and the manifest reader; ``environment.py``
the process's shared LMDB environments; ``protocol.py`` all of it as one ``Format``, ``FORMAT``.
"""

from .protocol import LmdbFormat
from .layout import FORMAT_VERSION, MANIFEST_KEY, READER_OPTIONS, SUFFIXES, sample_key
from .reader import LmdbReader, check_seal, read_manifest
from .writer import LmdbWriter

FORMAT = LmdbFormat()   # the package as one formats.protocol.Format: what the rest of dlstore uses

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST_KEY", "READER_OPTIONS", "SUFFIXES", "LmdbFormat",
           "LmdbReader", "LmdbWriter", "check_seal", "read_manifest", "sample_key"]
