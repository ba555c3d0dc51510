"""An LMDB conversion interrupted between a transaction's commit and its checkpoint resumes to the
same data file as an uninterrupted one: the samples committed past the checkpoint are kept and
checked, never deleted (a deletion lets LMDB lay the freed pages out anew).

The same file, byte for byte, but for LMDB's unused space: the bytes of a page between its node
pointers and its nodes (``lower``..``upper`` in the page header) are left over from whatever the
page held before, and which free page a transaction reuses depends on the writer's memory of its
free list, which a reopened environment does not have. Those bytes are never read."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from dlstore.errors import StoreCorruptError
from dlstore.formats.lmdb.writer import LmdbWriter

SHAPE = (3, 16, 16)
BATCH_BYTES = 3 * int(np.prod(SHAPE))        # a transaction every 3 samples
PAGE, HEADER = 4096, 16                      # LMDB's page size here, and its page header


def _samples(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, SHAPE, dtype=np.uint8) for _ in range(n)]


def _finish(writer: LmdbWriter) -> None:
    writer.finish()
    writer.write_manifest('{"m": 1}')


def lmdb_pages(folder) -> list[bytes]:
    """data.mdb's pages, the unused space of branch and leaf pages zeroed."""
    data = (folder / "data.mdb").read_bytes()
    out = []
    for start in range(0, len(data), PAGE):
        page = bytearray(data[start:start + PAGE])
        _, _, flags, lower, upper = struct.unpack_from("<QHHHH", page)
        if flags & 0x03 and HEADER <= lower <= upper <= PAGE:     # P_BRANCH | P_LEAF
            page[lower:upper] = bytes(upper - lower)
        out.append(bytes(page))
    return out


@pytest.mark.parametrize("units_before, units_after_checkpoint", [(1, 1), (2, 2), (0, 3), (3, 1), (20, 7), (5, 0)])
def test_commits_past_the_checkpoint_are_kept_and_the_file_is_the_same(tmp_path, units_before,
                                                                       units_after_checkpoint):
    samples = _samples(120)
    whole = LmdbWriter(tmp_path / "whole", shape=SHAPE, batch_bytes=BATCH_BYTES)
    for i, x in enumerate(samples):
        if whole.add(x, i % 3):
            whole.checkpoint()
    _finish(whole)

    cut = LmdbWriter(tmp_path / "cut", shape=SHAPE, batch_bytes=BATCH_BYTES)
    state, units, k = {"rows": 0}, 0, 0
    while units < units_before + units_after_checkpoint:
        if cut.add(samples[k], k % 3):
            units += 1
            if units <= units_before:
                state = cut.checkpoint()       # the later commits get no checkpoint: killed there
        k += 1
    cut.close()                                # the process dies: committed, not checkpointed
    resumed = LmdbWriter.resume(tmp_path / "cut", state, shape=SHAPE, batch_bytes=BATCH_BYTES)
    for i in range(state["rows"], len(samples)):
        if resumed.add(samples[i], i % 3):
            resumed.checkpoint()
    _finish(resumed)
    got, want = lmdb_pages(tmp_path / "cut"), lmdb_pages(tmp_path / "whole")
    assert len(got) == len(want) and [k for k, (a, b) in enumerate(zip(got, want)) if a != b] == []


def test_a_committed_sample_the_resumed_run_makes_otherwise_is_refused(tmp_path):
    samples = _samples(9)
    cut = LmdbWriter(tmp_path / "cut", shape=SHAPE, batch_bytes=BATCH_BYTES)
    for i in range(6):
        cut.add(samples[i], 0)                 # two transactions committed, no checkpoint
    cut.close()
    resumed = LmdbWriter.resume(tmp_path / "cut", {"rows": 0}, shape=SHAPE, batch_bytes=BATCH_BYTES)
    resumed.add(samples[0], 0)
    with pytest.raises(StoreCorruptError, match="sample 1, committed before the interruption, differs"):
        resumed.add(_samples(1, seed=5)[0], 0)
    resumed.close()
