"""GPUDataset and its loader (``dlstore.loader``, the resident back-end), on device="cpu" (the same
code path as CUDA, minus pinning)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _helpers import run_two_ranks, split_store
from torch.utils.data import DistributedSampler, SequentialSampler
from torchvision.transforms import v2

import dlstore
from dlstore import DeviceMemoryError, GPUDataset, VariableShapeError
from dlstore.sources.demo import make_image_folder
from dlstore.transforms import BatchCompose, BatchTransform

CPU = "cpu"
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
N = 23  # 3 classes: 8 + 8 + 7; not a multiple of any chunk or batch size used below


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A 23-sample 3x12x10 shards store split over several shard files."""
    return split_store(tmp_path_factory.mktemp("gpu"))


@pytest.fixture(scope="module")
def stored(store):
    """Every sample and label as the store holds them (uint8 NCHW, int64)."""
    ds = dlstore.open_dataset(store)
    images = torch.stack([ds.read(i) for i in range(len(ds))])
    return images, torch.tensor(ds.targets)


def _no_prefetch_threads():
    return not any(t.name == "dlstore-prefetch" for t in threading.enumerate())


# --- preload -------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_size", [1, 4, 7, N, 1000])
def test_uint8_preload_equals_the_store(store, stored, chunk_size):
    ds = GPUDataset(store, CPU, torch.uint8, chunk_size=chunk_size)
    images, labels = stored
    assert ds.mode == "preload" and len(ds) == N and ds.data.dtype == torch.uint8
    assert torch.equal(ds.data, images)
    assert torch.equal(ds.labels, labels) and ds.labels.dtype == torch.int64
    assert ds.targets == labels.tolist()   # as StoreDataset's
    assert ds.classes == ["class_00", "class_01", "class_02"]
    assert ds.nbytes == images.numel() + 8 * N == ds.needed_bytes
    image, label = ds[N - 1]
    assert torch.equal(image, images[-1]) and label == int(labels[-1]) == 2
    assert _no_prefetch_threads()


@pytest.mark.parametrize("chunk_size", [1, 4, 11])
def test_generic_read_path_equals_the_shards_fast_path(store, stored, chunk_size, monkeypatch):
    """Without the preadv range read (JPEG stores, user datasets) the preload goes through Reader.get_batch."""
    from dlstore.formats.shards import ShardReader
    monkeypatch.delattr(ShardReader, "read_range")
    ds = GPUDataset(store, CPU, torch.uint8, chunk_size=chunk_size)
    assert torch.equal(ds.data, stored[0]) and torch.equal(ds.labels, stored[1])


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_other_formats_preload_equal(store, stored, tmp_path, fmt):
    from dlstore import formats
    try:
        formats.get_format(fmt)
    except ImportError:
        pytest.skip(f"format {fmt} not landed yet")
    src = dlstore.open_dataset(store).manifest["source"]["root"]
    dst = tmp_path / ("s.lmdb" if fmt == "lmdb" else "s.h5")
    dlstore.convert(src, dst, static="center_crop=12x10", workers=0, progress=False)
    ds = GPUDataset(dst, CPU, torch.uint8, chunk_size=4)
    assert torch.equal(ds.data, stored[0]) and torch.equal(ds.labels, stored[1])


@pytest.mark.parametrize("chunk_size", [1, 5, 1000])
def test_fp16_preload_is_scaled_store_within_rounding(store, stored, chunk_size):
    ds = GPUDataset(store, CPU, chunk_size=chunk_size)
    assert ds.data.dtype == torch.float16 and ds.nbytes == 2 * stored[0].numel() + 8 * N
    expected = stored[0].double() / 255
    # fp16 has 11 significant bits: relative rounding error at most 2**-11.
    assert torch.allclose(ds.data.double(), expected, rtol=2**-11, atol=0)
    assert float(ds.data.min()) >= 0 and float(ds.data.max()) <= 1


def test_normalised_preload_matches_torchvision(store, stored):
    ds = GPUDataset(store, CPU, normalize=(MEAN, STD), chunk_size=6)
    reference = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
    expected = torch.stack([reference(img) for img in stored[0]])
    # The same float32 arithmetic, then one rounding to fp16.
    assert torch.equal(ds.data, expected.to(torch.float16))
    exact = (stored[0].double() / 255 - torch.tensor(MEAN, dtype=torch.float64).view(1, 3, 1, 1)) \
        / torch.tensor(STD, dtype=torch.float64).view(1, 3, 1, 1)
    assert torch.allclose(ds.data.double(), exact, rtol=2**-10, atol=1e-6)
    image, _ = ds[3]
    assert torch.equal(image, expected[3].to(torch.float16))


