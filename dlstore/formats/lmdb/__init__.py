"""LMDB stores: one key per sample in an LMDB environment, readable with plain ``lmdb``.

``layout.py`` holds the on-disk layout (keys, encodings, why); ``writer.py`` the Writer that
fills a staging environment; ``reader.py`` the Reader and the manifest reader.
"""

from .layout import FORMAT, FORMAT_VERSION, MANIFEST_KEY, READER_OPTIONS, SUFFIXES, sample_key
from .reader import LmdbReader, check_seal, read_manifest
from .writer import LmdbWriter

Writer = LmdbWriter
Reader = LmdbReader

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST_KEY", "READER_OPTIONS", "SUFFIXES", "LmdbReader", "LmdbWriter",
           "Reader", "Writer", "check_seal", "read_manifest", "sample_key"]
