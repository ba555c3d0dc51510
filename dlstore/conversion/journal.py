"""What ``--resume`` checks before it trusts an interrupted conversion: the source files it converted.

The worker that decodes a file first takes its print (``fileprint``), before it reads the
image, so that a file changed while it was decoded never passes for the one converted::

    [size in bytes, st_mtime_ns, sha256 of (size, the first 64 KiB, the last 64 KiB), 128 bits in hex]

The conversion appends one line per item of a file source, in source order, to a journal
beside its checkpoint (``progress.json.sources``; a distributed rank's ``rank-RRRRR.sources``),
the item's origin and then its print, ``null`` for a file that could not be opened::

    ["class_00/img_0001.jpg", 5120, 1718000000123456789, "9f1c..."]

Each checkpoint fsyncs the journal and counts its lines (``journal_rows``). ``--resume`` takes
the print of every file the checkpoint counts again and refuses (``SourceChangedError``, listing
them) if any differs: replaced, edited, truncated, removed or touched since. The hash reads at
most 128 KiB of a file, cheap next to decoding it; an edit in the middle of a large file that
keeps its size shows in its mtime. Items of a dataset or arrays have no file, and no journal.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import SourceChangedError

EDGE = 64 << 10           # bytes hashed at each end of a file
_SHOWN = 20               # changed files listed in a message
_BLOCK = 4096             # files printed per batch of threads on resume
SUFFIX = ".sources"       # a journal's name: its checkpoint's, plus this


def printed_files(source: Any) -> Any:
    """The function giving the file(s) of each of ``source``'s items to print: a pair source's
    ``files`` (an image and its mask), else its ``where``."""
    return getattr(source, "files", source.where)


def fileprint(path: str | os.PathLike | tuple[str, ...]) -> list[Any] | None:
    """[size, mtime_ns, hash] of the file at ``path``, or None where it cannot be opened; of several
    files (an image and its mask), [their sizes' sum, the latest mtime, a hash of their prints]."""
    if isinstance(path, tuple):
        prints = [fileprint(p) for p in path]
        if any(p is None for p in prints):
            return None
        joined = hashlib.sha256("\0".join(str(p) for p in prints).encode()).hexdigest()[:32]
        return [sum(p[0] for p in prints), max(p[1] for p in prints), joined]
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            digest = hashlib.sha256()   # (not blake2b: sha256 is hardware-accelerated on most CPUs)
            digest.update(st.st_size.to_bytes(8, "little"))
            digest.update(f.read(EDGE))
            if st.st_size > EDGE:
                f.seek(max(EDGE, st.st_size - EDGE))
                digest.update(f.read(EDGE))
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, digest.hexdigest()[:32]]


class Journal:
    """The prints of the items converted so far, appended to a file at each checkpoint.

    Only the lines not saved yet are held in memory (a few million files are fine).
    """

    def __init__(self) -> None:
        self._pending: list[str] = []
        self.saved = 0

    def append(self, origin: str, fileprint_: list[Any] | None) -> None:
        self._pending.append(json.dumps([origin, *(fileprint_ or [None, None, None])]) + "\n")

    def save(self, path: Path, rows: int) -> None:
        """Append the lines up to ``rows`` (the checkpoint's source position) and fsync."""
        take = rows - self.saved
        if take <= 0:
            return
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(self._pending[:take])
            f.flush()
            os.fsync(f.fileno())
        del self._pending[:take]
        self.saved = rows

    def restore(self, path: Path, rows: int) -> list[list[Any]] | None:
        """The first ``rows`` entries of the journal at ``path``, the rest dropped from the file;
        None where it holds fewer or is unreadable (what was converted cannot be checked)."""
        entries: list[list[Any]] = []
        size = 0
        try:
            with open(path, "rb") as f:
                for line in itertools.islice(f, rows):
                    entries.append(json.loads(line))
                    size += len(line)
        except (OSError, ValueError):
            return None
        if len(entries) < rows or not all(isinstance(e, list) and len(e) == 4 for e in entries):
            return None
        with open(path, "r+b") as f:   # lines written after the checkpoint: those items are converted again
            f.truncate(size)
        self._pending.clear()
        self.saved = rows
        return entries

    def reset(self) -> None:
        """Forget what was restored: the conversion starts over (its journal file removed)."""
        self._pending.clear()
        self.saved = 0


def changed_files(entries: list[list[Any]], paths: Iterable[str], threads: int = 8) -> list[tuple[str, str]]:
    """(origin, what changed) for every entry whose file (``paths``, in the same order) differs now."""
    out: list[tuple[str, str]] = []
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for block in _blocks(zip(entries, paths), _BLOCK):
            nows = pool.map(fileprint, [p for _, p in block])
            out.extend((entry[0], why) for (entry, _), now in zip(block, nows)
                       if (why := _difference(entry[1:], now)) is not None)
    return out


def _blocks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    it = iter(items)
    while block := list(itertools.islice(it, size)):
        yield block


def _difference(then: list[Any], now: list[Any] | None) -> str | None:
    if then == now:
        return None
    if then[0] is None:
        return "could not be opened when it was converted, and can now"
    if now is None:
        return "removed or unreadable"
    what = [f"size {then[0]} -> {now[0]} bytes"] if then[0] != now[0] else []
    if then[2] != now[2]:
        what.append("content")
    if then[1] != now[1]:
        what.append("modification time")
    return ", ".join(what) + " changed"


def refuse(where: Path, changed: list[tuple[str, str]], rows: int) -> SourceChangedError:
    """The error for ``changed`` ((origin, what)) among the ``rows`` items converted before."""
    listing = "\n".join(f"  {origin}: {why}" for origin, why in changed[:_SHOWN])
    if len(changed) > _SHOWN:
        listing += f"\n  ... and {len(changed) - _SHOWN} more"
    return SourceChangedError(
        f"{where}: {len(changed)} of the {rows} source file(s) the interrupted conversion already converted "
        "changed since; rerun without --resume to convert everything again (or put the original files "
        f"back and resume)\n{listing}", [origin for origin, _ in changed])