def test_accepts_an_open_dataset_and_float32(store, stored):
    ds = GPUDataset(dlstore.open_dataset(store), CPU, torch.float32)
    assert torch.equal(ds.data, stored[0].float().mul_(1 / 255))


def test_bad_options_are_refused(store):
    with pytest.raises(ValueError, match="on_overflow"):
        GPUDataset(store, CPU, on_overflow="swap")
    with pytest.raises(ValueError, match="normalize"):
        GPUDataset(store, CPU, torch.uint8, normalize=(MEAN, STD))
    with pytest.raises(ValueError, match="1 or 3 values"):
        GPUDataset(store, CPU, normalize=((0.5, 0.5), (0.2, 0.2)))
    with pytest.raises(ValueError, match="chunk_size"):
        GPUDataset(store, CPU, chunk_size=0)
    with pytest.raises(ValueError, match="rank"):
        GPUDataset(store, CPU, rank=2, world_size=2)
    with pytest.raises(TypeError, match="store path or a dlstore dataset"):
        GPUDataset([torch.zeros(3, 4, 4)], CPU)


def test_variable_shape_store_is_refused(tmp_path):
    src = make_image_folder(tmp_path / "v", classes=2, per_class=3, size=(12, 14), ext=".png",
                            vary_size=True)
    dlstore.convert(src, tmp_path / "v.shards", workers=0, progress=False)
    with pytest.raises(VariableShapeError, match="variable-shape.*center_crop"):
        GPUDataset(tmp_path / "v.shards", CPU)


def test_a_failing_read_stops_the_reader_and_keeps_nothing(store, tmp_path):
    """A shard file damaged after opening: the read fails, the error surfaces, no thread survives."""
    import shutil
    copy = tmp_path / "copy.shards"
    shutil.copytree(store, copy)
    source = dlstore.open_dataset(copy)
    with open(copy / "shard-00002.npy", "r+b") as f:
        f.truncate(200)
    with pytest.raises(dlstore.StoreCorruptError, match="shard-00002"):
        GPUDataset(source, CPU, chunk_size=2)
    assert _no_prefetch_threads()


def _storages(dtype, nbytes):
    """Storages of every live tensor of ``dtype`` whose storage has ``nbytes`` bytes (views included)."""
    import gc
    gc.collect()
    return {o.untyped_storage().data_ptr() for o in gc.get_objects()
            if issubclass(type(o), torch.Tensor) and o.dtype == dtype and o.untyped_storage().nbytes() == nbytes}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.uint8])
def test_a_failed_preload_frees_its_tensors_while_the_error_is_kept(store, tmp_path, dtype):
    """The CPU twin of the CUDA leak check: while the caller still holds the exception and its
    traceback (pytest.raises does), no storage of the data tensor the preload allocated
    (N samples of ``dtype``) may be alive: the frames the error passed through must not keep it."""
    import shutil
    copy = tmp_path / "copy.shards"
    shutil.copytree(store, copy)
    source = dlstore.open_dataset(copy)
    with open(copy / "shard-00002.npy", "r+b") as f:
        f.truncate(200)
    nbytes = N * 3 * 12 * 10 * torch.empty((), dtype=dtype).element_size()
    before = _storages(dtype, nbytes)
    with pytest.raises(dlstore.StoreCorruptError) as info:
        GPUDataset(source, CPU, dtype, chunk_size=2)
    assert info.value.__traceback__ is not None   # the error, with its traceback, is still held
    assert _storages(dtype, nbytes) == before, "the preallocated data tensor outlived the failure"
    assert _no_prefetch_threads()


# --- memory budget and overflow ------------------------------------------------------------

def test_overflow_error_names_the_numbers_and_the_options(store):
    need_uint8 = 3 * 12 * 10 * N + 8 * N
    with pytest.raises(DeviceMemoryError) as info:
        GPUDataset(store, CPU, max_memory=need_uint8 * 2 - 100, chunk_size=1)
    text = str(info.value)
    assert str(store) in text and f"{N:,} samples of 3x12x10 float16" in text
    assert "max_memory=" in text and "on_overflow='uint8'" in text and "on_overflow='stream'" in text
    assert isinstance(info.value, MemoryError)
    assert _no_prefetch_threads()


def test_budget_counts_the_preload_buffers(store):
    ds = GPUDataset(store, CPU, chunk_size=1)
    exact = ds.needed_bytes
    with pytest.raises(DeviceMemoryError, match="preload buffers"):
        GPUDataset(store, CPU, chunk_size=1, max_memory=exact)
    # two host chunks of one sample and one float32 conversion block of one sample
    GPUDataset(store, CPU, chunk_size=1, max_memory=exact + 2 * 360 + 4 * 360)


