"""The one ``Loader``: its seeds, its state and its arguments, through the public entry, on every back-end.

- an epoch is a function of (seed, epoch): ``set_epoch(e)`` in a fresh loader (or a fresh process)
  gives epoch e of an uninterrupted run, whatever ran before, on every back-end and sampler;
- a state says what it fits: loaded into a loader that differs in the dataset, batch size,
  ``drop_last``, sampler, back-end or seed, it is refused naming the difference;
- ``collate_fn`` as DataLoader has it;
- each argument reaches what it governs (a test per argument that fails when it is dropped).
"""

from __future__ import annotations

import inspect

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, default_collate
from torchvision.transforms import v2

import dlstore
from dlstore.errors import ArgumentError, StateMismatchError
from dlstore.sources.demo import make_image_folder

CROP_FLIP = v2.Compose([v2.RandomCrop(12, padding=2), v2.RandomHorizontalFlip()])
PER_SAMPLE = v2.Compose([v2.RandomRotation(20)])        # no batch equivalent: per sample, global generator


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    src = make_image_folder(root / "images", classes=3, per_class=10, size=(18, 16))
    return dlstore.convert(src, root / "s.shards", static="center_crop=16", workers=0, progress=False).path


@pytest.fixture(scope="module")
def other_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract-other")
    src = make_image_folder(root / "images", classes=3, per_class=10, size=(18, 16), quality=70)   # other pixels
    return dlstore.convert(src, root / "s.shards", static="center_crop=16", workers=0, progress=False).path


def _epoch(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.clone(), y.clone()) for x, y in loader]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) and torch.equal(u, v) for (x, u), (y, v) in zip(a, b))


# --- an epoch is a function of (seed, epoch) ---------------------------------------------------------

BACKENDS = {
    "threads": (CROP_FLIP, {"backend": "threads", "num_threads": 2}),
    "ring": (CROP_FLIP, {"num_workers": 2}),
    "ring-per-sample": (PER_SAMPLE, {"num_workers": 2}),
    "dataloader-0": (CROP_FLIP, {"backend": "dataloader"}),
    "dataloader-0-per-sample": (PER_SAMPLE, {"backend": "dataloader"}),
    "dataloader-2-per-sample": (PER_SAMPLE, {"backend": "dataloader", "num_workers": 2}),
    "device": (v2.Compose([*CROP_FLIP.transforms, v2.ToDtype(torch.float32, scale=True)]), {"device": "cpu"}),
}


def _sampler(kind: str, ds):
    if kind == "shuffle":
        return {"shuffle": True}
    if kind == "block":      # no seed of its own: it draws from the loader's pass generator
        return {"sampler": dlstore.BlockShuffleSampler(ds, block_size=4, window=2)}
    if kind == "distributed-by-hand":
        return {"sampler": DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)}
    raise ValueError(kind)


@pytest.mark.parametrize("sampler", ["shuffle", "block", "distributed-by-hand"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_set_epoch_gives_that_epoch_whatever_ran_before(store, backend, sampler):
    transform, options = BACKENDS[backend]

    def make():
        ds = dlstore.open_dataset(store, transform=transform)
        return dlstore.loader(ds, 4, seed=11, **_sampler(sampler, ds), **options)

    run = make()
    epochs = [_epoch(run) for _ in range(3)]          # 0, 1, 2: each iter() the next epoch
    assert not _same(epochs[1], epochs[2])
    order = [torch.cat([y for _, y in e]).tolist() for e in epochs]
    assert order[1] != order[2], "each epoch its own order"
    torch.manual_seed(1234)                           # the process's own generator moved: no matter
    fresh = make()
    fresh.set_epoch(2)
    assert _same(_epoch(fresh), epochs[2])
    fresh.set_epoch(1)
    assert _same(_epoch(fresh), epochs[1])
    it = iter(fresh)                                  # an epoch left half-way, then epoch 2 asked for
    next(it)
    fresh.set_epoch(2)
    assert _same(_epoch(fresh), epochs[2])


def test_set_epoch_on_a_gpu_dataset(store):
    ds = dlstore.GPUDataset(store, device="cpu", dtype=torch.uint8, transform=CROP_FLIP)
    run = dlstore.loader(ds, 4, shuffle=True, seed=2)
    epochs = [_epoch(run) for _ in range(3)]
    fresh = dlstore.loader(ds, 4, shuffle=True, seed=2)
    fresh.set_epoch(2)
    assert _same(_epoch(fresh), epochs[2]) and not _same(epochs[1], epochs[2])


CHECKPOINT_PER_EPOCH = textwrap.dedent("""
    import hashlib, json, sys
    import torch
    from torchvision.transforms import v2
    import dlstore

    store, epochs, options = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    torch.manual_seed(int(sys.argv[4]))            # whatever the script did before: no matter
    ds = dlstore.open_dataset(store, transform=v2.Compose([v2.RandomCrop(12, padding=2), v2.RandomHorizontalFlip()]))
    loader = dlstore.loader(ds, 4, shuffle=True, seed=5, **options)
    out = {}
    for epoch in epochs:
        loader.set_epoch(epoch)
        out[epoch] = [hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest() for x, y in loader]
    print(json.dumps(out))
""")


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"backend": "threads"}, {"num_workers": 2}], ids=["threads", "ring"])
def test_the_checkpoint_per_epoch_pattern_in_a_new_process(store, options):
    """A job restarted at an epoch boundary without state_dict() (a new process, set_epoch(e)) trains on
    the batches the uninterrupted job would have."""
    def run(epochs, seed):
        proc = subprocess.run([sys.executable, "-c", CHECKPOINT_PER_EPOCH, str(store), json.dumps(epochs),
                               json.dumps(options), str(seed)], capture_output=True, text=True, timeout=180,
                              check=False)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    whole = run([0, 1, 2], seed=0)
    restarted = run([2], seed=99)
    assert restarted["2"] == whole["2"] and whole["1"] != whole["2"]


