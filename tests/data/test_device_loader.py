"""``dlstore.loader(..., device=)``: the host stage in threads/workers, the device stage on the device.

Run on ``device="cpu"`` here (the same code path: ring, copy, device stage, hand
out); the CUDA variants are parametrised and skip without a GPU. The pixels
against torchvision are in tests/fidelity/test_device_path.py; here: the
stage split the loader applies, what crosses the worker boundary, buffers
that must never change once handed out, dtype / channels_last, the API.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torchvision.transforms import v2

import dlstore
from dlstore.data.loaders.device import _Ring
from dlstore.errors import ArgumentError
from dlstore.transforms import (
    BatchCutout,
    BatchNormalize,
    HybridTransform,
    split_transforms,
)

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _to_float(x: torch.Tensor) -> torch.Tensor:
    return v2.functional.to_dtype(x, torch.float32, scale=True)


def _cifar() -> v2.Compose:
    return v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(), v2.ToImage(),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


@pytest.fixture(scope="module")
def stores(rgb_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("device-stores")
    return {fmt: dlstore.convert(rgb_folder, root / f"s{suffix}", static="resize=36,center_crop=32", workers=0,
                                 progress=False).path
            for fmt, suffix in (("shards", ".shards"), ("lmdb", ".lmdb"), ("hdf5", ".h5"))}


# --- the stage split ---------------------------------------------------------------------------

def test_host_stage_of_a_hybrid_stops_at_uint8(stores):
    hybrid = split_transforms(v2.Compose([v2.Resize(36), v2.CenterCrop(32), *_cifar().transforms]))
    ds = dlstore.open_dataset(stores["shards"], transform=hybrid)
    host_ds, steps = ds.host_stage()
    assert host_ds is not ds and host_ds.reader is ds.reader and type(host_ds) is type(ds)
    assert [type(s).__name__ for s in steps] == ["BatchNormalize"]
    assert steps[0].mean == MEAN and steps[0].dtype == torch.float32
    x, _ = host_ds.get_batch(range(8), generator=_gen(0))
    assert x.dtype == torch.uint8 and x.shape == (8, 3, 32, 32)
    # and the full dataset still normalises on the CPU (device=None is unchanged)
    assert ds.get_batch(range(8), generator=_gen(0))[0].dtype == torch.float32


def test_host_stage_without_a_float_tail_is_the_dataset(stores):
    ds = dlstore.open_dataset(stores["shards"], transform=v2.RandomHorizontalFlip())
    assert ds.host_stage() == (ds, [])
    plain = dlstore.open_dataset(stores["shards"], transform=lambda x: x.flip(-1))
    assert plain.host_stage() == (plain, [])


def test_batch_transform_runs_after_the_float_tail_on_the_device(stores):
    """batch_transform= runs after transform=: with device= it moves to the end of the device stage."""
    cut = BatchCutout(32, fill=0)          # the whole 32x32 image: deterministic
    ds = dlstore.open_dataset(stores["shards"], transform=v2.Compose([v2.ToDtype(torch.float32, scale=True)]),
                              batch_transform=cut)
    host_ds, steps = ds.host_stage()
    assert host_ds.batch_transform is None and len(steps) == 2 and steps[-1] is cut
    (x, _), = list(dlstore.loader(ds, 24, device="cpu"))
    assert x.dtype == torch.float32 and not x.any()


def test_explicit_device_stage(stores):
    """HybridTransform(static, host, device=[...]) places ops on the device stage by hand."""
    hybrid = HybridTransform("resize=36,center_crop=32", [v2.RandomCrop(32)],
                             device=[v2.RandomHorizontalFlip(1.0), v2.ToDtype(torch.float32, scale=True)])
    assert [type(t).__name__ for t in hybrid.host_ops] == ["RandomCrop"]
    assert [type(t).__name__ for t in hybrid.device_ops] == ["RandomHorizontalFlip", "ToDtype"]
    ds = dlstore.open_dataset(stores["lmdb"], transform=hybrid)
    raw, labels = ds.read_batch(range(24))
    got = list(dlstore.loader(ds, 7, device="cpu", generator=_gen(1)))
    assert torch.equal(torch.cat([x for x, _ in got]), _to_float(raw.flip(-1)))
    assert torch.equal(torch.cat([y for _, y in got]), labels)


# --- what crosses the worker boundary ----------------------------------------------------------

@pytest.mark.parametrize("workers", [0, 2])
def test_host_loader_moves_uint8(stores, workers):
    ds = dlstore.open_dataset(stores["hdf5"], transform=_cifar())
    loader = dlstore.loader(ds, 8, num_workers=workers, device="cpu", generator=_gen(2))
    host_ds = loader.strategy.dataset
    if workers:
        assert loader.strategy.spec == ((3, 32, 32), torch.uint8, None)    # the ring's slots: uint8
    host = [host_ds.get_batch(range(k, k + 8))[0] for k in range(0, 24, 8)]
    assert {x.dtype for x in host} == {torch.uint8} and sum(x.nbytes for x in host) == 24 * 3 * 32 * 32
    full = [x for x, _ in dlstore.loader(ds, 8, num_workers=workers, generator=_gen(2))]
    assert sum(x.nbytes for x in full) == 4 * sum(x.nbytes for x in host)
    assert all(x.dtype == torch.float32 for x, _ in loader)


# --- buffers handed out never change -----------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transform", ["uint8", "float"])
def test_batches_held_by_the_user_never_change(stores, transform, device):
    """More batches than ring slots, all held at once: each still equals its reference."""
    t = v2.RandomHorizontalFlip(1.0) if transform == "uint8" else \
        v2.Compose([v2.RandomHorizontalFlip(1.0), v2.ToDtype(torch.float32, scale=True)])
    ds = dlstore.open_dataset(stores["shards"], transform=t)
    raw, _ = ds.read_batch(range(24))
    ref = raw.flip(-1) if transform == "uint8" else _to_float(raw.flip(-1))
    for options in ({"backend": "dataloader"}, {"backend": "threads", "num_threads": 2}):
        held = list(dlstore.loader(ds, 2, device=device, **options))
        assert len(held) == 12
        torch.testing.assert_close(torch.cat([x for x, _ in held]).cpu(), ref, rtol=0, atol=0)


def test_ring_reuses_slots_and_waits_for_their_copy():
    ring = _Ring(2, pin=False)
    seen = []
    for k in range(5):
        images = torch.full((3, 2, 4, 4), k, dtype=torch.uint8)
        j, view = ring.stage(images)
        seen.append((j, view.data_ptr()))
        assert torch.equal(view, images) and view.data_ptr() != images.data_ptr()
    assert [j for j, _ in seen] == [0, 1, 0, 1, 0]
    assert seen[0][1] == seen[2][1] == seen[4][1] != seen[1][1]
    j, view = ring.stage(torch.ones((1, 2, 4, 4), dtype=torch.uint8))    # a smaller last batch: a view
    assert view.shape == (1, 2, 4, 4) and view.data_ptr() == seen[1][1]


# --- dtype, channels_last, labels, epochs ------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtype_and_channels_last(stores, dtype, device):
    ds = dlstore.open_dataset(stores["shards"], transform=_cifar())
    ref = [x for x, _ in dlstore.loader(ds, 10, generator=_gen(3), backend="threads", num_threads=2)]
    loader = dlstore.loader(ds, 10, generator=_gen(3), backend="threads", num_threads=2, device=device, dtype=dtype, channels_last=True)
    steps = loader.device_stage.steps
    assert isinstance(steps[-1], BatchNormalize)
    assert steps[-1].dtype == dtype                  # one kernel writes the dtype: no float32 intermediate
    got = list(loader)
    for x, r in zip([x for x, _ in got], ref):
        assert x.dtype == dtype and x.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(x.cpu(), r.to(dtype))
    assert all(y.device.type == torch.device(device).type and y.dtype == torch.int64 for _, y in got)


def test_epochs_len_and_set_epoch(stores):
    ds = dlstore.open_dataset(stores["shards"], transform=_cifar())
    loader = dlstore.loader(ds, 5, shuffle=True, device="cpu", generator=_gen(4), backend="threads", num_threads=2)
    assert len(loader) == 5 and loader.batch_sampler.sampler is loader.sampler
    first = torch.cat([y for _, y in loader])
    second = torch.cat([y for _, y in loader])
    assert sorted(first.tolist()) == sorted(second.tolist()) == sorted(ds.targets)
    assert not torch.equal(first, second)            # a new order each pass
    loader.set_epoch(3)
    assert loader.epoch == 3
    seeded = dlstore.loader(ds, 5, shuffle=True, device="cpu", seed=4, backend="threads", num_threads=2)
    seeded.set_epoch(3)
    third = [x for x, _ in seeded]
    seeded.set_epoch(3)
    assert all(torch.equal(a, b) for a, b in zip(third, [x for x, _ in seeded]))   # with a seed: epoch 3 again


def test_device_loader_pickles_nothing_it_cannot(stores):
    """The host dataset goes to spawned workers: it must pickle (its reader reopens there)."""
    ds = dlstore.open_dataset(stores["lmdb"], transform=_cifar())
    host_ds, _ = ds.host_stage()
    again = pickle.loads(pickle.dumps(host_ds))
    assert torch.equal(again.get_batch([0, 5], generator=_gen(0))[0], host_ds.get_batch([0, 5], generator=_gen(0))[0])


def test_errors_name_the_fix(stores):
    ds = dlstore.open_dataset(stores["shards"], transform=_cifar())
    with pytest.raises(ArgumentError, match="device="):
        dlstore.loader(ds, 4, dtype=torch.float16)
    with pytest.raises(ArgumentError, match="device="):
        dlstore.loader(ds, 4, channels_last=True)
    with pytest.raises(ArgumentError, match="pin_memory"):
        dlstore.loader(ds, 4, device="cpu", pin_memory=True)
    with pytest.raises(ArgumentError, match="dtype must be one of"):
        dlstore.loader(ds, 4, device="cpu", dtype=torch.int32)
    with pytest.raises(ArgumentError, match="not a torch device"):
        dlstore.loader(ds, 4, device="gpu0")