def test_overflow_uint8_keeps_uint8_and_converts_per_batch(store, stored):
    budget = 3 * 12 * 10 * N + 8 * N + 10_000
    ref = GPUDataset(store, CPU, normalize=(MEAN, STD))
    ds = GPUDataset(store, CPU, normalize=(MEAN, STD), max_memory=budget, on_overflow="uint8",
                    chunk_size=4)
    assert ds.mode == "uint8" and ds.data.dtype == torch.uint8 and torch.equal(ds.data, stored[0])
    assert ds.nbytes < ref.nbytes
    assert torch.equal(ds[5][0], ref[5][0])
    got = list(dlstore.loader(ds, 8, shuffle=True, seed=3))
    want = list(dlstore.loader(ref, 8, shuffle=True, seed=3))
    assert len(got) == len(want) == 3
    for (gi, gl), (wi, wl) in zip(got, want):
        assert gi.dtype == torch.float16 and torch.equal(gi, wi) and torch.equal(gl, wl)


def test_overflow_uint8_that_does_not_fit_either_raises(store):
    with pytest.raises(DeviceMemoryError, match="Even uint8"):
        GPUDataset(store, CPU, max_memory=1000, on_overflow="uint8")


def test_overflow_stream_serves_the_same_batches(store, stored):
    ref = GPUDataset(store, CPU, normalize=(MEAN, STD))
    ds = GPUDataset(store, CPU, normalize=(MEAN, STD), max_memory=1000, on_overflow="stream")
    assert ds.mode == "stream" and ds.data is None and ds.nbytes == 8 * N
    assert torch.equal(ds[7][0], ref[7][0]) and ds[7][1] == ref[7][1]
    for loader_kw in ({"seed": 1, "shuffle": True}, {"seed": 1, "shuffle": True, "drop_last": True}, {}):
        got = list(dlstore.loader(ds, 5, **loader_kw))
        want = list(dlstore.loader(ref, 5, **loader_kw))
        assert len(got) == len(want) == len(dlstore.loader(ds, 5, **loader_kw))
        for (gi, gl), (wi, wl) in zip(got, want):
            assert torch.equal(gi, wi) and torch.equal(gl, wl)
    assert _no_prefetch_threads()


def test_abandoned_stream_epoch_stops_its_reader(store):
    ds = GPUDataset(store, CPU, torch.uint8, max_memory=1000, on_overflow="stream")
    it = iter(dlstore.loader(ds, 2, shuffle=True, seed=0))
    next(it)
    it.close()
    assert _no_prefetch_threads()


@pytest.mark.parametrize("prefetch_factor, ahead", [(None, 2), (1, 1), (4, 4)])
def test_prefetch_factor_is_the_batches_a_stream_reads_ahead(store, monkeypatch, prefetch_factor, ahead):
    """While the first batch is held, the reader thread reads ``prefetch_factor`` batches (that one
    included) and waits: the argument reaches the resident back-end through the one entry."""
    ds = GPUDataset(store, CPU, torch.uint8, max_memory=1000, on_overflow="stream")
    read, reads = ds.read, []
    monkeypatch.setattr(ds, "read", lambda indices: reads.append(len(indices)) or read(indices))
    it = iter(dlstore.loader(ds, 2, prefetch_factor=prefetch_factor))
    next(it)
    deadline = time.monotonic() + 20
    while len(reads) < ahead and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)          # time to read one more, were it allowed to
    assert len(reads) == ahead
    it.close()
    assert _no_prefetch_threads()


# --- the loader ----------------------------------------------------------------------------

def _epoch(loader):
    images, labels = zip(*loader)
    return torch.cat(images), torch.cat(labels)


@pytest.fixture(scope="module")
def u8(store):
    """The store held uint8, without a transform (tests that need one make a dataset of their own)."""
    return GPUDataset(store, CPU, torch.uint8, chunk_size=5)


def _sample_ids(images, stored_images):
    """Index in the store of each image (samples of the synthetic folder are all different)."""
    flat = stored_images.flatten(1)
    ids = []
    for img in images.flatten(1):
        match = torch.nonzero((flat == img).all(dim=1)).flatten()
        assert len(match) == 1
        ids.append(int(match[0]))
    return ids


def _order(loader, stored):
    """The store indices one pass of ``loader`` serves, in order."""
    return _sample_ids(_epoch(loader)[0], stored[0])