def test_seed_none_is_a_fresh_order_each_run_as_dataloader(store):
    ds = dlstore.open_dataset(store, transform=CROP_FLIP)
    a, b = (_epoch(dlstore.loader(ds, 4, shuffle=True)) for _ in range(2))
    assert not _same(a, b)                        # the process's generator moved between them
    torch.manual_seed(7)
    c = _epoch(dlstore.loader(ds, 4, shuffle=True))
    torch.manual_seed(7)
    assert _same(c, _epoch(dlstore.loader(ds, 4, shuffle=True)))    # torch.manual_seed makes it repeat


@pytest.mark.parametrize("options", [{"backend": "dataloader"}, {"backend": "dataloader", "num_workers": 2},
                                     {"num_workers": 2}], ids=["dataloader-0", "dataloader-2", "ring"])
def test_seed_none_gives_every_back_end_the_same_epochs(store, options):
    """With seed=None the pass seeds come from torch's generator, and only from them: a back-end that
    draws more from it (torch's DataLoader draws a base seed per iterator) would move the next epoch."""
    ds = dlstore.open_dataset(store, transform=CROP_FLIP)
    runs = []
    for kind in ({"backend": "threads"}, options):
        torch.manual_seed(11)
        loader = dlstore.loader(ds, 4, shuffle=True, **kind)
        runs.append([_epoch(loader) for _ in range(2)])
    assert _same(runs[0][0], runs[1][0]) and _same(runs[0][1], runs[1][1])


def test_ranks_draw_apart(store):
    """The same seed on two ranks (a rank set by hand): other samples and other augmentation draws."""
    ds = dlstore.open_dataset(store, transform=v2.RandomHorizontalFlip())
    ranks = [dlstore.loader(ds, 15, seed=4, sampler=DistributedSampler(ds, num_replicas=2, rank=r, shuffle=False))
             for r in (0, 1)]
    flips = []
    for loader in ranks:
        (x, _), = list(loader)
        idx = loader.sampler
        raw = torch.stack([ds.read(i) for i in idx])
        flips.append([not torch.equal(a, b) for a, b in zip(x, raw)])
    assert flips[0] != flips[1]


# --- a state says what it fits ------------------------------------------------------------------------

def _state_after(loader, k: int):
    it = iter(loader)
    for _ in range(k):
        next(it)
    return loader.state_dict()


