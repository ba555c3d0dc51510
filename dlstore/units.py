"""Byte counts for people: the one formatter every message and report uses."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``512`` -> ``"512 B"`` (binary units, thousands separated)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n):,} B"
        n /= 1024
    return f"{n:,.1f} TiB"


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_size(text: str) -> int:
    """``"8MiB"`` -> 8388608, ``"256MB"`` -> 256000000, ``"1000"`` -> 1000 (binary and decimal units).

    Raises:
        ValueError: not a positive size (the caller names its argument).
    """
    stripped = text.strip().lower()
    number = stripped.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = stripped[len(number):].strip()
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(f"{text!r} is not a size (examples: 8MiB, 1GiB, 5000000)") from None
    if not value >= 1:
        raise ValueError(f"{text!r}: a size must be at least 1 byte")
    return int(value)