def test_a_gpu_datasets_loader_is_the_one_loader_in_store_order_by_default(store, u8):
    loader = dlstore.loader(u8, 5)
    assert type(loader) is type(dlstore.loader(dlstore.open_dataset(store), 5)) is dlstore.Loader
    assert loader.backend == "resident" == dlstore.loader(u8, 5, backend="resident").backend
    assert loader.dataset is u8 and loader.batch_size == 5 and len(loader) == 5
    assert (loader.shuffle, loader.drop_last, loader.num_workers, loader.seed) == (False, False, 0, None)
    assert isinstance(loader.sampler, SequentialSampler) and len(loader.batch_sampler) == 5
    in_order = torch.cat([labels for _, labels in loader])
    assert torch.equal(in_order, u8.labels), "shuffle=False is the default, as in DataLoader"


def test_arguments_that_do_not_apply_to_a_gpu_dataset_are_refused(store, u8):
    for name, value in (("num_workers", 2), ("num_threads", 2), ("device", CPU), ("persistent_workers", True)):
        with pytest.raises(dlstore.ArgumentError, match=f"{name} does not apply to a GPUDataset"):
            dlstore.loader(u8, 4, **{name: value})
    with pytest.raises(dlstore.ArgumentError, match="fused does not apply to a StoreDataset"):
        dlstore.loader(dlstore.open_dataset(store), 4, fused=True)


def test_every_sample_once_per_epoch_with_matching_labels(u8, stored):
    loader = dlstore.loader(u8, 6, shuffle=True, seed=11)
    assert len(loader) == 4
    images, labels = _epoch(loader)
    ids = _sample_ids(images, stored[0])
    assert sorted(ids) == list(range(N))
    assert torch.equal(labels, stored[1][ids])


def test_an_epoch_is_a_function_of_the_seed_and_the_epoch(u8, stored):
    a = dlstore.loader(u8, 4, shuffle=True, seed=5)
    orders = [_order(a, stored) for _ in range(4)]      # each iter() is the next epoch
    assert len({tuple(o) for o in orders}) == 4
    assert all(sorted(o) == list(range(N)) for o in orders)
    b = dlstore.loader(u8, 4, shuffle=True, seed=5)
    torch.rand(100)                                     # torch's generator moved: no matter with a seed
    b.set_epoch(2)
    assert _order(b, stored) == orders[2] and _order(b, stored) == orders[3]
    b.set_epoch(0)
    assert _order(b, stored) == orders[0]
    assert _order(dlstore.loader(u8, 4, shuffle=True, seed=6), stored) != orders[0]


def test_without_a_seed_the_order_comes_from_torchs_generator(u8, stored):
    """seed=None (the default): as DataLoader, a fresh order each run, reproducible under torch.manual_seed."""
    torch.manual_seed(1)
    loader = dlstore.loader(u8, 4, shuffle=True)
    first, second = _order(loader, stored), _order(loader, stored)
    assert first != second and sorted(first) == list(range(N))
    torch.manual_seed(1)
    assert _order(dlstore.loader(u8, 4, shuffle=True), stored) == first
    torch.manual_seed(2)
    assert _order(dlstore.loader(u8, 4, shuffle=True), stored) != first


def test_the_order_is_the_samplers_as_on_a_store(store, u8, stored):
    """The order comes from the loader's sampler, drawn on the host by the rule of every back-end: the
    same seed orders a store read by threads and its GPUDataset alike; a given sampler is followed."""
    host = dlstore.loader(dlstore.open_dataset(store), 4, shuffle=True, seed=5, backend="threads")
    gpu = dlstore.loader(u8, 4, shuffle=True, seed=5)
    for _ in range(2):
        host_images, host_labels = _epoch(host)
        images, labels = _epoch(gpu)
        assert torch.equal(images, host_images) and torch.equal(labels, torch.as_tensor(host_labels))
    order = torch.randperm(N, generator=torch.Generator().manual_seed(3)).tolist()[:17]
    assert _order(dlstore.loader(u8, 4, sampler=order), stored) == order


def test_unshuffled_order_is_store_order(u8, stored):
    images, labels = _epoch(dlstore.loader(u8, 5, shuffle=False))
    assert torch.equal(images, stored[0]) and torch.equal(labels, stored[1])


