"""The threads back-end (``dlstore.loader(..., backend="threads", num_threads=N)``) and get_batch under threads.

Every format is read from several threads at once and compared with a
single-threaded read: a deterministic crop + flip (the output is the flipped
sample, whatever the draws) and a random one with a generator per batch.
The loader's batches must not depend on the thread count, and a batch the
user holds must never change.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler
from torchvision.transforms import v2

import dlstore
from dlstore.data import batch_path as batch_path_module
from dlstore.data.loaders.seeds import batch_seed
from dlstore.errors import ArgumentError

# torchvision 0.29 deprecates its image decoders (for TorchCodec) and warns on every call
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding:DeprecationWarning")

FORMATS = ["shards", "lmdb", "hdf5"]
SUFFIX = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def stores(rgb_folder, tmp_path_factory):
    """The 24-sample RGB folder as 3x32x32 stores of every format, and a JPEG-encoded LMDB store."""
    root = tmp_path_factory.mktemp("thread-stores")
    out = {fmt: dlstore.convert(rgb_folder, root / f"s{SUFFIX[fmt]}", static="resize=36,center_crop=32",
                                workers=0, progress=False).path for fmt in FORMATS}
    out["jpeg"] = dlstore.convert(rgb_folder, root / "j.lmdb", static="resize=36,center_crop=32", workers=0,
                                  progress=False, encoding="jpeg").path
    return out


def _tasks(n_samples: int, count: int, batch: int, seed: int = 0) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, n_samples, batch), int(rng.integers(0, 2**31))) for _ in range(count)]


def _concurrently(ds, tasks, threads: int) -> list[torch.Tensor]:
    barrier = threading.Barrier(threads)

    def one(task):
        idx, seed = task
        return ds.get_batch(idx, generator=_gen(seed))[0].clone()

    def start(_):
        barrier.wait()      # every thread starts reading at once

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(start, range(threads)))
        return list(pool.map(one, tasks))


# --- get_batch from several threads ------------------------------------------------------------

@pytest.mark.parametrize("kernel", ["windows", "loop"])
@pytest.mark.parametrize("fmt", FORMATS + ["jpeg"])
def test_get_batch_from_threads_equals_single_thread(fmt, kernel, stores, monkeypatch):
    if kernel == "loop":     # the per-sample kernel
        monkeypatch.setattr(batch_path_module, "VECTORISED_MAX_PIXELS", 0)
    # deterministic: a crop the size of the image and a certain flip give the mirrored sample
    fixed = dlstore.open_dataset(stores[fmt], transform=v2.Compose([v2.RandomCrop(32),
                                                                    v2.RandomHorizontalFlip(1.0)]))
    assert fixed.batch_path.crop is not None and fixed.batch_path.flip is not None
    # random: padded crop and a coin flip, drawn from each batch's own generator
    random = dlstore.open_dataset(stores[fmt], transform=v2.Compose([v2.RandomCrop(32, padding=(3, 1, 5, 2)),
                                                                     v2.RandomHorizontalFlip()]))
    tasks = _tasks(len(fixed), 60, 9)
    raw = fixed.read_batch(range(len(fixed)))[0]
    got = _concurrently(fixed, tasks, 4)
    for (idx, _), x in zip(tasks, got):
        assert torch.equal(x, raw[torch.from_numpy(idx)].flip(-1))
    expected = [random.get_batch(idx, generator=_gen(seed))[0].clone() for idx, seed in tasks]
    got = _concurrently(random, tasks, 4)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_dataset_pickles_without_thread_state(stores):
    import pickle

    ds = dlstore.open_dataset(stores["shards"], transform=v2.RandomHorizontalFlip(1.0))
    before = len(pickle.dumps(ds))
    ds.get_batch([0, 1])                       # makes this thread's scratch buffer of the fused crop
    assert len(pickle.dumps(ds)) == before     # which stays behind
    copy = pickle.loads(pickle.dumps(ds))
    assert torch.equal(copy.get_batch([0, 1])[0], ds.get_batch([0, 1])[0])


# --- first use from several threads at once -----------------------------------------------------

def _slowed(monkeypatch, owner, name, calls, overlap=None):
    """Make ``owner.name`` slow (20 ms), count its calls and how many ran at once (``overlap``)."""
    real = getattr(owner, name)
    inside = [0]
    lock = threading.Lock()

    def slow(*args, **kwargs):
        with lock:
            calls.append(threading.get_ident())
            inside[0] += 1
            if overlap is not None:
                overlap.append(inside[0])
        try:
            time.sleep(0.02)
            return real(*args, **kwargs)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(owner, name, slow)


def _at_once(fn, threads: int = 6) -> list:
    barrier = threading.Barrier(threads)

    def one(_):
        barrier.wait()
        return fn()

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(threads)))


@pytest.mark.parametrize("fmt", FORMATS + ["jpeg"])
def test_a_reader_first_used_by_several_threads_opens_once(fmt, stores, monkeypatch):
    # The GPU preload's reader threads did this: each saw the reader unopened, reset its handles
    # and opened it again, so one read a handle another had just set to None ('NoneType' has no
    # attribute 'begin' / 'id') or LMDB refused the second open (StoreBusyError, seen in CI).
    ds = dlstore.open_dataset(stores[fmt])
    expected = ds.read_batch(range(6))[0]
    ds = dlstore.open_dataset(stores[fmt])          # a fresh one: nothing opened in this process yet
    reader = getattr(ds.reader, "raw", ds.reader)
    calls: list[int] = []
    _slowed(monkeypatch, type(reader), "_open", calls)
    got = _at_once(lambda: ds.get_batch(np.arange(6))[0].clone())
    assert len(calls) == 1
    assert all(torch.equal(x, expected) for x in got)


def test_a_shard_file_is_mapped_and_checked_once_by_racing_threads(stores, monkeypatch):
    # check="open" hashes each shard file (1 GiB by default) when it is first mapped: threads
    # that met an unmapped file each mapped and hashed it.
    from dlstore.formats.shards import ShardReader

    expected = dlstore.open_dataset(stores["shards"]).read_batch(range(24))[0]
    ds = dlstore.open_dataset(stores["shards"], check="open")
    calls: list[int] = []
    _slowed(monkeypatch, ShardReader, "_check_file", calls)
    got = torch.cat([x for x, _ in dlstore.loader(ds, 4, backend="threads", num_threads=4)])
    assert torch.equal(got, expected)
    assert len(calls) == len(ds.reader.files)


def test_readers_of_one_lmdb_store_opened_by_several_threads_at_once(stores, monkeypatch):
    import lmdb

    from dlstore.formats.lmdb import LmdbReader

    calls: list[int] = []
    overlap: list[int] = []
    _slowed(monkeypatch, lmdb, "open", calls, overlap)
    readers = _at_once(lambda: LmdbReader(stores["lmdb"]))   # no StoreBusyError
    assert calls and max(overlap) == 1           # one open at a time: each finds the last one's environment
    first = readers[0].get_batch(np.arange(3))
    assert all(np.array_equal(r.get_batch(np.arange(3)), first) for r in readers)


def test_lmdb_readers_opened_and_dropped_in_several_threads(stores):
    # An environment used to close wherever its last reader died, outside the open lock: its
    # entry was already gone while it was still open, and a thread opening the same store then
    # was refused ("already open", StoreBusyError). Four threads churn readers for 3 s.
    from dlstore.formats.lmdb import LmdbReader

    errors: list[BaseException] = []
    stop = threading.Event()
    expected = LmdbReader(stores["lmdb"]).get_batch(np.arange(2))

    def churn():
        while not stop.is_set():
            try:
                reader = LmdbReader(stores["lmdb"])
                if not np.array_equal(reader.get_batch(np.arange(2)), expected):
                    raise AssertionError("wrong pixels")
                del reader
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                stop.set()

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    stop.wait(3)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_an_lmdb_environment_lives_as_long_as_its_last_reader(stores):
    import gc

    from dlstore.formats.lmdb import environment
    from dlstore.formats.lmdb import LmdbReader

    gc.collect()
    before = environment.open_count()
    first, second = LmdbReader(stores["lmdb"]), LmdbReader(stores["lmdb"])
    assert environment.open_count() == before          # metadata read, environment let go
    a = first.get_batch(np.arange(3))
    assert environment.open_count() == before + 1
    assert np.array_equal(second.get_batch(np.arange(3)), a) and environment.open_count() == before + 1
    del first
    gc.collect()
    assert np.array_equal(second.get_batch(np.arange(3)), a) and environment.open_count() == before + 1
    del second
    gc.collect()
    assert environment.open_count() == before


def test_a_fork_while_a_thread_opens_a_reader_does_not_deadlock_the_child(stores):
    import multiprocessing

    from dlstore.formats import handles

    held, release = threading.Event(), threading.Event()

    def hold():
        with handles.open_lock():
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        held.wait(10)
        ctx = multiprocessing.get_context("fork")
        child = ctx.Process(target=_read_one, args=(str(stores["lmdb"]),))
        child.start()
        child.join(60)
        alive = child.is_alive()
        if alive:
            child.kill()
        assert not alive and child.exitcode == 0     # the lock was copied held; the child has its own
    finally:
        release.set()
        holder.join()


def _read_one(path: str) -> None:
    dlstore.open_dataset(path).get_batch([0, 1])


# --- the loader ----------------------------------------------------------------------------------

def _random(path):
    return dlstore.open_dataset(path, transform=v2.Compose([v2.RandomCrop(32, padding=4),
                                                           v2.RandomHorizontalFlip()]))


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))


@pytest.mark.parametrize("fmt", FORMATS)
def test_batches_do_not_depend_on_the_thread_count(fmt, stores):
    ds = _random(stores[fmt])
    runs = {t: list(dlstore.loader(ds, 5, shuffle=True, generator=_gen(4), backend="threads", num_threads=t)) for t in (1, 2, 4)}
    assert _same(runs[1], runs[2]) and _same(runs[1], runs[4])
    assert [len(y) for _, y in runs[1]] == [5, 5, 5, 5, 4]
    assert sorted(torch.cat([y for _, y in runs[1]]).tolist()) == sorted(ds.targets)


def test_batch_seeds_follow_the_documented_scheme(stores):
    ds = _random(stores["shards"])
    g = _gen(11)
    got = list(dlstore.loader(ds, 6, shuffle=True, generator=g, backend="threads", num_threads=3))
    # what the loader drew: the base seed, then the order from the same generator
    g = _gen(11)
    base = int(torch.empty((), dtype=torch.int64).random_(generator=g))
    order = torch.randperm(len(ds), generator=g).tolist()
    for k, (x, y) in enumerate(got):
        idx = order[6 * k: 6 * k + 6]
        want_x, want_y = ds.get_batch(idx, generator=_gen(batch_seed(base, 0, k)))
        assert torch.equal(x, want_x) and torch.equal(y, want_y)


def test_in_order_and_equal_to_a_plain_read(stores):
    ds = dlstore.open_dataset(stores["lmdb"])
    batches = list(dlstore.loader(ds, 7, backend="threads", num_threads=3, prefetch_factor=3))
    raw, labels = ds.read_batch(range(len(ds)))
    assert torch.equal(torch.cat([x for x, _ in batches]), raw)
    assert torch.equal(torch.cat([y for _, y in batches]), labels)


def test_epochs_reseed(stores):
    ds = _random(stores["shards"])
    dl = dlstore.loader(ds, 8, shuffle=True, generator=_gen(0), backend="threads", num_threads=2)
    first, second = list(dl), list(dl)
    assert not _same(first, second)                      # the generator moved on
    assert _same(first, list(dlstore.loader(ds, 8, shuffle=True, generator=_gen(0), backend="threads", num_threads=2)))
    # the epoch enters the seeds: same generator, another epoch, other draws
    epoch0 = list(dlstore.loader(ds, 8, generator=_gen(0), backend="threads", num_threads=2))
    dl = dlstore.loader(ds, 8, generator=_gen(0), backend="threads", num_threads=2)
    dl.set_epoch(1)
    epoch1 = list(dl)
    assert not _same(epoch0, epoch1)
    assert _same(list(dlstore.loader(ds, 8, generator=_gen(0), backend="threads", num_threads=2)), epoch0)


def test_sampler_set_epoch_counts_as_set_epoch(stores):
    # DataLoader's idiom: loader.sampler.set_epoch(e) on a DistributedSampler
    ds = _random(stores["shards"])

    def make():
        sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=5)
        return dlstore.loader(ds, 8, sampler=sampler, seed=2, backend="threads", num_threads=2)
    dl = make()
    dl.set_epoch(3)
    want = list(dl)
    dl = make()
    dl.sampler.set_epoch(3)
    assert _same(list(dl), want)
    assert not _same(list(make()), want)


def test_len_and_drop_last(stores):
    ds = dlstore.open_dataset(stores["hdf5"])
    assert len(dlstore.loader(ds, 5, backend="threads", num_threads=2)) == 5 == len(list(dlstore.loader(ds, 5, backend="threads", num_threads=2)))
    dl = dlstore.loader(ds, 5, backend="threads", num_threads=2, drop_last=True)
    assert len(dl) == 4 == len(list(dl))


@pytest.mark.parametrize("hold", ["batches", "views"])
def test_held_batches_are_never_overwritten(hold, stores, monkeypatch):
    # every batch goes through the loader's recycled buffers, with the per-sample kernel
    monkeypatch.setattr(batch_path_module, "VECTORISED_MAX_PIXELS", 0)
    ds = dlstore.open_dataset(stores["shards"], transform=v2.RandomHorizontalFlip(1.0))
    raw = ds.read_batch(range(len(ds)))[0].flip(-1)
    for _ in range(3):
        held = []
        for x, _ in dlstore.loader(ds, 2, backend="threads", num_threads=3, prefetch_factor=2):
            held.append(x if hold == "batches" else x[1:])    # a view keeps the memory too
        if hold == "views":
            assert all(torch.equal(v, raw[2 * k + 1: 2 * k + 2]) for k, v in enumerate(held))
        else:
            assert torch.equal(torch.cat(held), raw)


def test_buffers_are_recycled_when_let_go(stores, monkeypatch):
    monkeypatch.setattr(batch_path_module, "VECTORISED_MAX_PIXELS", 0)
    ds = dlstore.open_dataset(stores["shards"], transform=v2.RandomHorizontalFlip(1.0))
    raw = ds.read_batch(range(len(ds)))[0].flip(-1)
    pointers = set()
    loader = dlstore.loader(ds, 2, backend="threads", num_threads=2, prefetch_factor=1)
    for _ in range(4):
        for k, (x, _) in enumerate(loader):
            assert torch.equal(x, raw[2 * k: 2 * k + 2])
            pointers.add(x.data_ptr())
            del x
    # 4 epochs x 12 batches served from no more buffers than the loader keeps: those in flight, the one
    # the user holds, the one before it and one spare
    assert len(pointers) <= loader.strategy.prefetch + 3


def test_two_loaders_of_one_dataset_stepped_in_turn_keep_their_batches(stores, monkeypatch):
    # each loader owns its buffers: two passes over one dataset at once never write into each other's
    monkeypatch.setattr(batch_path_module, "VECTORISED_MAX_PIXELS", 0)
    ds = dlstore.open_dataset(stores["shards"], transform=v2.RandomHorizontalFlip(1.0))
    raw = ds.read_batch(range(len(ds)))[0].flip(-1)
    small = dlstore.loader(ds, 2, backend="threads", num_threads=1, prefetch_factor=1)
    large = dlstore.loader(ds, 2, backend="threads", num_threads=4, prefetch_factor=2)
    held = {"small": [], "large": []}
    for (a, _), (b, _) in zip(small, large):
        held["small"].append(a)
        held["large"].append(b)
    assert torch.equal(torch.cat(held["small"]), raw) and torch.equal(torch.cat(held["large"]), raw)


def test_errors_in_a_thread_reach_the_caller_and_threads_end(stores):
    def boom(images, generator=None):
        raise RuntimeError("boom in a batch transform")

    ds = dlstore.open_dataset(stores["shards"], batch_transform=boom)
    with pytest.raises(RuntimeError, match="boom"):
        list(dlstore.loader(ds, 4, backend="threads", num_threads=2))
    ds = dlstore.open_dataset(stores["shards"])
    it = iter(dlstore.loader(ds, 2, backend="threads", num_threads=3))
    next(it)
    it.close()                                            # an epoch left early
    assert not [t for t in threading.enumerate() if t.name.startswith("dlstore-loader")]


def test_default_chooses_threads_where_they_apply(stores):
    ds = dlstore.open_dataset(stores["shards"], transform=v2.RandomHorizontalFlip())
    assert ds.threads_apply
    assert dlstore.loader(ds, 4).backend == "threads"
    assert dlstore.loader(ds, 4, backend="dataloader").backend == "dataloader"
    assert dlstore.loader(ds, 4, num_workers=1).backend == "ring"     # fixed-shape batches: the ring
    assert dlstore.loader(ds, 4, num_workers=1, backend="dataloader").backend == "dataloader"
    assert dlstore.loader(dlstore.open_dataset(stores["jpeg"]), 4).backend == "threads"
    assert dlstore.loader(ds, 4, num_threads=3).num_threads == 3       # a thread count asks for threads
    per_sample = dlstore.open_dataset(stores["shards"], transform=v2.Compose([v2.RandomErasing(p=1.0)]))
    assert per_sample.plan.python_ops(fixed_shape=True) and not per_sample.threads_apply
    assert dlstore.loader(per_sample, 4).backend == "dataloader"
    assert dlstore.loader(per_sample, 4, backend="threads", num_threads=2).backend == "threads"   # asked for
    kinds = {type(dlstore.loader(d, 4, **kw)) for d, kw in ((ds, {}), (ds, {"num_workers": 1}),
                                                           (per_sample, {}), (ds, {"device": "cpu"}))}
    assert kinds == {dlstore.Loader}


@pytest.mark.parametrize("kwargs,match", [
    ({"backend": "threads", "num_workers": 2}, "threads build batches in this process"),
    ({"num_threads": 2, "num_workers": 2}, "threads build batches in this process"),
    ({"num_threads": 2, "backend": "ring", "num_workers": 1}, "num_threads is the thread count"),
    ({"num_threads": -1}, "num_threads must be"),
    ({"num_threads": 1.5}, "num_threads must be"),
    ({"num_threads": 2, "prefetch_factor": 0}, "prefetch_factor"),
    ({"threads": 2}, "threads= is gone since 0.3; use backend='threads'"),
    ({"shm_ring": True}, "shm_ring= is gone since 0.3; use backend='ring'"),
    ({"num_thread": 2}, "did you mean num_threads="),
])
def test_bad_arguments(kwargs, match, stores):
    with pytest.raises(ArgumentError, match=match):
        dlstore.loader(dlstore.open_dataset(stores["shards"]), 4, **kwargs)


def test_distributed_splits_by_rank(stores, monkeypatch):
    import torch.distributed as dist

    ds = dlstore.open_dataset(stores["shards"])
    lookup = {bytes(ds.read(i).numpy().tobytes()): i for i in range(len(ds))}
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    seen = []
    for rank in (0, 1):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
        dl = dlstore.loader(ds, 5, shuffle=True, distributed=True, seed=3, backend="threads", num_threads=2)
        assert dl.backend == "threads" and len(dl) == 3          # 12 samples per rank
        dl.sampler.set_epoch(1)
        seen.append([lookup[bytes(x.numpy().tobytes())] for images, _ in dl for x in images])
    assert sorted(seen[0] + seen[1]) == list(range(len(ds)))


def test_pin_memory(stores):
    ds = dlstore.open_dataset(stores["shards"])
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="CUDA is not available"):
            dl = dlstore.loader(ds, 4, backend="threads", num_threads=2, pin_memory=True)
        x, _ = next(iter(dl))
        assert not x.is_pinned()
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dl = dlstore.loader(ds, 4, backend="threads", num_threads=2, pin_memory=True)
    for x, y in dl:
        assert x.is_pinned() and y.is_pinned()


# --- JPEG stores: batches decoded by torchvision.io.decode_jpeg, pixels as PIL's ------------------

def test_jpeg_batches_decode_to_pils_pixels(stores):
    from dlstore.formats.encoding import decode

    ds = dlstore.open_dataset(stores["jpeg"])
    reader, idx = ds.reader, list(range(len(ds)))
    got = reader.get_many(idx)
    assert reader._batch_jpeg is True       # this torchvision decodes exactly as this Pillow
    pil = [decode(r) for r in reader.raw.get_many(idx)]
    assert all(a.flags.c_contiguous and np.array_equal(a, b) for a, b in zip(got, pil))
    assert np.array_equal(reader.get_batch(np.array(idx)), np.stack(pil))
    threaded = torch.cat([x for x, _ in dlstore.loader(ds, 5, backend="threads", num_threads=3)])
    assert torch.equal(threaded, torch.from_numpy(np.stack(pil)))


def test_jpeg_batches_keep_to_pil_when_torchvision_differs(stores, monkeypatch):
    import torchvision.io

    from dlstore.formats.encoding import decode

    real = torchvision.io.decode_jpeg
    monkeypatch.setattr(torchvision.io, "decode_jpeg", lambda data: [x ^ 1 for x in real(data)])
    ds = dlstore.open_dataset(stores["jpeg"])
    got = ds.reader.get_many([0, 1, 2])
    assert ds.reader._batch_jpeg is False
    assert all(np.array_equal(a, decode(r)) for a, r in zip(got, ds.reader.raw.get_many([0, 1, 2])))


def test_jpeg_batches_keep_to_pil_when_threads_check_at_once(stores, monkeypatch):
    # Two threads decode their first batches together; the second one's decode ends after the
    # first has compared its pixels with PIL's and rejected torchvision. It must not hand out
    # the rejected pixels (it did: it read the verdict before its decode and skipped the check).
    import torchvision.io

    from dlstore.formats.encoding import decode

    real = torchvision.io.decode_jpeg
    meet, calls, lock = threading.Barrier(2, timeout=10), [], threading.Lock()

    def differing(data, *args, **kwargs):
        with lock:
            calls.append(1)
            n = len(calls)
        if n <= 2:                      # the first two decodes start together, the second lags
            meet.wait()
            if n == 2:
                time.sleep(0.05)
        return [x ^ 1 for x in real(data, *args, **kwargs)]

    monkeypatch.setattr(torchvision.io, "decode_jpeg", differing)
    ds = dlstore.open_dataset(stores["jpeg"])
    got = torch.cat([x for x, _ in dlstore.loader(ds, 4, backend="threads", num_threads=2)])
    raw = ds.reader.raw
    pil = np.stack([decode(r) for r in raw.get_many(list(range(len(raw))))])
    assert ds.reader._batch_jpeg is False and len(calls) >= 2
    assert np.array_equal(got.numpy(), pil)


def test_jpeg_batch_with_a_damaged_record_names_it(stores):
    from dlstore.errors import StoreCorruptError
    from dlstore.formats.encoding import DecodingReader

    good = dlstore.open_dataset(stores["jpeg"]).reader.raw

    class Damaged:
        manifest, labels, targets, count, path = good.manifest, good.labels, good.targets, good.count, good.path

        def get_many(self, indices):
            records = good.get_many(indices)
            return [r.reshape(-1)[: r.size // 2] if i == 2 else r for r, i in zip(records, indices)]

    with pytest.raises(StoreCorruptError, match="sample 2"):
        DecodingReader(Damaged()).get_batch(np.array([0, 1, 2, 3]))


EXIT_WITH_LIVE_ITERATORS = """
import faulthandler, sys, torch
faulthandler.dump_traceback_later(200, exit=True)   # a hang (CI saw one, once) shows its threads' stacks
from torchvision.transforms import v2
import dlstore

