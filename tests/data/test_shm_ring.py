"""The shared-memory ring (``dlstore.loader(..., num_workers=N, backend="ring")``, issue 17).

Worker processes build batches into a ring of shared-memory slots. The batches must equal
the ThreadLoader's for the same generator (same per-batch seeds, sampler order) whatever
the worker count, a batch the user holds must never change, errors in a worker must reach
the caller naming the batch, and no worker, descriptor or ``/dev/shm`` segment may outlive
the loader.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

import dlstore
from dlstore.errors import ArgumentError, UsageError, WorkerError
from dlstore.transforms.batch import BatchCompose, BatchCutout, BatchRandomCrop

# torchvision 0.29 deprecates its image decoders (for TorchCodec) and warns on every call
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding:DeprecationWarning")

SUFFIX = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}


@pytest.fixture(scope="module")
def stores(rgb_folder, tmp_path_factory):
    """The 24-sample RGB folder as 3x32x32 stores of every format."""
    root = tmp_path_factory.mktemp("ring-stores")
    return {fmt: dlstore.convert(rgb_folder, root / f"s{suffix}", static="resize=36,center_crop=32", workers=0,
                                 progress=False).path for fmt, suffix in SUFFIX.items()}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random(path, **options):
    return dlstore.open_dataset(path, transform=v2.Compose([v2.RandomCrop(32, padding=4),
                                                           v2.RandomHorizontalFlip()]), **options)


def _ring(ds, batch_size, workers=2, **options) -> dlstore.Loader:
    dl = dlstore.loader(ds, batch_size, num_workers=workers, backend="ring", **options)
    assert dl.backend == "ring"
    return dl


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))


def _epoch(dl) -> list:
    """One pass, every batch copied at once (what the user saw when it was handed out)."""
    return [(x.clone(), y.clone()) for x, y in dl]


def _children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("dlstore-loader")]


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if Path("/dev/shm").is_dir() else set()


class Boom:
    """A batch transform that raises on a batch of ``count`` rows (picklable for spawn)."""

    def __init__(self, count: int):
        self.count = count

    def __call__(self, images, generator=None):
        if images.shape[0] == self.count:
            raise ValueError(f"boom on a batch of {self.count}")
        return images


def _die(worker_id: int) -> None:
    os._exit(3)


# --- the same batches as the threads --------------------------------------------------------------

@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("fmt", ["shards", "lmdb", "hdf5"])
def test_batches_equal_the_thread_loaders(fmt, workers, stores):
    ds = _random(stores[fmt])          # random crop (padding 4) + flip, fused into the gather
    threads = dlstore.loader(ds, 5, shuffle=True, generator=_gen(4), backend="threads", num_threads=1)
    dl = _ring(ds, 5, workers, shuffle=True, generator=_gen(4))
    first = _epoch(threads)
    assert _same(_epoch(dl), first)
    assert [len(y) for _, y in first] == [5, 5, 5, 5, 4]
    assert _same(_epoch(dl), _epoch(threads))        # the next pass: a new base seed, drawn alike
    # later epochs too: set_epoch enters the seeds, as with threads
    threads = dlstore.loader(ds, 5, shuffle=True, generator=_gen(9), backend="threads", num_threads=2)
    dl = _ring(ds, 5, workers, shuffle=True, generator=_gen(9), persistent_workers=True)
    for epoch in range(3):
        threads.set_epoch(epoch)
        dl.set_epoch(epoch)
        assert _same(_epoch(dl), _epoch(threads))
    dl.close()


def test_batch_transforms_and_per_sample_ops_do_not_depend_on_the_worker_count(stores):
    # a batch transform that returns a new tensor (copied into the slot)
    ds = dlstore.open_dataset(stores["shards"], batch_transform=BatchCompose([BatchRandomCrop(32, padding=2),
                                                                             BatchCutout(8)]))
    threads = _epoch(dlstore.loader(ds, 4, shuffle=True, generator=_gen(1), backend="threads", num_threads=2))
    assert _same(_epoch(_ring(ds, 4, 1, shuffle=True, generator=_gen(1))), threads)
    assert _same(_epoch(_ring(ds, 4, 2, shuffle=True, generator=_gen(1))), threads)
    # a per-sample op (draws from torch's global generator, seeded per batch in the worker)
    ds = dlstore.open_dataset(stores["shards"], transform=v2.Compose([v2.RandomErasing(p=0.5)]))
    assert ds.plan.python_ops(fixed_shape=True)   # per sample, in Python, inside the batch
    one = _epoch(_ring(ds, 4, 1, shuffle=True, generator=_gen(2)))
    assert _same(one, _epoch(_ring(ds, 4, 2, shuffle=True, generator=_gen(2))))
    assert not _same(one, _epoch(_ring(ds, 4, 2, shuffle=True, generator=_gen(3))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_batches_and_the_device_stage(dtype, stores):
    # ToDtype in the workers: slots of that dtype (bfloat16 has no numpy twin)
    ds = dlstore.open_dataset(stores["shards"], transform=v2.Compose([v2.RandomHorizontalFlip(),
                                                                      v2.ToDtype(dtype, scale=True)]))
    dl = _ring(ds, 5, 2, shuffle=True, generator=_gen(3))
    assert dl.strategy.spec == ((3, 32, 32), dtype, None)   # (int labels go through the pipe)
    got = _epoch(dl)
    assert got[0][0].dtype == dtype
    assert _same(got, _epoch(dlstore.loader(ds, 5, shuffle=True, generator=_gen(3), backend="threads", num_threads=1)))
    # device=: the ring carries the host stage (uint8), the float tail runs after it
    dl = dlstore.loader(ds, 5, shuffle=True, generator=_gen(3), num_workers=2, backend="ring", device="cpu")
    assert dl.backend == "ring" and dl.device == torch.device("cpu")
    assert _same(_epoch(dl), _epoch(dlstore.loader(ds, 5, shuffle=True, generator=_gen(3), backend="threads", num_threads=1,
                                                   device="cpu")))


def test_static_batches_equal_the_dataloader_paths(stores):
    ds = dlstore.open_dataset(stores["lmdb"])
    for workers in (1, 2):
        dataloader = _epoch(dlstore.loader(ds, 7, shuffle=True, num_workers=workers, generator=_gen(5),
                                           backend="dataloader"))
        assert _same(_epoch(_ring(ds, 7, workers, shuffle=True, generator=_gen(5))), dataloader)
    raw, labels = ds.read_batch(range(len(ds)))
    batches = _epoch(_ring(ds, 7, 2, drop_last=True))
    assert len(batches) == 3
    assert torch.equal(torch.cat([x for x, _ in batches]), raw[:21])
    assert torch.equal(torch.cat([y for _, y in batches]), labels[:21])


@pytest.mark.slow
def test_spawn_context(stores):
    ds = _random(stores["shards"])
    threads = _epoch(dlstore.loader(ds, 6, shuffle=True, generator=_gen(7), backend="threads", num_threads=1))
    dl = _ring(ds, 6, 2, shuffle=True, generator=_gen(7), multiprocessing_context="spawn")
    assert _same(_epoch(dl), threads)
    assert not _children()


# --- held batches, recycled slots -------------------------------------------------------------------

@pytest.mark.parametrize("hold", ["batches", "views", "numpy", "enumerate"])
@pytest.mark.parametrize("persistent", [False, True])
def test_held_batches_are_never_overwritten(hold, persistent, stores):
    ds = dlstore.open_dataset(stores["shards"], transform=v2.RandomHorizontalFlip(1.0))
    raw = ds.read_batch(range(len(ds)))[0].flip(-1)
    dl = _ring(ds, 2, 2, prefetch_factor=1, persistent_workers=persistent)   # 12 batches, 5 slots
    epochs = []
    for _ in range(3):
        held = []
        if hold == "enumerate":
            for k, (x, _) in enumerate(dl):
                held.append(x)
                assert torch.equal(x, raw[2 * k: 2 * k + 2])
        else:
            for x, _ in dl:
                held.append({"batches": x, "views": x[1:], "numpy": x.numpy()}[hold])
        epochs.append(held)
    for held in epochs:                          # every batch of every epoch as it was handed out
        if hold == "views":
            assert all(torch.equal(v, raw[2 * k + 1: 2 * k + 2]) for k, v in enumerate(held))
        else:
            assert torch.equal(torch.cat([torch.as_tensor(x) for x in held]), raw)
    dl.close()


@pytest.mark.parametrize("seed", range(3))
def test_random_holds_and_drops(seed, stores):
    # the user keeps some batches, views and arrays for a while, lets others go at random
    rng = np.random.default_rng(seed)
    ds = dlstore.open_dataset(stores["lmdb"], transform=v2.RandomHorizontalFlip(1.0))
    raw = ds.read_batch(range(len(ds)))[0].flip(-1)
    dl = _ring(ds, 1, 2, prefetch_factor=1, persistent_workers=True)        # 24 batches, 5 slots
    kept: list[tuple[int, object]] = []
    for _ in range(3):
        for k, (x, _) in enumerate(dl):
            if rng.random() < 0.4:
                kept.append((k, [x, x[:, 1:], x.numpy()][rng.integers(3)]))
            while kept and rng.random() < 0.3:
                kept.pop(int(rng.integers(len(kept))))
            for i, held in kept:
                held = torch.as_tensor(held)
                assert torch.equal(held, raw[i: i + 1, -held.shape[1]:])
    dl.close()


def test_slots_are_recycled_when_let_go(stores):
    ds = dlstore.open_dataset(stores["shards"], transform=v2.RandomHorizontalFlip(1.0))
    raw = ds.read_batch(range(len(ds)))[0].flip(-1)
    dl = _ring(ds, 2, 2, prefetch_factor=1, persistent_workers=True)
    slots = {s.data_ptr() for s in dl.strategy._start()[0].slots}
    ring = dl.strategy._ring
    for _ in range(4):
        for k, (x, y) in enumerate(dl):
            assert torch.equal(x, raw[2 * k: 2 * k + 2])
            assert x.data_ptr() in slots            # handed out, not copied
    assert dl.strategy._ring is ring                 # 4 epochs x 12 batches in the same slots
    dl.close()


def test_a_pass_while_the_user_holds_every_slot(stores):
    ds = dlstore.open_dataset(stores["hdf5"])
    raw = ds.read_batch(range(len(ds)))[0]
    dl = _ring(ds, 2, 1, prefetch_factor=1, persistent_workers=True)   # 12 batches, 4 slots
    first = list(dl)                                 # more batches than slots: the last ones are copies
    second = list(dl)                                # every slot held: a new ring
    for batches in (first, second):
        assert torch.equal(torch.cat([x for x, _ in batches]), raw)
    dl.close()


# --- errors, early exits, clean-up ------------------------------------------------------------------

@pytest.mark.parametrize("persistent", [False, True])
def test_errors_in_a_worker_name_the_batch(persistent, stores):
    ds = dlstore.open_dataset(stores["shards"], batch_transform=Boom(4))      # the last batch: 24 = 4 x 5 + 4
    dl = _ring(ds, 5, 2, persistent_workers=persistent)
    seen = []
    with pytest.raises(ValueError, match="boom on a batch of 4") as info:
        for x, _ in dl:
            seen.append(x.clone())
    assert len(seen) == 4
    assert any("building batch 4 (indices [20, 21, 22, 23])" in note for note in info.value.__notes__)
    assert persistent or not _children()
    again = []
    with pytest.raises(ValueError, match="boom on a batch of 4"):    # the next pass runs, and fails alike
        for x, _ in dl:
            again.append(x.clone())
    assert len(again) == 4 and all(torch.equal(a, b) for a, b in zip(seen, again))
    dl.close()
    assert not _children()


@pytest.mark.slow
def test_a_dead_worker_raises(stores):
    dl = _ring(dlstore.open_dataset(stores["shards"]), 4, 1, worker_init_fn=_die)
    with pytest.raises(WorkerError, match="exited with code 3"):
        list(dl)
    assert not _children()
    # killed mid-pass, while the other worker could finish the pass alone: it still raises
    dl = _ring(dlstore.open_dataset(stores["shards"]), 1, 2, persistent_workers=True)
    with pytest.raises(WorkerError, match="exited with code -9"):
        for k, _ in enumerate(dl):
            if k == 2:
                os.kill(dl.strategy._pool.procs[0].pid, signal.SIGKILL)
                dl.strategy._pool.procs[0].join()
    # persistent workers, one of them dead: the next pass starts fresh ones (it raised again before)
    assert _same(_epoch(dl), _epoch(dlstore.loader(dlstore.open_dataset(stores["shards"]), 1, backend="threads", num_threads=1)))
    dl.close()
    assert not _children()


def _transpose(images, generator=None):
    return images.transpose(2, 3)   # a view of the batch (in the worker: of its slot) in another layout


def _np_noise(images, generator=None):
    return images + torch.from_numpy(np.random.randint(0, 50, images.shape, dtype=np.uint8))


def test_a_batch_transform_returning_a_view_of_the_slot_in_another_layout_is_copied(stores):
    """Square samples transposed: the same shape and memory as the slot, other strides (was: the raw pixels)."""
    ds = dlstore.open_dataset(stores["hdf5"], batch_transform=_transpose)
    reference = _epoch(dlstore.loader(ds, 5, backend="threads", num_threads=1))
    assert not torch.equal(reference[0][0], reference[0][0].transpose(2, 3))   # a transpose changes pixels
    assert _same(_epoch(_ring(ds, 5, 2)), reference)


def test_workers_seed_numpy_per_batch(stores):
    """np.random augmentations draw anew each epoch and the same for any worker count (DataLoader
    workers seed numpy too; the ring's did not: every epoch repeated the parent's draws)."""
    ds = dlstore.open_dataset(stores["shards"], batch_transform=_np_noise)
    one, two = _ring(ds, 4, 1, generator=_gen(3)), _ring(ds, 4, 2, generator=_gen(3))
    first, second = _epoch(one), _epoch(one)
    assert not _same(first, second)
    assert _same(first, _epoch(two))


@pytest.mark.parametrize("persistent", [False, True])
def test_break_mid_epoch_then_a_new_epoch(persistent, stores):
    ds = _random(stores["lmdb"])
    threads = dlstore.loader(ds, 3, shuffle=True, generator=_gen(8), backend="threads", num_threads=2)
    dl = _ring(ds, 3, 2, shuffle=True, generator=_gen(8), persistent_workers=persistent)
    for epoch in range(3):
        # the threads break at the same batch: a pass left early draws less from the generator
        # (RandomSampler draws an empty last permutation at its end), so the next pass differs
        expected = []
        for k, (x, y) in enumerate(threads):
            expected.append((x.clone(), y.clone()))
            if k == 2 + epoch:
                break
        for k, (x, y) in enumerate(dl):
            assert torch.equal(x, expected[k][0]) and torch.equal(y, expected[k][1])
            if k == 2 + epoch:
                break
        assert persistent == bool(_children())
    assert _same(_epoch(dl), _epoch(threads))       # a whole pass after the broken ones
    dl.close()
    assert not _children()


@pytest.mark.parametrize("persistent", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("drop", ["del", "close"])
def test_an_iterator_dropped_before_its_first_batch_stops_its_workers(persistent, drop, stores):
    """iter() starts the workers (as a DataLoader's do); an iterator never advanced must not leave
    them running for the loader's life (its generator never ran, so no finally did either)."""
    ds = _random(stores["lmdb"])
    dl = _ring(ds, 3, 2, shuffle=True, generator=_gen(3), persistent_workers=persistent)
    it = iter(dl)
    assert len(_children()) == 2
    if drop == "del":
        del it
        gc.collect()
    else:
        it.close()
        with pytest.raises(StopIteration):
            next(it)
    for p in multiprocessing.active_children():
        p.join(timeout=5)
    assert len(_children()) == (2 if persistent else 0)
    expected = _epoch(dlstore.loader(ds, 3, shuffle=True, generator=_gen(3), backend="threads", num_threads=2))
    assert _same(_epoch(dl), expected)       # the next pass starts workers again and reads the same batches
    dl.close()
    assert not _children()


def test_an_unstarted_iterator_collected_as_the_next_pass_starts_leaves_that_pass_alone(stores, monkeypatch):
    """An iterator never advanced and held in a reference cycle is freed whenever the cycle collector
    runs: here right after the next pass took the workers (it stopped them under that pass: "handle
    is closed")."""
    ds = _random(stores["lmdb"])
    expected = _epoch(dlstore.loader(ds, 3, shuffle=True, generator=_gen(4), backend="threads", num_threads=2))
    dl = _ring(ds, 3, 2, shuffle=True, generator=_gen(4))
    real_start, calls = dl.strategy._start, []

    def start():
        got = real_start()
        calls.append(1)
        if len(calls) == 3:           # the next pass's own _start (the stale's iter(), its iter())
            gc.collect()
        return got
    monkeypatch.setattr(dl.strategy, "_start", start)
    gc.disable()                      # the collector runs exactly there, not at some allocation before
    try:
        stale = [iter(dl)]
        stale.append(stale)           # a cycle: only the collector frees it
        del stale
        got = _epoch(dl)
    finally:
        gc.enable()
    assert len(calls) >= 3 and _same(got, expected)
    dl.close()
    assert not _children()


def test_nothing_outlives_the_loader(stores):
    ds = dlstore.open_dataset(stores["shards"])
    list(_ring(ds, 4, 2))                            # the first pass opens what stays open (the store)
    gc.collect()
    fds, shm = _fds(), _shm()
    for persistent in (False, True):
        dl = _ring(ds, 4, 2, persistent_workers=persistent)
        held = next(iter(dl))                        # an iterator dropped mid-epoch
        list(dl)
        it = iter(dl)
        next(it)
        del it
        assert persistent == bool(_children())
        dl.close()
        assert not _children()
        assert held[0].shape == (4, 3, 32, 32)      # a batch held past close() is still valid
        del held
    dl = _ring(ds, 4, 2, persistent_workers=True)
    it = iter(dl)
    next(it)
    del dl, it                                      # garbage collected with its workers running
    gc.collect()
    assert not _children()
    assert _fds() <= fds and _shm() <= shm


def test_pin_memory(stores):
    ds = dlstore.open_dataset(stores["shards"])
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="CUDA is not available"):
            dl = _ring(ds, 4, 2, pin_memory=True)
        assert _same(_epoch(dl), _epoch(_ring(ds, 4, 2)))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dl = _ring(ds, 4, 2, pin_memory=True)
    batches = list(dl)
    assert all(x.is_pinned() and y.is_pinned() for x, y in batches)
    assert _same(batches, _epoch(_ring(ds, 4, 2)))