@pytest.mark.parametrize("batch_size", [1, 4, 5, N, 50])
@pytest.mark.parametrize("drop_last", [False, True])
def test_len_matches_the_batches(u8, batch_size, drop_last):
    loader = dlstore.loader(u8, batch_size, shuffle=True, drop_last=drop_last, seed=0)
    sizes = [len(x) for x, _ in loader]
    assert len(sizes) == len(loader) == (N // batch_size if drop_last else -(-N // batch_size))
    assert all(s == batch_size for s in sizes[:-1])
    if drop_last:
        assert all(s == batch_size for s in sizes)
    else:
        assert sum(sizes) == N


def _rank_loader(ds, rank, world_size, batch_size=3, seed=9):
    """A rank chosen by hand: the loader of ``rank`` of ``world_size`` over the whole dataset."""
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    return dlstore.loader(ds, batch_size, sampler=sampler)


@pytest.mark.parametrize("world_size", [2, 3, 4, 23, 30])
def test_ranks_by_hand_share_each_epoch_disjoint_complete_and_equal(u8, stored, world_size):
    for epoch in (0, 1):
        shares = []
        for rank in range(world_size):
            loader = _rank_loader(u8, rank, world_size)
            loader.set_epoch(epoch)
            batches = list(loader)
            assert len(batches) == len(loader)
            shares.append(_sample_ids(torch.cat([x for x, _ in batches]), stored[0]))
            reference = DistributedSampler(range(N), num_replicas=world_size, rank=rank, shuffle=True, seed=9)
            reference.set_epoch(epoch)
            assert shares[-1] == list(reference)   # the sampler's order, its epoch set by the loader's
        assert len({len(s) for s in shares}) == 1  # equal lengths: no rank waits for another
        assert len({len(_rank_loader(u8, r, world_size)) for r in range(world_size)}) == 1
        flat = [i for s in shares for i in s]
        assert set(flat) == set(range(N))  # complete
        padding = len(shares[0]) * world_size - N
        assert len(flat) - len(set(flat)) == padding < world_size  # disjoint but for the padding


def test_two_ranks_by_hand_serve_different_samples(u8, stored):
    a = _order(_rank_loader(u8, 0, 2, batch_size=4, seed=2), stored)
    b = _order(_rank_loader(u8, 1, 2, batch_size=4, seed=2), stored)
    assert len(a) == len(b) == 12 and len(set(a) & set(b)) == 1  # 23 -> padded to 24: one repeat
    assert set(a) | set(b) == set(range(N))


# Each rank of a 2-process gloo group (``_helpers.run_two_ranks``).
_DDP_WORKER = """
torch.manual_seed(100 + rank)   # the ranks' generators differ: they agree on the order through rank 0's seed only
ds = dlstore.GPUDataset(store, "cpu", torch.uint8)                  # the whole store on every rank
loader = dlstore.loader(ds, 4, shuffle=True, distributed=True)      # no seed: rank 0 draws one for every rank
held = ds.data.flatten(1)
epochs = []
for epoch in (0, 1):
    loader.set_epoch(epoch)
    batches = [x for x, _ in loader]
    served = [int((held == img.flatten()).all(1).nonzero()) for x in batches for img in x]
    epochs.append({"served": served, "batches": len(batches), "len": len(loader)})
result = {"rank": dist.get_rank(), "world": dist.get_world_size(), "seed": loader.sampler.seed, "epochs": epochs}
"""


@pytest.mark.slow
def test_under_torch_distributed_ranks_split_each_epoch(store, tmp_path):
    results = run_two_ranks(_DDP_WORKER, store, tmp_path, timeout=120)
    assert [(r["rank"], r["world"]) for r in results] == [(0, 2), (1, 2)]
    assert results[0]["seed"] == results[1]["seed"]
    for e in (0, 1):
        a, b = (r["epochs"][e] for r in results)
        assert a["batches"] == b["batches"] == a["len"] == b["len"] == 3
        assert len(a["served"]) == len(b["served"]) == 12
        assert set(a["served"]) | set(b["served"]) == set(range(N))
        assert len(set(a["served"]) & set(b["served"])) == 1  # 23 padded to 24 by wrapping
        for r in results:      # DistributedSampler's order for the agreed seed and the epoch
            reference = DistributedSampler(range(N), num_replicas=2, rank=r["rank"], seed=results[0]["seed"])
            reference.set_epoch(e)
            assert r["epochs"][e]["served"] == list(reference)
    assert results[0]["epochs"][0]["served"] != results[0]["epochs"][1]["served"]


def test_transform_gets_the_batch_and_a_generator(store, u8):
    seen = []

    def flip_some(images, generator=None):
        seen.append(generator)
        flip = torch.rand(len(images), generator=generator, device=images.device) < 0.5
        return torch.where(flip.view(-1, 1, 1, 1), images.flip(-1), images)

    ds = GPUDataset(store, CPU, torch.uint8, transform=flip_some)
    a = _epoch(dlstore.loader(ds, 8, shuffle=True, seed=4))[0]
    b = _epoch(dlstore.loader(ds, 8, shuffle=True, seed=4))[0]
    assert torch.equal(a, b)  # augmentation is reproducible from the seed
    assert seen and all(isinstance(g, torch.Generator) for g in seen)
    plain = _epoch(dlstore.loader(u8, 8, shuffle=True, seed=4))[0]
    flipped = [not torch.equal(x, p) for x, p in zip(a, plain)]
    assert any(flipped) and not all(flipped)
    assert all(torch.equal(x, p.flip(-1)) for x, p, f in zip(a, plain, flipped) if f)


def test_the_pipeline_is_the_datasets_transform(store):
    """A GPUDataset holds its pipeline (planned at construction and on assignment, for the loaders made
    after); the loader's 0.2 spellings raise, naming it."""
    flip = v2.RandomHorizontalFlip(p=1.0)
    ds = GPUDataset(store, device=CPU, dtype=torch.uint8, transform=flip)
    images, _ = next(iter(dlstore.loader(ds, 4)))
    assert torch.equal(images, ds.data[:4].flip(-1))
    ds.transform = None
    assert ds.transform is None and ds.steps == []
    assert torch.equal(next(iter(dlstore.loader(ds, 4)))[0], ds.data[:4])
    for name in ("transform", "batch_transform"):
        with pytest.raises(dlstore.ArgumentError, match=rf"{name}= is gone.*GPUDataset\(path, transform=\.\.\.\)"):
            dlstore.loader(ds, 4, **{name: flip})


class RecordSizes(BatchTransform):
    """A batch transform that records the size of each batch (or group of batches) it is given."""

    def __init__(self):
        self.sizes = []

    def apply(self, images, params):
        self.sizes.append(len(images))
        return images


def _grouped_epoch(store, stored):
    """One epoch of the store held uint8, in batches of 4 through a RecordSizes, every sample once with
    its label: (the RecordSizes, the loader's ``group_batches``, the dataset)."""
    grouped = RecordSizes()
    ds = GPUDataset(store, CPU, torch.uint8, transform=BatchCompose([grouped]))
    loader = dlstore.loader(ds, 4, shuffle=True, seed=1)
    batches = list(loader)
    assert [len(x) for x, _ in batches] == [4, 4, 4, 4, 4, 3]
    ids = _sample_ids(torch.cat([x for x, _ in batches]), stored[0])
    assert sorted(ids) == list(range(N)) and torch.equal(torch.cat([y for _, y in batches]), stored[1][ids])
    return grouped, loader.strategy.group_batches, ds


def test_per_sample_batch_transforms_run_on_groups_of_batches(store, stored):
    grouped, groups, ds = _grouped_epoch(store, stored)
    assert groups > 1 and grouped.sizes == [N]
    grouped.sizes.clear()
    ds.transform = grouped
    assert [len(x) for x, _ in dlstore.loader(ds, 4, shuffle=True, seed=1, drop_last=True)] == [4] * 5
    assert grouped.sizes == [20]
    # a callable that is not a dlstore batch transform may depend on the batch: one at a time
    sizes = []
    ds.transform = BatchCompose([grouped, lambda x, g=None: sizes.append(len(x)) or x])
    loader = dlstore.loader(ds, 4, shuffle=True, seed=1)
    assert loader.strategy.group_batches == 1
    list(loader)
    assert sizes == [4, 4, 4, 4, 4, 3]


def test_transform_without_generator_and_channels_last(store):
    ds = GPUDataset(store, CPU, torch.uint8, transform=lambda x: x.float())
    loader = dlstore.loader(ds, 8, shuffle=True, seed=0, channels_last=True)
    for images, _ in loader:
        assert images.dtype == torch.float32
        assert images.is_contiguous(memory_format=torch.channels_last)
    images, _ = next(iter(dlstore.loader(ds, 8)))
    assert images.is_contiguous() and not images.is_contiguous(memory_format=torch.channels_last)


def test_batch_transforms_from_dlstore_transforms(store):
    from dlstore.transforms import BatchRandomCrop, BatchRandomHorizontalFlip

    aug = BatchCompose([BatchRandomCrop((12, 10), padding=2), BatchRandomHorizontalFlip()])
    ds = GPUDataset(store, CPU, transform=aug)
    out = list(dlstore.loader(ds, 8, shuffle=True, seed=0))
    assert [tuple(x.shape) for x, _ in out] == [(8, 3, 12, 10), (8, 3, 12, 10), (7, 3, 12, 10)]
    assert all(x.dtype == torch.float16 for x, _ in out)
    again = list(dlstore.loader(ds, 8, shuffle=True, seed=0))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(out, again))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(out, dlstore.loader(ds, 8, shuffle=True, seed=1)))