@pytest.mark.parametrize(("change", "field"), [
    ({"batch_size": 5}, "batch_size"),
    ({"drop_last": True}, "drop_last"),
    ({"seed": 8}, "seed"),
    ({"sampler": "block"}, "sampler"),
    ({"dataset": "other"}, "dataset"),
    ({"dataset": "subset"}, "dataset_length"),
])
def test_a_state_is_refused_by_a_loader_it_does_not_fit(store, other_store, tmp_path, change, field):
    ds = dlstore.open_dataset(store, transform=CROP_FLIP)
    state = _state_after(dlstore.loader(ds, 4, shuffle=True, seed=7), 3)
    options = {"batch_size": 4, "shuffle": True, "seed": 7}
    target = ds
    if change.get("dataset") == "other":
        target = dlstore.open_dataset(other_store, transform=CROP_FLIP)
    elif change.get("dataset") == "subset":
        images = torch.stack([ds.read(i) for i in range(20)]).permute(0, 2, 3, 1).numpy()
        target = dlstore.open_dataset(dlstore.convert((images, ds.targets[:20]), tmp_path / "sub.shards",
                                                      workers=0, progress=False).path)
    elif change.get("sampler") == "block":
        options.pop("shuffle")
        options["sampler"] = dlstore.BlockShuffleSampler(ds, block_size=4, window=2)
    else:
        options.update(change)
    other = dlstore.loader(target, **options)
    with pytest.raises(StateMismatchError, match=f"{field}: the state has"):
        other.load_state_dict(state)


def test_a_state_moves_between_the_host_back_ends(store):
    """threads, ring and dataloader build the same batches from the same seeds: a state moves between them."""
    ds = dlstore.open_dataset(store, transform=CROP_FLIP)
    whole = _epoch(dlstore.loader(ds, 4, shuffle=True, seed=7, backend="threads"))
    state = _state_after(dlstore.loader(ds, 4, shuffle=True, seed=7, backend="threads"), 3)
    for options in ({"num_workers": 2}, {"backend": "dataloader"}, {"backend": "dataloader", "num_workers": 1}):
        resumed = dlstore.loader(ds, 4, shuffle=True, seed=7, **options)
        resumed.load_state_dict(state)
        assert _same(_epoch(resumed), whole[3:]), options


def test_a_gpu_state_does_not_load_into_a_store_loader(store):
    gpu = dlstore.GPUDataset(store, device="cpu", dtype=torch.uint8)
    state = _state_after(dlstore.loader(gpu, 4, shuffle=True, seed=7), 2)
    with pytest.raises(StateMismatchError, match="backend: the state has 'resident'"):
        dlstore.loader(dlstore.open_dataset(store), 4, shuffle=True, seed=7).load_state_dict(state)


def test_a_state_records_what_it_fits(store):
    ds = dlstore.open_dataset(store)
    state = dlstore.loader(ds, 4, shuffle=True, seed=7, drop_last=True).state_dict()
    assert state["fit"] == {"dataset_length": 30, "dataset": ds.fingerprint, "batch_size": 4, "drop_last": True,
                            "sampler": "RandomSampler", "backend": "threads", "seed": 7}
    assert json.loads(json.dumps(state["fit"])) == state["fit"]


# --- collate_fn as DataLoader has it ------------------------------------------------------------------

class MixUpCutMix:
    """torchvision's reference script: ``lambda batch: mixup_cutmix(*default_collate(batch))``."""

    def __init__(self):
        self.op = v2.RandomChoice([v2.MixUp(alpha=0.2, num_classes=3), v2.CutMix(alpha=1.0, num_classes=3)])

    def __call__(self, batch):
        return self.op(*default_collate(batch))


FLOAT = v2.Compose([*CROP_FLIP.transforms, v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.25] * 3)])


@pytest.mark.parametrize("options", [{"backend": "threads"}, {"num_workers": 2}, {"backend": "dataloader"},
                                     {"backend": "dataloader", "num_workers": 2}, {"device": "cpu"}],
                         ids=["threads", "ring", "dataloader-0", "dataloader-2", "device"])
def test_the_reference_scripts_mixup_collate_runs_and_is_reproducible(store, options):
    ds = dlstore.open_dataset(store, transform=FLOAT)
    collate = MixUpCutMix()
    got = _epoch(dlstore.loader(ds, 4, shuffle=True, seed=3, collate_fn=collate, **options))
    assert all(x.dtype == torch.float32 and y.shape == (len(x), 3) for x, y in got)   # soft labels
    plain = _epoch(dlstore.loader(ds, 4, shuffle=True, seed=3, backend="threads"))
    assert all(not torch.equal(a, b) for (a, _), (b, _) in zip(got, plain))          # mixed
    again = _epoch(dlstore.loader(ds, 4, shuffle=True, seed=3, collate_fn=collate, backend="threads"))
    assert _same(got, again)          # the same draws on every back-end, from the batch's seed


