"""LMDB's on-disk pages, read in place: where each sample's value lies in ``data.mdb``.

lmdb.h lays out (64-bit little-endian builds): a page header ``MDB_page`` (page number,
padding, flags, the end of its node-offset array, the start of its nodes) followed by that
array; a node ``MDB_node`` (data size low and high 16 bits, flags, key size, the key, then the
value, or for a big value the number of its first overflow page, the value following that
page's header; in a branch page the size and flag fields hold the child's page number instead);
pages 0 and 1 each hold a meta record ``MDB_meta`` after the header, the one with the larger
transaction id being current, naming the main database's root page and depth.

``walk`` reads the whole tree level by level: each level's pages are advised
(``posix_fadvise(WILLNEED)``) all at once before any is read, so a cold store's leaves arrive
as a few queued reads, not one synchronous page fault per leaf (2,400 faults, ~0.5 s, for
170,000 samples on this project's VM disk), and the nodes are decoded with whole-array
operations. ``parse_leaf`` reads one leaf, for a single lookup.
"""

from __future__ import annotations

import struct
import sys
from typing import Callable

import numpy as np

PAGE_HEADER = struct.Struct("<QHHHH")     # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
NODE_HEADER = struct.Struct("<HHHH")      # mn_lo, mn_hi, mn_flags, mn_ksize
PGNO = struct.Struct("<Q")
P_BRANCH, P_LEAF, P_META, P_LEAF2 = 0x01, 0x02, 0x08, 0x20
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
LAYOUT_KNOWN = sys.byteorder == "little" and struct.calcsize("P") == 8

_MAGIC, _DATA_VERSION = 0xBEEFC0DE, 1
# MDB_meta after the page header: magic, version, address, map size, then two MDB_db (free
# list, main; each pad, flags, depth, branch/leaf/overflow page counts, entries, root), the
# last page number and the transaction id.
_META = struct.Struct("<IIQQ" + "IHHQQQQQ" * 2 + "QQ")


def _u16(flat: np.ndarray, pos: np.ndarray) -> np.ndarray:
    return flat[pos].astype(np.int64) | flat[pos + 1].astype(np.int64) << 8


def current_root(mem: np.ndarray, page: int) -> tuple[int, int, int] | None:
    """(root page, depth, entries) of the main database, from the current meta page; None where
    pages 0 and 1 are not LMDB meta pages, or the database is empty."""
    metas = []
    for pgno in (0, 1):
        raw = mem[pgno * page:pgno * page + PAGE_HEADER.size + _META.size].tobytes()
        if len(raw) < PAGE_HEADER.size + _META.size or not PAGE_HEADER.unpack_from(raw)[2] & P_META:
            return None
        meta = _META.unpack_from(raw, PAGE_HEADER.size)
        if meta[0] != _MAGIC or meta[1] != _DATA_VERSION:
            return None
        main = meta[4 + 8:4 + 16]                  # the main database's MDB_db
        metas.append((meta[-1], main[7], main[2], main[6]))   # txnid, root, depth, entries
    _txnid, root, depth, entries = max(metas)
    if root == (1 << 64) - 1 or depth < 1:        # P_INVALID: no pages
        return None
    return root, depth, entries


def _read_pages(mem: np.ndarray, pgnos: np.ndarray, page: int) -> np.ndarray:
    """(len(pgnos), page) copies of the pages (a page past the map: None of it)."""
    out = np.empty((len(pgnos), page), dtype=np.uint8)
    for k, pgno in enumerate(pgnos.tolist()):
        out[k] = mem[pgno * page:(pgno + 1) * page]
    return out