def test_torchvision_pipelines_and_hybrids_as_open_dataset_takes_them(store, stored):
    """Ops with a batch equivalent run per batch, others per sample (uint8 pixels), or a clear error."""
    from dlstore import TransformSpecError
    from dlstore.transforms import BatchNormalize, BatchRandomCrop, HybridTransform
    from dlstore.transforms.planner import PerSample

    static = dlstore.open_dataset(store).manifest["static"]
    hybrid = HybridTransform(static, [v2.RandomCrop((12, 10), padding=2), v2.ColorJitter(0.5),
                                      v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
    u8 = GPUDataset(store, CPU, torch.uint8, transform=hybrid)
    assert [type(fn) for fn, _ in u8.steps] == [BatchRandomCrop, PerSample, BatchNormalize]
    assert u8.already_applied == []                    # a hybrid's static part is declared, not run
    centre = v2.CenterCrop((12, 10))
    whole = GPUDataset(store, CPU, torch.uint8, transform=v2.Compose([centre, v2.RandomHorizontalFlip(p=1.0)]))
    assert whole.already_applied == [centre]          # the store's static stage: planned, not run again
    assert torch.equal(next(iter(dlstore.loader(whole, 4)))[0], stored[0][:4].flip(-1))
    images, _ = _epoch(dlstore.loader(u8, 8, seed=0))
    assert images.shape == (N, 3, 12, 10) and images.dtype == torch.float32
    assert torch.equal(images, _epoch(dlstore.loader(u8, 8, seed=0))[0])   # seeded per-sample ops
    mismatch = HybridTransform("center_crop=8", [v2.RandomHorizontalFlip()])
    with pytest.raises(dlstore.StaticMismatchError):
        GPUDataset(store, CPU, torch.uint8, transform=mismatch)
    with pytest.raises(dlstore.StaticMismatchError):
        u8.transform = mismatch
    assert u8.transform is hybrid and [type(fn) for fn, _ in u8.steps] == [BatchRandomCrop, PerSample, BatchNormalize]
    fp16 = GPUDataset(store, CPU, normalize=(MEAN, STD))
    with pytest.raises(TransformSpecError, match="ColorJitter.*dtype=torch.uint8"):
        fp16.transform = v2.Compose([v2.RandomHorizontalFlip(), v2.ColorJitter(0.5)])
    with pytest.raises(TransformSpecError, match="already does"):
        fp16.transform = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
    with pytest.raises(TransformSpecError, match="callable"):
        GPUDataset(store, CPU, normalize=(MEAN, STD), transform="flip")


def test_generator_goes_only_to_a_parameter_named_generator():
    from dlstore.transforms.planner import accepts_generator

    def named(x, generator=None):
        return x

    def kw_only(x, *, generator):
        return x

    def var_kw(x, **kwargs):
        return x

    assert accepts_generator(named) and accepts_generator(kw_only)
    assert not accepts_generator(var_kw) and not accepts_generator(lambda x, g=None: x)
    assert not accepts_generator(torch.nn.Identity()) and not accepts_generator(v2.RandomHorizontalFlip())


@pytest.mark.parametrize("fused", [True, False])
def test_fused_reaches_the_resident_back_end(store, fused):
    """fused= through the one entry decides the gather (test_gpu_fused.py holds the two to the same bits)."""
    crop_flip = v2.Compose([v2.RandomCrop(8, padding=2), v2.RandomHorizontalFlip()])
    ds = GPUDataset(store, device=CPU, dtype=torch.uint8, transform=crop_flip)
    loader = dlstore.loader(ds, 4, shuffle=True, seed=3, fused=fused)
    assert loader.strategy.fused is fused and (loader.strategy.gather is not None) is fused
    assert [tuple(x.shape) for x, _ in loader] == [(4, 3, 8, 8)] * 5 + [(3, 3, 8, 8)]


def test_groups_on_the_cpu_are_cpu_sized_and_give_every_sample_once(store, stored, monkeypatch):
    from dlstore.data.loaders import resident

    assert resident.CPU_GROUP_BYTES < 32 << 20 <= resident.GROUP_BYTES   # glibc's largest mmap threshold
    batch = 4 * 3 * 12 * 10                                      # bytes of a batch of 4 (uint8)
    monkeypatch.setattr(resident, "CPU_GROUP_BYTES", 2 * batch + 1)
    monkeypatch.setattr(resident, "GROUP_BYTES", 1)              # what a GPU would get: not this
    grouped, groups, _ = _grouped_epoch(store, stored)
    assert groups == 2 and grouped.sizes == [8, 8, 7]


def test_a_gpu_dataset_is_a_dataset_whose_targets_are_the_stores(store):
    gpu, cpu = GPUDataset(store, device=CPU, dtype=torch.uint8), dlstore.open_dataset(store)
    assert isinstance(gpu, torch.utils.data.Dataset)
    assert type(gpu.targets) is type(cpu.targets) and gpu.targets == cpu.targets   # a list of ints, as StoreDataset's
    assert gpu.labels.tolist() == cpu.targets and gpu.labels.device.type == CPU
    loader = torch.utils.data.DataLoader(gpu, batch_size=5)   # a plain DataLoader takes it too
    images, labels = next(iter(loader))
    assert torch.equal(images, torch.stack([cpu.read(i) for i in range(5)])) and labels.tolist() == cpu.targets[:5]


# --- CUDA (skipped without a GPU) ----------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@needs_cuda
def test_cuda_preload_equals_cpu_preload(store):
    cpu = GPUDataset(store, CPU, normalize=(MEAN, STD), chunk_size=4)
    gpu = GPUDataset(store, "cuda", normalize=(MEAN, STD), chunk_size=4)
    assert gpu.data.is_cuda and gpu.labels.is_cuda
    assert torch.equal(gpu.data.cpu(), cpu.data) and torch.equal(gpu.labels.cpu(), cpu.labels)
    images, labels = next(iter(dlstore.loader(gpu, 8, shuffle=True, seed=0)))
    assert images.is_cuda and labels.is_cuda
    want, want_labels = next(iter(dlstore.loader(cpu, 8, shuffle=True, seed=0)))   # the same order and samples
    assert torch.equal(images.cpu(), want) and torch.equal(labels.cpu(), want_labels)


@pytest.mark.cuda
@needs_cuda
def test_cuda_overflow_and_failures_leak_no_memory(store, tmp_path):
    import shutil
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with pytest.raises(DeviceMemoryError):
        GPUDataset(store, "cuda", max_memory=1000)
    copy = tmp_path / "copy.shards"
    shutil.copytree(store, copy)
    source = dlstore.open_dataset(copy)
    with open(copy / "shard-00002.npy", "r+b") as f:
        f.truncate(200)
    with pytest.raises(dlstore.StoreCorruptError):
        GPUDataset(source, "cuda", chunk_size=2)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.cuda
@needs_cuda
def test_cuda_stream_mode_matches_preload(store):
    ref = GPUDataset(store, "cuda")
    ds = GPUDataset(store, "cuda", max_memory=1000, on_overflow="stream")
    got = list(dlstore.loader(ds, 5, shuffle=True, seed=0))
    want = list(dlstore.loader(ref, 5, shuffle=True, seed=0))
    assert len(got) == len(want) == 5
    for (a, la), (b, lb) in zip(got, want):
        assert a.is_cuda and torch.equal(a, b) and torch.equal(la, lb)


# --- the GPU check script, on CPU ----------------------------------------------------------

@pytest.mark.slow
def test_gpu_check_script_runs_on_cpu(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "check.json"
    assert module.main(["--device", "cpu", "--quick", "--cifar", "300", "--imagenet", "40",
                        "--epochs", "1", "--repeats", "1", "--batch", "64",
                        "--workdir", str(tmp_path), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for kind in ("cifar", "imagenet"):
        pre = result["preload"][kind]
        assert pre["labels_equal"] and pre["uint8_equal_to_store"]
        assert pre["max_abs_diff_vs_cpu_path"] == 0
        assert pre["samples"] == result["stores"][kind]["count"]
        assert result["gpu_loader"][kind]["samples_per_s"]["median"] > 0
        assert result["dataloader"][kind]["best"]["samples_per_s"]["median"] > 0
    # every residency / gather variant served the baseline's batches bit for bit
    assert result["residency"]["variants"] and all(v["same_batches"] for v in result["residency"]["variants"].values())
    assert {v["mode"] for v in result["residency"]["variants"].values()} == {"preload", "uint8"}
    for r in result["device_loader"].values():
        assert min(r["samples_per_s"].values()) > 0
        assert r["bytes_per_sample_delivered"]["device"] == r["bytes_per_sample_delivered"]["cpu_float32"]
    jpeg = result["jpeg_decode"]      # on CPU: PIL and decode_jpeg on the same libjpeg-turbo records
    assert jpeg["images"] == 40 and jpeg["pil"]["identical_to_pil"] and jpeg["pil"]["max_abs_diff"] == 0
    assert jpeg["decode_jpeg cpu"]["images_per_s"]["median"] > 0 and "decode_jpeg cuda" not in jpeg
    jstore = result["jpeg_store_device"]   # on CPU the device path's crops are the host's, bit for bit
    assert jstore["decodes_on_device"] == "DeviceDecode" and jstore["uint8_vs_host"]["max_abs_diff"] == 0
    assert min(jstore[w]["samples_per_s"]["median"] for w in ("host decode", "device decode")) > 0
    assert "device_tests" not in result  # CUDA only, unless --tests
    assert "GPU loader / best DataLoader" in capsys.readouterr().out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("dlstore-gpu-check-")]  # cleaned up