def test_a_seeded_collate_fn_beside_per_sample_ops_on_threads(store):
    """Loader threads seed the global generators for per-sample ops while the iterating thread seeds
    them for the collate_fn: the two take turns, so every epoch is the DataLoader back-end's."""
    ds = dlstore.open_dataset(store, transform=v2.Compose([*PER_SAMPLE.transforms, v2.ToDtype(torch.float32)]))
    collate = MixUpCutMix()
    want = _epoch(dlstore.loader(ds, 2, shuffle=True, seed=5, collate_fn=collate, backend="dataloader"))
    for _ in range(4):      # a race shows on some runs only
        got = _epoch(dlstore.loader(ds, 2, shuffle=True, seed=5, collate_fn=collate, backend="threads",
                                    num_threads=2))
        assert _same(got, want)


def test_collate_fn_gets_what_dataloader_gives_it(store):
    """The samples as ds[i] gives them, (image, int target): the same call as torch's DataLoader makes."""
    ds = dlstore.open_dataset(store)
    seen = []

    def record(batch):
        seen.append([(image.clone(), target) for image, target in batch])
        return default_collate(batch)

    ours = _epoch(dlstore.loader(ds, 7, collate_fn=record))
    theirs = seen[:]
    seen.clear()
    torch_batches = list(DataLoader(ds, 7, collate_fn=record))
    assert len(theirs) == len(seen) == 5
    for a, b in zip(theirs, seen):
        assert [t for _, t in a] == [t for _, t in b] and all(type(t) is int for _, t in a)
        assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))
    assert all(torch.equal(x, tx) and torch.equal(y, ty) for (x, y), (tx, ty) in zip(ours, torch_batches))


def test_default_collate_costs_nothing(store, monkeypatch):
    import dlstore.data.loaders.collate as collate_module

    calls = []
    monkeypatch.setattr(collate_module, "as_samples", lambda batch: calls.append(1))
    ds = dlstore.open_dataset(store)
    a = _epoch(dlstore.loader(ds, 7, collate_fn=default_collate))
    assert not calls and _same(a, _epoch(dlstore.loader(ds, 7)))


# --- arguments: unknown names, the 0.2 spellings -------------------------------------------------------

@pytest.mark.parametrize(("options", "match"), [
    ({"num_worker": 2}, "did you mean num_workers="),
    ({"colate_fn": default_collate}, "did you mean collate_fn="),
    ({"threads": 2}, "threads= is gone since 0.3; use backend='threads'"),
    ({"shm_ring": False}, "shm_ring= is gone since 0.3"),
    ({"batch_transform": CROP_FLIP}, "batch_transform= is gone since 0.3"),
    ({"transform": CROP_FLIP}, "transform= is gone since 0.3"),
    ({"seed": 1, "generator": torch.Generator()}, "seed= and generator= both"),
])
def test_argument_errors_name_the_fix(store, options, match):
    with pytest.raises(ArgumentError, match=match):
        dlstore.loader(dlstore.open_dataset(store), 4, **options)