folder, root = sys.argv[1], sys.argv[2]
pipe = v2.Compose([v2.Resize(36), v2.CenterCrop(32), v2.RandomCrop(28), v2.RandomHorizontalFlip(),
                   v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.2] * 3)])
hybrid = dlstore.split_transforms(pipe)
path = dlstore.convert(folder, root + "/s.lmdb", static=hybrid, workers=0, progress=False).path
ds = dlstore.open_dataset(path, transform=hybrid)
per_sample = dlstore.open_dataset(path, transform=lambda x: x.flip(-1))
loaders = {
    "threads": dlstore.loader(ds, 4, backend="threads", num_threads=2),
    "device threads": dlstore.loader(ds, 4, backend="threads", num_threads=2, device="cpu"),
    "ring": dlstore.loader(per_sample, 4, num_workers=2),
    "device ring": dlstore.loader(per_sample, 4, num_workers=2, device="cpu"),
    "dataloader": dlstore.loader(per_sample, 4, num_workers=2, backend="dataloader"),
    "gpu": dlstore.loader(dlstore.GPUDataset(path, device="cpu"), 4),
    "gpu stream": dlstore.loader(dlstore.GPUDataset(path, device="cpu", max_memory=1, headroom=0,
                                                    on_overflow="stream"), 4),
}
kinds = sorted({dl.backend for dl in loaders.values()})
assert kinds == ["dataloader", "resident", "ring", "threads"], kinds
assert {type(dl) for dl in loaders.values()} == {dlstore.Loader}
zipped = zip(loaders["threads"], loaders["device threads"])
next(zipped)
alive = {name: iter(dl) for name, dl in loaders.items()}
for it in alive.values():
    next(it)
