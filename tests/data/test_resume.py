"""Resuming a loader mid-epoch: ``state_dict()`` taken after batch k, loaded into a loader made
with the same arguments (another generator seed, another process), gives the rest of the epoch
and the epochs after it exactly as the uninterrupted loader does, pixels and labels, for every
back-end and worker count; a process killed with SIGKILL resumes from the state it saved."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torchvision.transforms import v2

import dlstore
from dlstore.errors import ArgumentError
from dlstore.sources.demo import make_image_folder

BATCH = 4
CROP_FLIP = [v2.RandomCrop(12, padding=2), v2.RandomHorizontalFlip()]
FLOAT_TAIL = [v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.25] * 3)]
PER_SAMPLE = [v2.RandomRotation(15)]   # no batch equivalent: runs sample by sample, on torch's global generator


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    src = make_image_folder(root / "images", classes=3, per_class=9, size=(20, 18))
    return dlstore.convert(src, root / "s.shards", static="center_crop=16", workers=0, progress=False).path


# back-end -> (transform of the dataset, loader keywords); each a dlstore.loader configuration
CONFIGS = {
    "threads-1": (CROP_FLIP, {"num_threads": 1}),
    "threads-2": (CROP_FLIP, {"num_threads": 2}),
    "ring-1": (CROP_FLIP, {"num_workers": 1}),
    "ring-2": (CROP_FLIP, {"num_workers": 2}),
    "ring-2-per-sample": (PER_SAMPLE, {"num_workers": 2}),
    "dataloader-0": (CROP_FLIP, {"backend": "dataloader"}),
    "dataloader-0-per-sample": (PER_SAMPLE, {"backend": "dataloader"}),
    "dataloader-2": (CROP_FLIP, {"num_workers": 2, "backend": "dataloader"}),
    "dataloader-2-per-sample": (PER_SAMPLE, {"num_workers": 2, "backend": "dataloader"}),
    "device-threads": (CROP_FLIP + FLOAT_TAIL, {"num_threads": 2, "device": "cpu"}),
    "device-ring": (CROP_FLIP + FLOAT_TAIL, {"num_workers": 2, "device": "cpu"}),
}
EXPECTED_BACKEND = {"threads": "threads", "ring": "ring", "dataloader": "dataloader", "device": None}


def _make(store, config: str, seed: int):
    transform, options = CONFIGS[config]
    ds = dlstore.open_dataset(store, transform=v2.Compose(transform))
    loader = dlstore.loader(ds, BATCH, shuffle=True, generator=torch.Generator().manual_seed(seed), **options)
    expected = EXPECTED_BACKEND[config.split("-")[0]]
    assert loader.backend == (expected or config.split("-")[1]) and type(loader) is dlstore.Loader
    return loader


def _epoch(loader, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader.set_epoch(epoch)
    return [(x.clone(), y.clone()) for x, y in loader]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) and torch.equal(u, v) for (x, u), (y, v) in zip(a, b))


def _resumed(make, k: int) -> tuple[list, list]:
    """Epoch 0 cut after batch k and finished by a new loader from the state, then epoch 1."""
    first = make(seed=7)
    first.set_epoch(0)
    it = iter(first)
    head = [tuple(t.clone() for t in next(it)) for _ in range(k)]
    state = first.state_dict()
    del it
    second = make(seed=1234)   # another generator: the state carries the one that matters
    second.load_state_dict(state)
    tail = [(x.clone(), y.clone()) for x, y in second]
    return head + tail, _epoch(second, 1)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("k", [0, 3, 7])   # 27 samples, batch 4: 7 batches
def test_resumed_epoch_equals_the_uninterrupted_one(store, config, k):
    uninterrupted = _make(store, config, seed=7)
    want0, want1 = _epoch(uninterrupted, 0), _epoch(uninterrupted, 1)
    assert len(want0) == 7 and not _same(want0, want1)   # epochs differ: the test can tell them apart
    got0, got1 = _resumed(lambda seed: _make(store, config, seed), k)
    assert _same(got0, want0), f"{config}: the resumed epoch differs from the uninterrupted one"
    assert _same(got1, want1), f"{config}: the epoch after the resumed one differs"


@pytest.mark.parametrize("config", ["threads-2", "ring-2", "dataloader-0", "dataloader-2", "device-threads"])
@pytest.mark.parametrize("seeded", [True, False], ids=["seed", "loader-generator"])
def test_a_block_shuffle_sampler_resumes(store, config, seeded):
    """The sampler's order is recomputed from (seed, epoch), or drawn from the loader's generator,
    whose state the loader saves."""
    transform, options = CONFIGS[config]

    def make(seed):
        ds = dlstore.open_dataset(store, transform=v2.Compose(transform))
        generator = torch.Generator().manual_seed(seed)
        sampler = dlstore.BlockShuffleSampler(ds, block_size=4, window=2, seed=3 if seeded else None,
                                              generator=None if seeded else generator)
        return dlstore.loader(ds, BATCH, sampler=sampler, generator=generator, **options)

    uninterrupted = make(7)
    want0, want1 = _epoch(uninterrupted, 0), _epoch(uninterrupted, 1)
    assert not _same(want0, want1)
    got0, got1 = _resumed(make, 3)
    assert _same(got0, want0) and _same(got1, want1)


@pytest.mark.parametrize("seeded", [True, False], ids=["seed", "loader-generator"])
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_dataset_loader_resumes(store, fused, seeded):
    ds = dlstore.GPUDataset(store, device="cpu", dtype=torch.uint8, transform=v2.Compose(CROP_FLIP))

    def make(seed):   # with a generator, another seed: the state must carry the one that matters
        if seeded:
            return dlstore.loader(ds, BATCH, shuffle=True, seed=5, fused=fused)
        return dlstore.loader(ds, BATCH, shuffle=True, generator=torch.Generator().manual_seed(seed), fused=fused)

    uninterrupted = make(7)
    want0, want1 = _epoch(uninterrupted, 0), _epoch(uninterrupted, 1)
    got0, got1 = _resumed(make, 3)
    assert _same(got0, want0) and _same(got1, want1)


def test_state_between_epochs_resumes_the_next_epoch(store):
    first = _make(store, "threads-2", seed=7)
    want = _epoch(_make(store, "threads-2", seed=7), 0)
    assert _same(_epoch(first, 0), want)
    state = first.state_dict()                 # a whole epoch done: batches 0 of the next pass
    assert state["batches"] == 0
    second = _make(store, "threads-2", seed=99)
    second.load_state_dict(state)
    second.set_epoch(1)
    reference = _make(store, "threads-2", seed=7)
    _epoch(reference, 0)
    assert _same(_epoch(second, 1), _epoch(reference, 1))


def test_a_damaged_state_is_refused(store):
    loader = _make(store, "threads-1", seed=0)
    good = loader.state_dict()
    for bad in ({}, [1], {**good, "version": 1}, {**good, "batches": 99}, {**good, "epoch": "0"},
                {**good, "generator": None}, {**good, "fit": None}):
        with pytest.raises(ArgumentError, match="load_state_dict"):
            loader.load_state_dict(bad)
    loader.load_state_dict(good)


SCRIPT = textwrap.dedent("""
    import hashlib, json, os, sys, time
    import torch
    from torchvision.transforms import v2
    import dlstore

    store, config, state_file, log = sys.argv[1:5]
    seed, stop_after = int(sys.argv[5]), int(sys.argv[6])
    options = json.loads(config)
    ds = dlstore.open_dataset(store, transform=v2.Compose([v2.RandomCrop(12, padding=2), v2.RandomHorizontalFlip()]))
    loader = dlstore.loader(ds, 4, shuffle=True, generator=torch.Generator().manual_seed(seed), **options)
    if os.path.exists(state_file):
        loader.load_state_dict(torch.load(state_file))
    loader.set_epoch(0)
    with open(log, "a") as out:
        for n, (x, y) in enumerate(loader, 1):
            out.write(hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest() + "\\n")
            out.flush()
            torch.save(loader.state_dict(), state_file + ".tmp")
            os.replace(state_file + ".tmp", state_file)      # the checkpoint a training loop writes
            if n == stop_after:
                print("waiting", flush=True)
                time.sleep(600)                              # killed here