def test_bad_arguments(stores, varsize_folder, tmp_path):
    ds = dlstore.open_dataset(stores["shards"])
    with pytest.raises(ArgumentError, match="num_workers >= 1"):
        dlstore.loader(ds, 4, backend="ring")
    with pytest.raises(ArgumentError, match="shm_ring= is gone since 0.3; use backend='ring'"):
        dlstore.loader(ds, 4, num_workers=1, shm_ring=True)
    variable = dlstore.open_dataset(dlstore.convert(varsize_folder, tmp_path / "v.shards", workers=0,
                                                    progress=False).path)
    with pytest.raises(ArgumentError, match="batches of one fixed shape"):
        dlstore.loader(variable, 4, num_workers=1, backend="ring")
    assert dlstore.loader(ds, 4, num_workers=1).backend == "ring"   # the default for workers
    assert dlstore.loader(ds, 4, num_workers=1, backend="dataloader").backend == "dataloader"
    assert dlstore.loader(variable, 4, num_workers=1).backend == "dataloader"   # variable shapes


@pytest.mark.parametrize("persistent", [False, True])
def test_a_second_pass_started_mid_pass_takes_over(persistent, stores):
    ds = _random(stores["shards"])
    expected = _epoch(dlstore.loader(ds, 2, shuffle=True, generator=_gen(6), backend="threads", num_threads=1))
    dl = _ring(ds, 2, 2, shuffle=True, generator=_gen(6), persistent_workers=persistent)
    first = iter(dl)
    x, _ = next(first)                              # a pass left suspended, with batches in flight
    assert torch.equal(x, expected[0][0])
    dl.generator.manual_seed(6)
    dl.set_epoch(0)                                 # (each pass is the next epoch)
    assert _same(_epoch(dl), expected)             # the new pass has every slot it needs
    with pytest.raises(UsageError, match="another pass over this loader started"):
        next(first)
    assert torch.equal(x, expected[0][0])           # the old pass's batch is still the user's
    dl.close()
    assert not _children()