def test_argument_type_errors_are_argument_errors(store):
    with pytest.raises(ArgumentError, match="num_workers is a keyword argument"):     # an ArgumentTypeError
        dlstore.loader(dlstore.open_dataset(store), 4, True, 2)
    with pytest.raises(ArgumentError, match="in_order=False is not supported"):
        dlstore.loader(dlstore.open_dataset(store), 4, in_order=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_cuda_without_cuda_is_refused_at_once(store):
    with pytest.raises(ArgumentError, match="CUDA is not available here; use device='cpu'"):
        dlstore.loader(dlstore.open_dataset(store, transform=FLOAT), 4, device="cuda")


def test_every_positional_argument_in_dataloaders_order(store):
    """DataLoader's 13 positional parameters, given by position to both entries, land where DataLoader's do."""
    ds = dlstore.open_dataset(store)
    names = [p for p in inspect.signature(DataLoader).parameters][:13]
    values = [ds, 4, False, None, None, 1, default_collate, False, True, 7.5, None, None, torch.Generator()]
    for entry in (dlstore.loader, dlstore.Loader):
        dl = entry(*values, backend="dataloader")
        for name, value in zip(names, values):
            if name not in ("sampler", "batch_sampler"):     # (filled in from shuffle and batch_size, as DataLoader's)
                assert getattr(dl, name) is value, name


def _sleep(_worker_id: int) -> None:
    time.sleep(3)


@pytest.mark.parametrize("options", [{"num_workers": 1}, {"backend": "dataloader", "num_workers": 1}],
                         ids=["ring", "dataloader"])
def test_timeout_is_dataloaders_for_worker_processes(store, options):
    """No batch from the workers within ``timeout`` seconds: an error, as DataLoader raises one."""
    ds = dlstore.open_dataset(store)
    slow = dlstore.loader(ds, 4, timeout=1, worker_init_fn=_sleep, **options)
    with pytest.raises(RuntimeError, match="timed out after 1 seconds|in timeout=1 s"):
        next(iter(slow))
    ok = dlstore.loader(ds, 4, timeout=30, worker_init_fn=_sleep, **options)
    assert len(list(ok)) == len(ok)


# --- each argument reaches what it governs ----------------------------------------------------------

def test_dataloader_attributes_with_dataloaders_meanings(store):
    ds = dlstore.open_dataset(store, transform=CROP_FLIP)
    for options in ({}, {"num_workers": 2}, {"backend": "dataloader", "num_workers": 1}, {"device": "cpu"}):
        dl = dlstore.loader(ds, 4, shuffle=True, drop_last=True, prefetch_factor=3, **options)
        torch_dl = DataLoader(ds, 4, shuffle=True, drop_last=True)
        assert type(dl) is dlstore.Loader
        assert (dl.dataset, dl.batch_size, dl.shuffle, dl.drop_last, dl.prefetch_factor) == (ds, 4, True, True, 3)
        assert dl.num_workers == options.get("num_workers", 0) and dl.pin_memory is False
        assert type(dl.sampler) is type(torch_dl.sampler) and dl.batch_sampler.sampler is dl.sampler
        assert len(dl) == len(torch_dl) == 7 and dl.generator is None and dl.persistent_workers is False
        assert dl.device == (torch.device("cpu") if "device" in options else None)
    gpu = dlstore.loader(dlstore.GPUDataset(store, device="cpu", dtype=torch.uint8), 4)
    assert type(gpu) is dlstore.Loader and gpu.num_workers == 0 and gpu.batch_size == 4 and len(gpu) == 8


class _Record:
    """A batch transform that notes the thread it ran on."""

    def __init__(self):
        self.threads: set[str] = set()

    def __call__(self, images, generator=None):
        self.threads.add(threading.current_thread().name)
        time.sleep(0.01)          # long enough that every thread of the pool gets batches
        return images


def test_num_threads_and_its_default(store):
    from dlstore._system import usable_cpus

    for given, want in ((None, max(1, min(usable_cpus(), 8))), (1, 1), (3, 3)):
        record = _Record()
        ds = dlstore.open_dataset(store, batch_transform=record)
        dl = dlstore.loader(ds, 2, num_threads=given) if given else dlstore.loader(ds, 2)
        assert dl.backend == "threads" and dl.num_threads == want
        _epoch(dl)
        assert len(record.threads) == want and all(n.startswith("dlstore-loader") for n in record.threads)


def _note_pid(_worker_id: int) -> None:
    with open(os.environ["DLSTORE_TEST_NOTES"], "a") as f:
        f.write(f"{os.getpid()}\n")


@pytest.mark.parametrize("options", [{}, {"backend": "dataloader"}], ids=["ring", "dataloader"])
def test_num_workers_worker_init_fn_and_persistent_workers(store, tmp_path, monkeypatch, options):
    notes = tmp_path / "pids"
    monkeypatch.setenv("DLSTORE_TEST_NOTES", str(notes))
    ds = dlstore.open_dataset(store, transform=CROP_FLIP)
    for workers in (1, 3):
        notes.write_text("")
        dl = dlstore.loader(ds, 4, num_workers=workers, worker_init_fn=_note_pid, persistent_workers=True,
                            **options)
        _epoch(dl)
        _epoch(dl)
        pids = notes.read_text().split()
        assert len(pids) == len(set(pids)) == workers     # started once: persistent across the two epochs
        dl.close()
    notes.write_text("")
    dl = dlstore.loader(ds, 4, num_workers=2, worker_init_fn=_note_pid, **options)
    _epoch(dl)
    _epoch(dl)
    assert len(notes.read_text().split()) == 4            # not persistent: new workers each epoch


MARK = "as imported"


def _note_mark(_worker_id: int) -> None:
    with open(os.environ["DLSTORE_TEST_NOTES"], "a") as f:
        f.write(MARK.replace(" ", "-") + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"backend": "dataloader"}], ids=["ring", "dataloader"])
