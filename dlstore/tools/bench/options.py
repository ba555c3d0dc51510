"""What ``dlstore bench`` measures: the variants, orders, cache states and worker counts."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ...errors import ArgumentError

FORMAT_NAMES = ("imagefolder", "shards", "lmdb", "hdf5")
ENCODINGS = ("raw", "jpeg", "png")
CACHE_STATES = ("cold", "warm")
ORDERS = ("random", "sequential")
DEFAULT_STATIC = "resize=256,center_crop=224"
DEFAULT_SAMPLES = 256
# ... and as warm when at least this fraction was.
WARM_RESIDENT_MIN = 0.98


# --------------------------------------------------------------------------- what is measured


@dataclass(frozen=True)
class Variant:
    """One thing to read: ``imagefolder``, or a store format with a sample encoding."""

    format: str
    encoding: str = "raw"

    @property
    def name(self) -> str:
        return self.format if self.encoding == "raw" else f"{self.format}+{self.encoding}"

    @property
    def is_store(self) -> bool:
        return self.format != "imagefolder"


def convert_supports_encoding() -> bool:
    """Whether ``dlstore.convert`` takes ``encoding=`` (encoded-sample stores)."""
    from ...conversion.local import convert

    return "encoding" in inspect.signature(convert).parameters


def default_formats() -> list[str]:
    """``imagefolder, shards, lmdb, hdf5``, plus ``shards+jpeg`` when encoded stores exist."""
    names = list(FORMAT_NAMES)
    if convert_supports_encoding():
        names.append("shards+jpeg")
    return names


def parse_variants(names: str | Iterable[str]) -> list[Variant]:
    """``"imagefolder,shards,lmdb+jpeg"`` (or a list of such names) -> variants, in order, unique.

    Raises:
        ValueError: an unknown format or encoding, naming the valid ones.
    """
    items = names.split(",") if isinstance(names, str) else list(names)
    out: list[Variant] = []
    for item in (i.strip().lower() for i in items):
        if not item:
            continue
        fmt, _, encoding = item.partition("+")
        encoding = encoding or "raw"
        if fmt not in FORMAT_NAMES:
            raise ArgumentError(f"unknown format {fmt!r} in {item!r}; valid: {', '.join(FORMAT_NAMES)} "
                             f"(a store format may take +ENCODING, e.g. shards+jpeg)")
        if encoding not in ENCODINGS:
            raise ArgumentError(f"unknown encoding {encoding!r} in {item!r}; valid: {', '.join(ENCODINGS)}")
        if fmt == "imagefolder" and encoding != "raw":
            raise ArgumentError(f"{item!r}: imagefolder reads the source files as they are; drop +{encoding}")
        if encoding != "raw" and not convert_supports_encoding():
            raise ArgumentError(f"{item!r}: this dlstore's convert cannot store encoded samples yet; "
                             f"use {fmt} (raw)")
        variant = Variant(fmt, encoding)
        if variant not in out:
            out.append(variant)
    if not out:
        raise ArgumentError(f"no format to benchmark; give some of {', '.join(FORMAT_NAMES)}")
    return out


def parse_choices(values: str | Iterable[str], valid: Sequence[str], what: str) -> list[str]:
    items = values.split(",") if isinstance(values, str) else list(values)
    out = []
    for item in (str(i).strip().lower() for i in items):
        if not item:
            continue
        if item not in valid:
            raise ArgumentError(f"unknown {what} {item!r}; valid: {', '.join(valid)}")
        if item not in out:
            out.append(item)
    if not out:
        raise ArgumentError(f"no {what} given; valid: {', '.join(valid)}")
    return out


def parse_workers(values: str | int | Iterable[int]) -> list[int]:
    if isinstance(values, int):
        values = [values]
    items = values.split(",") if isinstance(values, str) else list(values)
    out: list[int] = []
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        try:
            n = int(text)
        except ValueError:
            raise ArgumentError(f"workers: {text!r} is not an integer (example: 0,2)") from None
        if n < 0:
            raise ArgumentError(f"workers: {n} is negative; num_workers is 0 (read in the main process) or more")
        if n not in out:
            out.append(n)
    if not out:
        raise ArgumentError("workers: give at least one num_workers value, e.g. 0,2")
    return out