unstarted = iter(loaders["ring"]), iter(loaders["threads"])
print("exiting", flush=True)
"""


@pytest.mark.slow
def test_iterators_alive_at_exit_end_quietly(rgb_folder, tmp_path):
    """Every loader kind, an iterator of each left mid-pass (and zipped) when the interpreter exits."""
    script = tmp_path / "exit.py"
    script.write_text(EXIT_WITH_LIVE_ITERATORS)
    proc = subprocess.run([sys.executable, str(script), str(rgb_folder),
                           str(tmp_path)], check=False, capture_output=True, text=True, timeout=240)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "exiting\n", "")


@pytest.mark.parametrize("backend", [{"backend": "threads", "num_threads": 1}, {"backend": "ring", "num_workers": 1}],
                         ids=["threads", "ring"])
@pytest.mark.parametrize("suffix", [".shards", ".lmdb"])
def test_with_willneed_the_loader_advises_batches_ahead_of_their_build(tmp_path, suffix, backend):
    """Reader willneed on: when the first batch is handed out, the samples of batches not yet
    submitted to a thread or worker (here the last) are already read or on their way; batches
    unchanged."""
    from _helpers import evict, pages_holding, resident_pages, seen_resident

    n = 24
    images = np.random.default_rng(8).integers(0, 256, (n, 64, 96, 3), dtype=np.uint8)   # 18 KiB each
    dst = tmp_path / f"s{suffix}"
    dlstore.convert((images, np.arange(n) % 2), dst, workers=0, progress=False)
    data = {".shards": dst / "shard-00000.npy", ".lmdb": dst / "data.mdb"}[suffix]
    ds = dlstore.open_dataset(dst, reader_options={"willneed": True, "readahead": False})
    ds.reader.prefetch([0])      # LMDB's leaves looked up now, before the file is searched and evicted
    chw = images.transpose(0, 3, 1, 2)
    last = set().union(*(pages_holding(data, chw[i]) for i in range(n - 4, n)))
    evict(data)
    last -= set(np.flatnonzero(resident_pages(data)).tolist())
    if not last:
        pytest.skip(f"this filesystem keeps {data} cached after POSIX_FADV_DONTNEED (tmpfs?)")
    loader = dlstore.loader(ds, 4, prefetch_factor=1, **backend)
    it = iter(loader)
    first = next(it)[0].clone()   # (a ring slot is reused once handed back)
    assert seen_resident(data, last) == last
    got = torch.cat([first] + [x.clone() for x, _ in it])
    assert torch.equal(got, torch.from_numpy(chw))


def test_a_bad_index_ahead_fails_its_own_batch_not_the_ones_before(tmp_path):
    """The advice ahead reads the sampler early: an index out of range there must still fail
    only when its batch is built, after the batches before it were handed out."""
    from dlstore.errors import SampleIndexError

    dst = tmp_path / "s.shards"
    dlstore.convert((np.zeros((6, 8, 8, 3), np.uint8), np.arange(6) % 2), dst, workers=0, progress=False)
    ds = dlstore.open_dataset(dst, reader_options={"willneed": True})
    loader = dlstore.loader(ds, 2, sampler=[0, 1, 2, 3, 99], backend="threads", num_threads=1)
    it = iter(loader)
    assert [len(next(it)[0]), len(next(it)[0])] == [2, 2]
    with pytest.raises(SampleIndexError, match="99"):
        next(it)


def test_batches_advised_ahead_are_not_advised_again_by_their_builder(tmp_path, monkeypatch):
    """Each batch is advised once, ahead, from the loader's own thread; the builder threads'
    reads skip the reader's per-batch advice (it would repeat the same calls)."""
    import dlstore.formats.reader as reader_module

    dst = tmp_path / "s.shards"
    dlstore.convert((np.zeros((12, 8, 8, 3), np.uint8), np.arange(12) % 2), dst, workers=0, progress=False)
    ds = dlstore.open_dataset(dst, reader_options={"willneed": True})
    seen: list[str] = []
    real = reader_module.advise
    monkeypatch.setattr(reader_module, "advise",
                        lambda extents, **options: (seen.append(threading.current_thread().name), real(extents, **options)))
    assert sum(len(x) for x, _ in dlstore.loader(ds, 3, backend="threads", num_threads=2)) == 12
    assert seen == [threading.current_thread().name] * 4
    ds.reader.get_batch([0, 1])                  # outside the loader the reader still advises its batch
    assert len(seen) == 5
