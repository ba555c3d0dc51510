"""Byte counts for people: the one formatter every message and report uses."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``512`` -> ``"512 B"`` (binary units, thousands separated)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n):,} B"
        n /= 1024
    return f"{n:,.1f} TiB"
