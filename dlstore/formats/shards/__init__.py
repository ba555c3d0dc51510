"""Memory-mapped tensor shards: a folder of ``.npy`` files readable with plain numpy.

``layout.py`` holds the on-disk layout (names, header, why); ``writer.py`` the Writer that
fills a staging folder; ``reader.py`` the Reader and the manifest reader; ``assembly.py`` a
distributed conversion's parts put together; ``protocol.py`` all of it as one ``Format``, ``FORMAT``.
"""

from .protocol import ShardsFormat
from .layout import DEFAULT_SHARD_SIZE, FORMAT_VERSION, MANIFEST_NAME, READER_OPTIONS, SUFFIXES
from .reader import ShardReader, check_manifest_seal, read_manifest
from .writer import ShardWriter

FORMAT = ShardsFormat()   # the package as one formats.protocol.Format: what the rest of dlstore uses

__all__ = ["DEFAULT_SHARD_SIZE", "FORMAT", "FORMAT_VERSION", "MANIFEST_NAME", "READER_OPTIONS", "SUFFIXES",
           "ShardReader", "ShardWriter", "ShardsFormat", "check_manifest_seal",
           "read_manifest"]
