"""Memory-mapped tensor shards: a folder of ``.npy`` files readable with plain numpy.

``layout.py`` holds the on-disk layout (names, header, why); ``writer.py`` the Writer that
fills a staging folder; ``reader.py`` the Reader and the manifest reader.
"""

from .layout import DEFAULT_SHARD_SIZE, FORMAT, FORMAT_VERSION, MANIFEST_NAME, READER_OPTIONS, SUFFIXES
from .reader import ShardReader, check_manifest_seal, read_manifest
from .writer import ShardWriter

Writer = ShardWriter
Reader = ShardReader

__all__ = ["DEFAULT_SHARD_SIZE", "FORMAT", "FORMAT_VERSION", "MANIFEST_NAME", "READER_OPTIONS", "SUFFIXES", "Reader",
           "ShardReader", "ShardWriter", "Writer", "check_manifest_seal", "read_manifest"]