_SMALL_SHM = r"""
import sys, warnings
import numpy as np
import dlstore
from dlstore.errors import SharedMemoryError

images = np.random.default_rng(0).integers(0, 256, (40, 64, 64, 3), dtype=np.uint8)
ds = dlstore.open_dataset(dlstore.convert((images, np.arange(40) % 2), sys.argv[1], workers=0, progress=False).path)
try:   # asked for: 7 slots of 64x3x64x64 (5.5 MiB) in a 4 MiB /dev/shm
    next(iter(dlstore.loader(ds, 64, num_workers=2, backend="ring")))
    print("no error")
except SharedMemoryError as exc:
    print("error:", exc)
with warnings.catch_warnings(record=True) as caught:   # chosen: not the ring, and a warning says why
    warnings.simplefilter("always")
    chosen = dlstore.loader(ds, 64, num_workers=2)
print("chosen:", chosen.backend, "|", "; ".join(str(w.message) for w in caught))
# three loaders made up front (train/val/test), each fitting alone (5 slots of 24x3x64x64: 1.4 MiB), not
# together: the one that finds no room when it starts takes the DataLoader path, with a warning
loaders = [dlstore.loader(ds, 24, num_workers=1) for _ in range(3)]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    counts = [sum(len(y) for _, y in dl) for dl in loaders]
print("three:", [dl.backend for dl in loaders], counts, sum("DataLoader path" in str(w.message) for w in caught))
"""


