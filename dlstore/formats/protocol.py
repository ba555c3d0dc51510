"""The ``Format`` protocol: everything the rest of dlstore asks of a store format.

Each format package (``formats/shards``, ``formats/lmdb``, ``formats/hdf5``) implements it in
full as one object, ``FORMAT``, which the registry (``formats.get_format(name)``) returns. Code
outside a format package asks that object; it never compares a format's name. A fourth format
is a new package with a ``Format`` subclass and one line in the registry.

A sample is a set of named fields (``FIELDS``): ``image`` (the uint8 CHW record, raw or
encoded) and ``target`` (the int64 label, with an optional per-sample target vector). A
segmentation mask is planes of the record after the image's channels (``formats.fields``), so
the formats store it without knowing it; a field that is not image-shaped (boxes) would be a
further name here with a place of its own in each format, as target vectors have.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

# The fields of a sample every format stores; see the module docstring for adding one.
FIELDS = ("image", "target")

Seal = tuple[Path, "str | None"]   # (the sealed file, None if it matches, else the problem or "unsealed")


class Format(ABC):
    """One store format. Attributes are set as class attributes by each format's subclass.

    Attributes:
        name: the format's name (``--format``, the manifest's ``format``).
        version: the newest layout version this code writes and reads.
        suffixes: destination suffixes that imply this format, the first the default.
        fields: the names of the per-sample fields it stores (see ``FIELDS``).
        reader_options: the keyword options ``Reader`` takes (``reader_options=`` of a dataset).
        Writer: the writer class (a context manager filling a staging path; ``Writer.resume``
            where a partial conversion can continue).
        Reader: the reader class (a ``formats.reader.StoreReader``).
        dataset_class: the name of its ``StoreDataset`` subclass (``ShardsDataset``, ...).
        title: how messages name one of its stores (``"an LMDB store"``).
        library: the library that reads its data files, named in messages (``"HDF5"``).
        compressions: the per-sample compressions its Writer takes (``compression=``), if any.
        sized_data_files: its data files hold ``shard_size`` samples each (``--shard-size``).
        file_checksums: its manifest records the sha256 of every data file (``verify`` checks
            those), rather than digests of the samples, labels and shapes read back through
            ``library``.
        merges_parts: a distributed conversion's parts are merged record by record through
            ``Writer`` on rank 0 (the parts stay in the work folder until the store is published,
            so an interrupted assembly can resume); otherwise ``assemble_parts`` moves or maps
            the parts' files into the store.
        keeps_parts: a distributed store maps its parts, kept in a folder beside it
            (``DST.parts``), instead of holding their data itself.
    """

    @property
    @abstractmethod
    def name(self) -> str: ...

    @property
    @abstractmethod
    def version(self) -> int: ...

    @property
    @abstractmethod
    def suffixes(self) -> tuple[str, ...]: ...

    @property
    @abstractmethod
    def reader_options(self) -> tuple[str, ...]: ...

    @property
    @abstractmethod
    def Writer(self) -> type: ...   # noqa: N802 - a class, named as one

    @property
    @abstractmethod
    def Reader(self) -> type: ...   # noqa: N802 - a class, named as one

    @property
    @abstractmethod
    def dataset_class(self) -> str: ...

    @property
    @abstractmethod
    def title(self) -> str: ...

    @property
    @abstractmethod
    def library(self) -> str: ...

    fields: tuple[str, ...] = FIELDS
    compressions: tuple[str, ...] = ()
    sized_data_files: bool = False
    file_checksums: bool = False
    merges_parts: bool = False
    keeps_parts: bool = False

    # --- finding and opening a store -------------------------------------------------------

    @abstractmethod
    def detect(self, path: Path) -> bool:
        """Whether the existing ``path`` holds a store of this format, judged by its contents."""

    @abstractmethod
    def read_manifest(self, path: Path) -> dict[str, Any]:
        """The validated manifest of the store at ``path`` (StoreCorruptError if it has none)."""

    @abstractmethod
    def check_seal(self, path: str | os.PathLike) -> Seal | None:
        """The data file against its seal, checked before ``library`` opens it; None where the
        format has no sealed data file."""

    @abstractmethod
    def check_manifest_seal(self, path: str | os.PathLike) -> Seal | None:
        """The manifest against a seal of its own; None where the manifest lies inside the
        sealed data file."""

    # --- a distributed conversion's parts ----------------------------------------------------

    def assemble_parts(self, parts: list[Path], counts: list[int], staged: Path,
                       parts_folder: str) -> tuple[dict[str, Any], dict[str, str]]:
        """Build the store at ``staged`` from the ranks' ``parts`` (``counts`` samples each);
        return its manifest's ``layout`` and ``checksums.files``. ``parts_folder``: the name of
        the folder beside the store that holds the parts (``keeps_parts``). Formats that
        ``merges_parts`` do not implement it."""
        raise NotImplementedError(f"{self.name} stores merge their parts through their Writer")

    def write_manifest(self, staged: Path, manifest: dict[str, Any]) -> None:
        """Write (and make durable) ``manifest`` into the assembled store at ``staged``."""
        raise NotImplementedError(f"{self.name} stores merge their parts through their Writer")

    def merge_reader(self, part: Path) -> Any:
        """A reader of one part whose records are merged in order (``merges_parts``)."""
        return self.Reader(part)

    # --- ownership: what ``overwrite`` may replace ----------------------------------------

    @abstractmethod
    def recognises(self, path: Path) -> bool:
        """Whether ``path`` (not a symbolic link) carries what only this format's stores hold,
        whole or damaged (``formats.ownership``)."""

    @abstractmethod
    def not_as_written(self, path: Path, *, damaged: bool) -> str | None:
        """None where the recognised ``path`` is exactly what dlstore wrote (or, with
        ``damaged``, damaged with nothing dlstore can name as someone's addition); else what is
        there instead, for the error to show."""

    def __repr__(self) -> str:
        return f"<{self.name} format>"
