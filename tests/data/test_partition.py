"""GPUDataset(shard=True): each rank holds only its share; the partition and the order of a share.

The partition functions and ``ShareSampler`` (the order ``dlstore.loader`` gives a
sharded dataset) are checked as properties over sizes and world sizes; the sharded
dataset in a real 2-process gloo group, its data against the store read by numpy
from the shard files.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _helpers import run_two_ranks, split_store
from hypothesis import given, settings
from hypothesis import strategies as st

import dlstore
from dlstore.data.gpu.partition import ShareSampler, per_rank, rank_share
from dlstore.errors import ArgumentError

N = 23


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """23 samples of 3x12x10 over 5 shard files, ordered by class (ImageFolder order)."""
    return split_store(tmp_path_factory.mktemp("partition"))


def _store_arrays(store):
    """All samples and labels, read with numpy from the shard files (not through dlstore's reader)."""
    layout = json.loads((store / "manifest.json").read_text())["layout"]
    images = np.concatenate([np.load(store / s["file"]) for s in layout["shards"]])
    return images, np.load(store / layout["labels"])


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 500), world=st.integers(1, 16), seed=st.integers(0, 2**32))
def test_shares_are_disjoint_complete_balanced_and_sorted(n, world, seed):
    if n < world:
        with pytest.raises(ArgumentError, match="at least one"):
            rank_share(n, 0, world, seed=seed)
        return
    shares = [rank_share(n, r, world, seed=seed) for r in range(world)]
    flat = np.concatenate(shares)
    assert sorted(flat.tolist()) == list(range(n))  # disjoint and complete
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert max(map(len, shares)) == per_rank(n, world)
    assert all(np.array_equal(s, np.sort(s)) for s in shares)
    assert np.array_equal(shares[0], rank_share(n, 0, world, seed=seed))  # the same on every call


def test_partition_is_random_not_contiguous():
    # A class-ordered store cut into contiguous blocks gives a rank a few classes only.
    share = rank_share(1000, 0, 4, seed=0)
    assert share.min() < 50 and share.max() > 950
    assert not np.array_equal(share, rank_share(1000, 0, 4, seed=1))


def test_bad_rank_and_world_size():
    for rank, world in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ArgumentError):
            rank_share(10, rank, world)


def _generator(seed):
    return torch.Generator().manual_seed(seed)


@settings(max_examples=100, deadline=None)
@given(local=st.integers(1, 60), extra=st.integers(0, 1), seed=st.integers(0, 2**40), shuffle=st.booleans())
def test_share_sampler_covers_the_share_and_pads_by_wrapping(local, extra, seed, shuffle):
    count = local + extra
    sampler = ShareSampler(local, count, shuffle=shuffle, generator=_generator(seed))
    order = list(sampler)
    assert len(order) == len(sampler) == count
    assert sorted(order[:local]) == list(range(local))
    assert order[local:] == order[:count - local]
    assert order == list(ShareSampler(local, count, shuffle=shuffle, generator=_generator(seed)))
    if not shuffle:
        assert order[:local] == list(range(local))


def test_share_sampler_draws_each_pass_from_its_generator():
    sampler = ShareSampler(50, 50, shuffle=True, generator=_generator(1))
    first, second = list(sampler), list(sampler)
    assert first != second and sorted(first) == sorted(second) == list(range(50))
    assert list(ShareSampler(50, 50, shuffle=True, generator=_generator(2))) != first
    torch.manual_seed(3)                      # no generator: a seed drawn from torch's, as RandomSampler
    unseeded = list(ShareSampler(50, 50, shuffle=True))
    torch.manual_seed(3)
    assert list(ShareSampler(50, 50, shuffle=True)) == unseeded
    for local, count in ((0, 1), (5, 4)):
        with pytest.raises(ArgumentError, match="1 <= local <= count"):
            ShareSampler(local, count, shuffle=True)