def test_multiprocessing_context(store, tmp_path, monkeypatch, options):
    """A forked worker has the parent's module state; a spawned one imports the module afresh."""
    notes = tmp_path / "marks"
    monkeypatch.setenv("DLSTORE_TEST_NOTES", str(notes))
    monkeypatch.setattr(sys.modules[__name__], "MARK", "set in the parent")
    ds = dlstore.open_dataset(store, transform=CROP_FLIP)
    for context, want in (("fork", "set-in-the-parent"), ("spawn", "as-imported")):
        notes.write_text("")
        _epoch(dlstore.loader(ds, 4, num_workers=1, worker_init_fn=_note_mark, multiprocessing_context=context,
                              **options))
        assert notes.read_text().split() == [want], context


class _Pulled:
    """A sampler that counts the indices pulled from it."""

    def __init__(self, n: int):
        self.n, self.pulled = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.pulled += 1
            yield i

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize(("options", "in_flight"), [
    ({"backend": "threads", "num_threads": 1, "prefetch_factor": 1}, 1),
    ({"backend": "threads", "num_threads": 1, "prefetch_factor": 4}, 4),
    ({"backend": "threads", "num_threads": 2, "prefetch_factor": 3}, 6),
    ({"num_workers": 1, "prefetch_factor": 1}, 1),
    ({"num_workers": 1, "prefetch_factor": 3}, 3),
    ({"backend": "dataloader", "num_workers": 1, "prefetch_factor": 2}, 2),
    ({"backend": "dataloader", "num_workers": 1, "prefetch_factor": 5}, 5),
])
def test_prefetch_factor_is_batches_in_flight_per_worker(store, options, in_flight):
    ds = dlstore.open_dataset(store)
    sampler = _Pulled(len(ds))
    it = iter(dlstore.loader(ds, 2, sampler=sampler, **options))
    next(it)
    # pulled when the first batch is handed out: those in flight and the one that took its place
    assert sampler.pulled == (in_flight + 1) * 2


@pytest.mark.parametrize("options", [{}, {"num_workers": 1}, {"backend": "dataloader"}, {"device": "cpu"}],
                         ids=["threads", "ring", "dataloader", "device"])
def test_shuffle_sampler_batch_sampler_drop_last_and_generator(store, options):
    ds = dlstore.open_dataset(store)
    raw = torch.stack([ds.read(i) for i in range(len(ds))])

    def order(dl):
        return [int(torch.nonzero((raw == x).flatten(1).all(1))[0]) for x, _ in dl for x in x]

    assert order(dlstore.loader(ds, 4, **options)) == list(range(30))
    shuffled = order(dlstore.loader(ds, 4, shuffle=True, generator=torch.Generator().manual_seed(1), **options))
    assert shuffled == torch.randperm(30, generator=_after_base(1)).tolist()
    assert order(dlstore.loader(ds, 4, sampler=list(reversed(range(30))), **options)) == list(reversed(range(30)))
    batches = [[5, 1], [2, 9, 3], [0]]
    dl = dlstore.loader(ds, None, batch_sampler=batches, **options)
    assert [len(x) for x, _ in dl] == [2, 3, 1] and order(dl) == [5, 1, 2, 9, 3, 0] and dl.batch_size is None
    assert len(list(dlstore.loader(ds, 4, drop_last=True, **options))) == 7


def _after_base(seed: int) -> torch.Generator:
    """The generator as RandomSampler finds it: the pass's base seed drawn first."""
    g = torch.Generator().manual_seed(seed)
    torch.empty((), dtype=torch.int64).random_(generator=g)
    return g


def test_pin_memory_and_device_dtype_channels_last(store):
    ds = dlstore.open_dataset(store, transform=FLOAT)
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="CUDA is not available"):
            assert dlstore.loader(ds, 4, pin_memory=True).pin_memory is False
    x, y = next(iter(dlstore.loader(ds, 4, device="cpu", dtype=torch.bfloat16, channels_last=True)))
    assert x.dtype == torch.bfloat16 and x.is_contiguous(memory_format=torch.channels_last) and x.shape[1] == 3
    x, _ = next(iter(dlstore.loader(ds, 4, device="cpu")))
    assert x.dtype == torch.float32 and not x.is_contiguous(memory_format=torch.channels_last)


def test_distributed_needs_a_group_and_uses_it(store):
    ds = dlstore.open_dataset(store)
    with pytest.raises(ArgumentError, match="initialised torch.distributed process group"):
        dlstore.loader(ds, 4, distributed=True)