def _nodes(pages: np.ndarray, flags: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(page row, offset in the page) of every node of ``pages``, in key order; None where a
    page is not of ``flags``' kind or its node-offset array does not fit it."""
    page = pages.shape[1]
    kind = pages[:, 10].astype(np.int64) | pages[:, 11].astype(np.int64) << 8
    lower = pages[:, 12].astype(np.int64) | pages[:, 13].astype(np.int64) << 8
    if ((kind & (P_BRANCH | P_LEAF | P_LEAF2)) != flags).any():
        return None
    if ((lower < PAGE_HEADER.size) | (lower > page) | ((lower - PAGE_HEADER.size) % 2 != 0)).any():
        return None
    n = (lower - PAGE_HEADER.size) // 2
    most = int(n.max()) if len(n) else 0
    ptrs = np.ascontiguousarray(pages[:, PAGE_HEADER.size:PAGE_HEADER.size + 2 * most]).view("<u2")
    row, col = np.nonzero(np.arange(most) < n[:, None])
    ptr = ptrs[row, col].astype(np.int64)
    if (ptr + NODE_HEADER.size > page).any():
        return None
    return row, ptr


def walk(mem: np.ndarray, page: int, count: int, key_digits: int,
         advise: Callable[[np.ndarray], None], batch_pages: int = 1024) -> tuple[np.ndarray, np.ndarray] | None:
    """(offset, length) in the file of the values of keys 0..count-1 (``key_digits`` decimal
    digits), (0, 0) for a key not found; None where a page does not read as lmdb.h lays it out.
    ``mem``: the file's bytes (a map); ``advise(pgnos)``: asks for those pages ahead."""
    found = current_root(mem, page)
    if found is None:
        return None
    root, depth, entries = found
    limit = len(mem) // page
    level = np.array([root], dtype=np.int64)
    for _ in range(depth - 1):                     # branch levels: each node names a child page
        if (level >= limit).any():
            return None
        advise(level)
        children = []
        for first in range(0, len(level), batch_pages):
            pages = _read_pages(mem, level[first:first + batch_pages], page)
            nodes = _nodes(pages, P_BRANCH)
            if nodes is None:
                return None
            flat = pages.reshape(-1)
            pos = nodes[0] * page + nodes[1]
            children.append(_u16(flat, pos) | _u16(flat, pos + 2) << 16 | _u16(flat, pos + 4) << 32)
        level = np.concatenate(children)
    if (level >= limit).any():
        return None
    advise(level)
    offsets, lengths = np.zeros(count, dtype=np.int64), np.zeros(count, dtype=np.int64)
    seen = np.zeros(count, dtype=bool)
    nodes_seen = 0
    for first in range(0, len(level), batch_pages):
        pgnos = level[first:first + batch_pages]
        pages = _read_pages(mem, pgnos, page)
        nodes = _nodes(pages, P_LEAF)
        if nodes is None:
            return None
        row, ptr = nodes
        nodes_seen += len(ptr)
        flat = pages.reshape(-1)
        pos = row * page + ptr
        ksize = _u16(flat, pos + 6)
        fits = (ksize == key_digits) & (ptr + NODE_HEADER.size + key_digits <= page)
        row, ptr, pos = row[fits], ptr[fits], pos[fits]
        keys = flat[pos[:, None] + NODE_HEADER.size + np.arange(key_digits)]
        digits = ((keys >= ord("0")) & (keys <= ord("9"))).all(axis=1)
        index = ((keys[digits].astype(np.int64) - ord("0")) * 10 ** np.arange(key_digits - 1, -1, -1)).sum(axis=1)
        mine = index < count                        # (metadata keys are not digits)
        row, ptr, pos, index = row[digits][mine], ptr[digits][mine], pos[digits][mine], index[mine]
        node_flags = _u16(flat, pos + 4)
        if (node_flags & (F_SUBDATA | F_DUPDATA)).any() or seen[index].any():
            return None
        value = ptr + NODE_HEADER.size + key_digits
        big = (node_flags & F_BIGDATA) != 0
        if (big & (value + PGNO.size > page)).any():
            return None
        overflow = np.zeros(len(pos), dtype=np.int64)
        for k in range(PGNO.size):                  # little-endian page number after the key
            at = np.minimum(pos + NODE_HEADER.size + key_digits + k, len(flat) - 1)   # (read for big ones)
            overflow |= flat[at].astype(np.int64) << (8 * k)
        offset = np.where(big, overflow * page + PAGE_HEADER.size, pgnos[row] * page + value)
        length = _u16(flat, pos) | _u16(flat, pos + 2) << 16
        if (offset + length > len(mem)).any() or (~big & (value + length > page)).any():
            return None
        offsets[index], lengths[index] = offset, length
        seen[index] = True
    if nodes_seen != entries:                      # the meta's count of the tree's entries
        return None
    return offsets, lengths


def parse_leaf(raw: bytes, start: int, count: int, key_digits: int, file_bytes: int,
               offsets: np.ndarray, lengths: np.ndarray) -> bool:
    """Record the extent of every sample in the leaf page ``raw`` (at byte ``start`` of the
    file); False where the page is not a leaf as lmdb.h lays it out."""
    page = len(raw)
    _pgno, _pad, flags, lower, _upper = PAGE_HEADER.unpack_from(raw)
    if not flags & P_LEAF or flags & P_LEAF2 or not PAGE_HEADER.size <= lower <= page:
        return False
    ptrs = np.frombuffer(raw, dtype="<u2", count=(lower - PAGE_HEADER.size) // 2, offset=PAGE_HEADER.size)
    for ptr in ptrs.tolist():
        if ptr + NODE_HEADER.size > page:
            return False
        lo, hi, node_flags, key_bytes = NODE_HEADER.unpack_from(raw, ptr)
        key = raw[ptr + NODE_HEADER.size:ptr + NODE_HEADER.size + key_bytes]
        if len(key) != key_digits or not key.isdigit():
            continue                               # metadata (__dlstore__, __labels__, ...)
        i = int(key)
        if i >= count:
            continue
        after = ptr + NODE_HEADER.size + key_bytes
        if node_flags & F_BIGDATA:
            (pgno,) = PGNO.unpack_from(raw, after)
            offset = pgno * page + PAGE_HEADER.size
        else:
            offset = start + after
        length = lo | hi << 16
        if offset + length > file_bytes:
            return False
        # a value's length first: a thread that sees the offset set reads both
        lengths[i] = length
        offsets[i] = offset
    return True