""")


def _digests(store, options, seed: int) -> list[str]:
    ds = dlstore.open_dataset(store, transform=v2.Compose(CROP_FLIP))
    loader = dlstore.loader(ds, BATCH, shuffle=True, generator=torch.Generator().manual_seed(seed), **options)
    return [hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest() for x, y in loader]


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"num_threads": 2}, {"num_workers": 2}], ids=["threads", "ring"])
def test_a_process_killed_mid_epoch_resumes_from_its_saved_state(store, tmp_path, options):
    """SIGKILL after batch 3 (the state saved after each batch, as a training loop checkpoints);
    a new process with another generator seed loads it and finishes the epoch: the 7 batches are
    those of one uninterrupted pass with the first process's seed, in order."""
    state, log = tmp_path / "state.pt", tmp_path / "batches.txt"
    args = [sys.executable, "-c", SCRIPT, str(store), json.dumps(options), str(state), str(log)]
    proc = subprocess.Popen([*args, "0", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "waiting", proc.stderr.read()
    children = [p for p in os.listdir("/proc") if p.isdigit() and _is_child_of(int(p), proc.pid)]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL and len(log.read_text().split()) == 3
    done = subprocess.run([*args, "1234", "0"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert log.read_text().split() == _digests(store, options, seed=0)
    deadline = time.monotonic() + 5   # the killed process's workers went with it
    while any(os.path.exists(f"/proc/{pid}") and _is_child_of(int(pid), proc.pid) for pid in children):
        assert time.monotonic() < deadline, "workers of the killed process still alive"
        time.sleep(0.1)


def _is_child_of(pid: int, parent: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == parent
    except (OSError, ValueError, IndexError):
        return False
