"""Block shuffle (``dlstore.BlockShuffleSampler``): every sample once per epoch, ranks split as
``DistributedSampler`` splits them, windows of whole blocks, the same order for the same
(seed, epoch), usable by a plain DataLoader and by ``dlstore.loader`` on every back-end."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import dlstore
from dlstore import _system
from dlstore.data import order
from dlstore.errors import ArgumentError, ArgumentTypeError
from dlstore.sources.demo import make_image_folder

params = st.tuples(st.integers(0, 300), st.integers(1, 40), st.integers(1, 6), st.integers(1, 5),
                   st.integers(0, 2**63), st.booleans())


def _ranks(n, block, window, world, seed, drop_last, epoch=0):
    out = []
    for rank in range(world):
        s = dlstore.BlockShuffleSampler(n, block_size=block, window=window, seed=seed, num_replicas=world,
                                        rank=rank, drop_last=drop_last)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@settings(max_examples=200, deadline=None)
@given(params)
def test_ranks_cover_the_epoch_as_distributed_sampler_does(case):
    n, block, window, world, seed, drop_last = case
    ranks = _ranks(n, block, window, world, seed, drop_last)
    reference = [len(DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=False, drop_last=drop_last))
                 for r in range(world)] if n else [0] * world
    assert [len(r) for r in ranks] == reference     # the same share per rank as torch's sampler
    counts = collections.Counter(i for r in ranks for i in r)
    assert set(counts) <= set(range(n))
    if drop_last:                                   # trimmed: every index at most once, ranks disjoint
        assert max(counts.values(), default=1) == 1 and len(counts) == sum(reference)
    else:                                           # padded: every index, the surplus repeated once at most
        assert set(counts) == set(range(n))
        assert sum(counts.values()) - n == sum(reference) - n
        assert max(counts.values(), default=1) <= 1 + -(-(sum(reference) - n) // max(n, 1))
    if not drop_last and n % world == 0:
        assert all(not set(a) & set(b) for i, a in enumerate(ranks) for b in ranks[i + 1:])


@settings(max_examples=200, deadline=None)
@given(params)
def test_each_window_is_whole_blocks_read_together(case):
    """Grouped by first appearance, each run of ``window`` blocks fills one contiguous stretch of
    the epoch: only those blocks are read while it lasts."""
    n, block, window, _, seed, _ = case
    got = order.block_shuffle(n, block, window, seed)
    assert sorted(got.tolist()) == list(range(n))
    blocks = got // min(block, max(n, 1))
    first = list(dict.fromkeys(blocks.tolist()))    # blocks in order of first appearance
    position = 0
    for g in range(0, len(first), window):
        members = set(first[g:g + window])
        size = int(np.isin(blocks, list(members)).sum())
        assert set(blocks[position:position + size].tolist()) == members, (g, members)
        position += size
    assert position == n


def test_same_seed_and_epoch_give_the_same_order_and_epochs_differ():
    def epoch(seed, e):
        s = dlstore.BlockShuffleSampler(1000, block_size=16, window=4, seed=seed)
        s.set_epoch(e)
        return list(s)

    assert epoch(3, 0) == epoch(3, 0) and epoch(3, 5) == epoch(3, 5)
    assert epoch(3, 0) != epoch(3, 1) and epoch(3, 0) != epoch(4, 0)
    assert _ranks(100, 8, 2, 3, 7, False, epoch=2) == _ranks(100, 8, 2, 3, 7, False, epoch=2)


def test_seed_none_draws_each_pass_from_the_generator():
    g = torch.Generator().manual_seed(0)
    s = dlstore.BlockShuffleSampler(500, block_size=10, window=3, generator=g)
    a, b = list(s), list(s)
    assert a != b and sorted(a) == sorted(b) == list(range(500))
    again = dlstore.BlockShuffleSampler(500, block_size=10, window=3, generator=torch.Generator().manual_seed(0))
    assert list(again) == a
    assert dlstore.BlockShuffleSampler(10, block_size=2, window=2, num_replicas=2, rank=1).seed == 0


def test_one_window_over_the_store_is_a_full_shuffle():
    """Window >= blocks: any permutation; the position of sample 0 over many seeds is uniform."""
    n, trials = 20, 4000
    where = [int(np.flatnonzero(order.block_shuffle(n, 4, 5, seed) == 0)[0]) for seed in range(trials)]
    counts = np.bincount(where, minlength=n)
    chi2 = ((counts - trials / n) ** 2 / (trials / n)).sum()
    assert chi2 < 45    # 19 degrees of freedom: p < 0.001 above 43.8


def test_a_plain_dataloader_takes_it():
    s = dlstore.BlockShuffleSampler(50, block_size=5, window=2, seed=1)
    s.set_epoch(3)
    got = torch.cat(list(DataLoader(torch.arange(50) * 10, batch_size=8, sampler=s))).tolist()
    assert got == [10 * i for i in s.order()]


def test_bad_arguments_name_themselves():
    with pytest.raises(ArgumentError, match="block_size"):
        dlstore.BlockShuffleSampler(10, block_size=0, window=2)
    with pytest.raises(ArgumentError, match="block_size= and window="):
        dlstore.BlockShuffleSampler(10)
    with pytest.raises(ArgumentError, match="rank"):
        dlstore.BlockShuffleSampler(10, block_size=2, window=2, num_replicas=2, rank=2)
    with pytest.raises(ArgumentTypeError, match="seed"):
        dlstore.BlockShuffleSampler(10, block_size=2, window=2, seed=1.5)
    with pytest.raises(ArgumentError, match="process group"):
        dlstore.BlockShuffleSampler(10, block_size=2, window=2, distributed=True)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("order")
    src = make_image_folder(root / "images", classes=3, per_class=10, size=(12, 12))
    return dlstore.convert(src, root / "s.shards", static="center_crop=12", workers=0, progress=False).path


def test_defaults_come_from_the_store_and_the_memory(store, monkeypatch):
    ds = dlstore.open_dataset(store)
    per_sample = order.store_bytes(store) / len(ds)
    assert per_sample >= 3 * 12 * 12
    s = dlstore.BlockShuffleSampler(ds, seed=0)
    assert s.block_size == len(ds) and s.window == 1     # 4 MiB blocks: this small store is one block
    monkeypatch.setattr(order, "BLOCK_BYTES", 5 * per_sample)
    monkeypatch.setattr(order, "memory_available", lambda: int(4 * 10 * 5 * per_sample) + 64)
    s = dlstore.BlockShuffleSampler(ds, seed=0)
    assert s.block_size == 5 and s.window == 5          # a quarter of 40 blocks' bytes for two windows: 5 each
    monkeypatch.setattr(order, "memory_available", lambda: int(4 * 20 * 5 * per_sample) + 64)
    assert dlstore.BlockShuffleSampler(ds, seed=0).window == 6   # 10, cut to the 6 blocks there are
    monkeypatch.setattr(order, "memory_available", lambda: int(4 * 6 * 5 * per_sample) + 64)
    assert dlstore.BlockShuffleSampler(ds, seed=0).window == 3
    monkeypatch.setattr(order, "memory_available", lambda: 0)
    assert dlstore.BlockShuffleSampler(ds, seed=0).window == 2   # never fewer than 2 blocks
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(order, "memory_available", lambda: int(4 * 8 * 5 * per_sample))
    assert dlstore.BlockShuffleSampler(ds, seed=0).window == 2   # the node's 4 ranks share the budget


def test_memory_available_reads_the_process_cgroup(tmp_path):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:   8000 kB\n")
    (proc / "self" / "cgroup").write_text("4:memory:/job\n0::/\n")
    v1 = tmp_path / "cg" / "memory" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("3000000\n")
    (v1 / "memory.usage_in_bytes").write_text("2500000\n")
    (v1 / "memory.stat").write_text("cache 1\ntotal_inactive_file 100000\n")
    assert _system.memory_available(proc, tmp_path / "cg") == 3000000 - 2500000 + 100000
    (v1 / "memory.limit_in_bytes").write_text(str(1 << 62))           # v1's "no limit"
    assert _system.memory_available(proc, tmp_path / "cg") == 8000 * 1024
    (proc / "self" / "cgroup").write_text("0::/job2\n")
    v2 = tmp_path / "cg" / "job2"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("1000000\n")
    (v2 / "memory.current").write_text("400000\n")
    (v2 / "memory.stat").write_text("inactive_file 50000\n")
    assert _system.memory_available(proc, tmp_path / "cg") == 650000
    (v2 / "memory.max").write_text("max\n")
    assert _system.memory_available(proc, tmp_path / "cg") == 8000 * 1024


def test_memory_limit_reads_the_process_cgroup_not_the_root(tmp_path):
    """The limit of the cgroup this process is in (a job's memory cgroup), not the hierarchy's root."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("7:cpu,memory:/job\n0::/\n")
    cg = tmp_path / "cg"
    (cg / "memory" / "job").mkdir(parents=True)
    (cg / "memory" / "memory.limit_in_bytes").write_text(str(1 << 62))   # the root: no limit
    (cg / "memory" / "job" / "memory.limit_in_bytes").write_text("5000000\n")
    assert _system.memory_limit_bytes(cg, proc) == 5000000
    (cg / "memory" / "job" / "memory.limit_in_bytes").write_text(str(1 << 62))
    assert _system.memory_limit_bytes(cg, proc) == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    (proc / "self" / "cgroup").write_text("0::/pod/box\n")              # v2
    (cg / "pod" / "box").mkdir(parents=True)
    (cg / "pod" / "box" / "memory.max").write_text("7000000\n")
    assert _system.memory_limit_bytes(cg, proc) == 7000000


@pytest.mark.parametrize("options", [{"backend": "threads", "num_threads": 2}, {"backend": "ring", "num_workers": 2},
                                     {"backend": "dataloader"}, {"backend": "dataloader", "num_workers": 1}],
                         ids=["threads", "ring", "dataloader-0", "dataloader-1"])
def test_loader_reads_in_the_samplers_order(store, options):
    ds = dlstore.open_dataset(store)
    s = dlstore.BlockShuffleSampler(ds, block_size=4, window=2, seed=9)
    dl = dlstore.loader(ds, 7, sampler=s, **options)
    for epoch in (0, 1):
        dl.set_epoch(epoch)
        want = s.order()
        got = [(x.clone(), y.clone()) for x, y in dl]
        assert len(got) == len(dl) == 5
        images, labels = torch.cat([x for x, _ in got]), torch.cat([y for _, y in got])
        assert labels.tolist() == [ds.targets[i] for i in want]
        assert torch.equal(images, torch.stack([ds.read(int(i)) for i in want]))


def test_loader_refuses_sampler_with_shuffle_or_distributed(store):
    ds = dlstore.open_dataset(store)
    s = dlstore.BlockShuffleSampler(ds, block_size=4, window=2, seed=9)
    for name in ("shuffle", "distributed"):
        with pytest.raises(ArgumentError, match=f"sampler= and {name}=True"):
            dlstore.loader(ds, 4, sampler=s, **{name: True})
    with pytest.raises(ArgumentTypeError, match="sampler="):
        dlstore.loader(ds, 4, sampler=5)


@pytest.mark.parametrize("suffix", [".shards", ".lmdb", ".h5"])
def test_readahead_reads_each_next_windows_samples(tmp_path, suffix):
    """Entering a window advises the next one: its samples' own bytes (found by searching the
    data file for them) are resident before the sampler yields any of them, in every format;
    the first window is advised before the first sample."""
    from _helpers import evict, pages_holding, resident_pages, seen_resident

    n, block, window = 24, 3, 2
    images = np.random.default_rng(3).integers(0, 256, (n, 64, 96, 3), dtype=np.uint8)   # 18 KiB each
    dst = tmp_path / f"s{suffix}"
    dlstore.convert((images, np.arange(n) % 2), dst, workers=0, progress=False)
    data = {".shards": dst / "shard-00000.npy", ".lmdb": dst / "data.mdb", ".h5": dst}[suffix]
    # Opened and searched (LMDB's leaves, HDF5's chunk index) with the file evicted: a page fault
    # maps the cached pages around it too (fault-around), and no eviction drops a mapped page.
    # LMDB without its map's readahead, which would read any sample's neighbours with it.
    evict(data)
    ds = dlstore.open_dataset(dst, reader_options={"readahead": False} if suffix == ".lmdb" else None)
    sampler = dlstore.BlockShuffleSampler(ds, block_size=block, window=window, seed=4)
    groups, starts = order.windows(n, block, window, 4)
    ds.reader.prefetch([0])
    chw = images.transpose(0, 3, 1, 2)
    pages = [set().union(*(pages_holding(data, chw[i]) for b in g.tolist()
                           for i in range(b * block, (b + 1) * block))) for g in groups]
    evict(data)
    kept = set(np.flatnonzero(resident_pages(data)).tolist())   # pages this process maps stay (LMDB's looked-up)
    pages = [p - kept for p in pages]
    if not all(pages):
        pytest.skip(f"this filesystem keeps {data} cached after POSIX_FADV_DONTNEED (tmpfs?): "
                    "cannot observe the advice")

    it = iter(sampler)
    got = [next(it)]
    assert seen_resident(data, pages[0]) == pages[0]
    for w in range(1, len(groups)):
        while len(got) < starts[w - 1] + 1:      # the first sample of window w - 1 advises window w
            got.append(next(it))
        assert seen_resident(data, pages[w]) == pages[w], f"window {w}"
    assert sorted(got + list(it)) == list(range(n))


def test_release_lets_go_of_each_window_read_once_the_one_after_it_is_read(tmp_path, monkeypatch):
    """With ``release``, a window's samples are handed to the reader's ``release`` (the real one,
    recorded) only once the sampler has yielded the whole window after it (a loader takes indices
    ahead of the batches it builds), the last two as the next pass begins; a window partly
    another rank's is never let go. Off by default for a store that fits in memory."""
    from dlstore.formats import readahead

    n, block, window = 24, 3, 3     # windows of 9, 9 and 6 samples
    images = np.random.default_rng(3).integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)
    dst = tmp_path / "s.shards"
    dlstore.convert((images, np.arange(n) % 2), dst, workers=0, progress=False)
    ds = dlstore.open_dataset(dst)
    assert dlstore.BlockShuffleSampler(ds, block_size=block, window=window).release is False
    monkeypatch.setattr(readahead, "memory_limit_bytes", lambda: order.store_bytes(dst))
    assert dlstore.BlockShuffleSampler(ds, block_size=block, window=window).release is True
    assert dlstore.BlockShuffleSampler(ds, block_size=block, window=window, release=False).release is False
    with pytest.raises(ArgumentError, match="release"):
        dlstore.BlockShuffleSampler(ds, block_size=block, window=window, readahead=False, release=True)

    released: list[tuple[int, set[int]]] = []      # (samples yielded so far, the samples let go)
    yielded: list[int] = []
    real = ds.reader.release
    monkeypatch.setattr(ds.reader, "release", lambda indices: released.append(
        (len(yielded), set(np.asarray(indices).tolist()))) or real(indices))
    groups, starts = order.windows(n, block, window, 5)
    samples = [{i for b in g.tolist() for i in range(b * block, min((b + 1) * block, n))} for g in groups]
    sampler = dlstore.BlockShuffleSampler(ds, block_size=block, window=window, seed=5, release=True)
    for index in sampler:
        yielded.append(index)
    assert [s for _, s in released] == [samples[0]]             # window 0, as window 2 began
    assert released[0][0] == starts[2]
    del released[:]
    yielded.clear()
    next(iter(sampler))
    assert [s for _, s in released] == [samples[1], samples[2]] and released[0][0] == 0

    # two ranks of 12: rank 0 holds window 0 whole and part of window 1, rank 1 the rest
    for rank, whole in ((0, [samples[0]]), (1, [samples[2]])):
        del released[:]
        s = dlstore.BlockShuffleSampler(ds, block_size=block, window=window, seed=5, release=True,
                                        num_replicas=2, rank=rank)
        list(s)
        list(s)
        assert all(got in whole for _, got in released) and released
