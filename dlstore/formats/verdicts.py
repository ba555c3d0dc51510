"""What ``overwrite`` is told about a recognised store it may not replace (see ``ownership``):
the messages every format's ``Format.not_as_written`` builds from."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from re import Pattern

_SHOWN = 4   # foreign entries named in a message


def verdict(title: str, additions: list[str], damage: str | None, damaged: bool) -> str | None:
    """What a recognised store (``title``: "an LMDB store") is, where overwrite may not replace it; else None."""
    if additions:
        return (f"{title} that holds data dlstore did not write ({listing(additions)}); move that "
                "data out first, or choose another destination")
    if damage is not None and not damaged:
        return (f"{title} that differs from what dlstore wrote ({damage}), with nothing dlstore can "
                'name as added: if it is damaged, pass overwrite="damaged" (--overwrite-damaged) to replace it')
    return None


def store_folder(path: Path, name: str, entry: Pattern[str],
                 marked: Callable[[list[str]], bool | str]) -> str | None:
    """For a recognised store folder of format ``name``: what it holds besides dlstore's entries
    (names matching ``entry``), or why ``marked`` (given the entries) does not take it for a store;
    None where it is a store folder holding dlstore's entries only."""
    names = sorted(os.listdir(path))
    foreign = [n for n in names if not entry.fullmatch(n)]
    if foreign:
        return (f"a {name} store folder that also holds entries dlstore did not write ({listing(foreign)}); "
                "move them out first")
    found = marked(names)
    if found is not True:
        return found or f"a folder of {name}-like files without a dlstore manifest"
    return None


def listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