def test_a_ring_that_does_not_fit_in_dev_shm_is_a_clear_error_or_not_chosen(tmp_path):
    """A real 4 MiB /dev/shm (a tmpfs in a private mount namespace, as Docker's 64 MiB default is)."""
    import subprocess
    import sys

    script = tmp_path / "small_shm.py"
    script.write_text(_SMALL_SHM)
    cmd = f"mount -t tmpfs -o size=4m tmpfs /dev/shm && exec {sys.executable} {script} {tmp_path / 's.shards'}"
    proc = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=300,
                          check=False)
    if proc.returncode != 0 and ("mount" in proc.stderr or "unshare" in proc.stderr):
        pytest.skip(f"cannot mount a private /dev/shm here (needs root): {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr
    error, chosen, three = proc.stdout.strip().splitlines()[-3:]
    assert three.startswith("three: [") and three.count("'ring'") == 2 and three.count("'dataloader'") == 1
    assert three.endswith("[40, 40, 40] 1")
    assert error.startswith("error: the loader's ring of batches needs 5.2 MiB of shared memory and /dev/shm has")
    assert "--shm-size" in error and "num_workers=0" in error
    assert chosen.startswith("chosen: dataloader | dlstore.loader: not using worker processes' shared-memory ring")


def test_a_forked_process_running_an_inherited_pools_finalizer_leaves_the_pool_alone(stores):
    """A worker forked for a later loader inherits an unreachable earlier pool; when its garbage
    collector finalises that copy, the copy must not touch (nor assert on) the parent's workers."""
    ds = dlstore.open_dataset(stores["shards"])
    dl = _ring(ds, 4, 2, persistent_workers=True)
    first = _epoch(dl)
    pool = dl._backend._pool
    pid = os.fork()
    if pid == 0:                                     # the child: what a forked worker's collector does
        try:
            pool._finalizer()
        except BaseException:                        # noqa: BLE001 - the exit code says it
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(_children()) == 2 and _same(_epoch(dl), first)   # the parent's workers still serve
    dl.close()
    assert not _children()


def test_ring_workers_do_not_advise_again_what_the_main_process_advised(tmp_path, monkeypatch):
    """With the advice on, the main process advises each batch ahead (as the threads' loader
    does); the workers' reads skip the reader's per-batch advice, which would repeat it."""
    import dlstore.formats.reader as reader_module

    dst = tmp_path / "s.shards"
    dlstore.convert((np.zeros((12, 8, 8, 3), np.uint8), np.arange(12) % 2), dst, workers=0, progress=False)
    ds = dlstore.open_dataset(dst, reader_options={"willneed": True})
    log = tmp_path / "advised"
    real = reader_module.advise

    def spy(extents, **options):      # inherited by the forked workers: each call leaves its pid
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real(extents, **options)

    monkeypatch.setattr(reader_module, "advise", spy)
    loader = dlstore.loader(ds, 3, num_workers=2, backend="ring", multiprocessing_context="fork")
    assert sum(len(x) for x, _ in loader) == 12
    assert log.read_text().split() == [str(os.getpid())] * 4