def test_sharded_dataset_without_a_group_holds_its_share(store):
    images, labels = _store_arrays(store)
    for rank in range(3):
        ds = dlstore.GPUDataset(store, "cpu", torch.uint8, shard=True, rank=rank, world_size=3, partition_seed=5)
        share = rank_share(N, rank, 3, seed=5)
        assert np.array_equal(ds.store_indices, share)
        assert len(ds) == len(share) and ds.sharded
        assert np.array_equal(ds.data.numpy(), images[share])
        assert ds.targets == labels[share].tolist()
        loader = dlstore.loader(ds, 4, shuffle=True, seed=3)
        assert isinstance(loader.sampler, ShareSampler) and len(loader.sampler) == per_rank(N, 3)
        assert len(loader) == -(-per_rank(N, 3) // 4)  # every rank the same number of batches
        served = _positions(ds, loader)
        assert len(served) == per_rank(N, 3) and set(served) == set(range(len(ds)))
        assert _positions(ds, dlstore.loader(ds, 4)) == list(range(len(ds))) + [0] * (per_rank(N, 3) - len(ds))


def _positions(ds, loader):
    """The positions in ``ds`` (its held samples) of what one pass of ``loader`` serves, in order."""
    held = ds.data.flatten(1)
    return [int((held == img.flatten()).all(1).nonzero()) for images, _ in loader for img in images]


def test_a_sharded_epoch_is_a_function_of_the_seed_and_the_epoch(store):
    ds = dlstore.GPUDataset(store, "cpu", torch.uint8, shard=True, rank=1, world_size=3)
    loader = dlstore.loader(ds, 4, shuffle=True, seed=3)
    orders = [_positions(ds, loader) for _ in range(3)]
    assert len({tuple(o) for o in orders}) == 3
    again = dlstore.loader(ds, 4, shuffle=True, seed=3)
    again.set_epoch(2)
    assert _positions(ds, again) == orders[2]
    with pytest.raises(ArgumentError, match="sampler=.*one rank.s share"):
        dlstore.loader(ds, 4, sampler=[0, 1])


def test_sharded_ranks_draw_their_own_order(store):
    """Ranks 0-2 of 4 hold 6 samples each: with one seed on every rank (as a job passes it), each must
    still permute its share its own way, or the global batch takes the same positions of every share
    (sorted shares of a class-ordered store: samples of the same few classes)."""
    orders = []
    for rank in range(3):
        ds = dlstore.GPUDataset(store, "cpu", torch.uint8, shard=True, rank=rank, world_size=4)
        orders.append(_positions(ds, dlstore.loader(ds, 3, shuffle=True, seed=11)))
    assert len({tuple(o) for o in orders}) == 3


def test_sharded_dataset_holds_a_fraction_of_the_memory(store):
    whole = dlstore.GPUDataset(store, "cpu", torch.float16)
    half = dlstore.GPUDataset(store, "cpu", torch.float16, shard=True, rank=0, world_size=2)
    assert half.nbytes < 0.6 * whole.nbytes
    assert half.needed_bytes < 0.6 * whole.needed_bytes


def test_shard_needs_more_samples_than_ranks(store):
    with pytest.raises(ArgumentError, match="at least one"):
        dlstore.GPUDataset(store, "cpu", torch.uint8, shard=True, rank=0, world_size=N + 1)


# Each rank of a 2-process gloo group (``_helpers.run_two_ranks``).
_WORKER = """
ds = dlstore.GPUDataset(store, "cpu", torch.uint8, shard=True)    # rank, world size from the group
loader = dlstore.loader(ds, 4, shuffle=True, seed=11)
epochs = []
for epoch in (0, 1):
    loader.set_epoch(epoch)
    batches = [(x.clone(), y.clone()) for x, y in loader]
    # every served image is one of this rank's samples, with its own label
    local = {ds.store_indices[i]: i for i in range(len(ds))}
    served = []
    for x, y in batches:
        for img, label in zip(x, y):
            hits = [i for i in range(len(ds)) if torch.equal(ds.data[i], img) and ds.targets[i] == label]
            assert hits, "served a sample that this rank does not hold"
            served.append(int(ds.store_indices[hits[0]]))
    epochs.append({"served": served, "batches": len(batches), "len": len(loader)})
try:
    dlstore.loader(ds, 4, shuffle=True, distributed=True)
    refused = ""
except dlstore.ArgumentError as exc:
    refused = str(exc)
gathered = [None, None]
dist.all_gather_object(gathered, ds.store_indices.tolist())
result = {"rank": ds.rank, "world": ds.world_size, "share": ds.store_indices.tolist(), "all": gathered,
          "epochs": epochs, "data": ds.data.numpy().tolist(), "targets": ds.targets, "refused": refused}
"""


@pytest.mark.slow
def test_two_process_gloo_group_each_rank_holds_and_serves_its_share(store, tmp_path):
    results = run_two_ranks(_WORKER, store, tmp_path, timeout=180)
    images, labels = _store_arrays(store)
    assert [(r["rank"], r["world"]) for r in results] == [(0, 2), (1, 2)]
    a, b = (set(r["share"]) for r in results)
    assert not a & b and a | b == set(range(N))  # a partition of the store
    assert results[0]["all"] == results[1]["all"] == [results[0]["share"], results[1]["share"]]
    for r in results:
        assert np.array_equal(np.asarray(r["data"], dtype=np.uint8), images[r["share"]])
        assert r["targets"] == labels[r["share"]].tolist()
        for e in r["epochs"]:
            assert e["batches"] == e["len"] == 3  # 12 samples per rank (23 padded to 24), batch 4
            assert len(e["served"]) == 12 and set(e["served"]) == set(r["share"])
        assert r["epochs"][0]["served"] != r["epochs"][1]["served"]  # a new order each epoch
        assert "holds one rank's share" in r["refused"]   # distributed=True would split the share again
