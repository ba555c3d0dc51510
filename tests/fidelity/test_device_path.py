"""The device path (``dlstore.loader(..., device=)``) gives torchvision's pixels, and today's loader's.

The loader's threads or workers run the host stage (uint8), the main process
the device stage (``ToDtype`` + ``Normalize`` as one ``BatchNormalize``) on
``device``. Reference: the case's torchvision pipeline itself, per sample
(``fidelity_harness.check_path``: the parameters recovered from the output among
those torchvision can draw, then torchvision's kernels with them), never dlstore's
split of it into stages; and the same loader with ``device=None`` (normalising in
the threads/workers).

Bounds: float32 identical to torchvision's float32 (the same float32 operations
in the same order, on the CPU and on CUDA); float16 / bfloat16 identical to the
float32 reference rounded once to the dtype, hence within half an ulp:
d <= 2**-11 |ref| + 2**-25 (float16), d <= 2**-8 |ref| (bfloat16), both checked by
``assert_same``. CUDA variants are parametrised and skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from fidelity_harness import check_path, gen, make_store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_paths import CASES, LOADER_CASES, MEAN, STD, _open
from torchvision.transforms import v2

import dlstore

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda,
                                                pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")])]
DTYPES = [None, torch.float32, torch.float16, torch.bfloat16]
# batch_transform= cases (cutout) run their random draws in the device stage: covered in
# tests/data/test_device_loader.py, not against the host draws modelled here
DEVICE_CASES = [c for c in LOADER_CASES if isinstance(CASES[c], list)]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("device-path")
    made: dict = {}

    def get(fmt: str = "shards", size: tuple[int, int] = (13, 11)):
        if (fmt, size) not in made:
            made[fmt, size] = make_store(root, fmt, size)
        return made[fmt, size]

    return get


def check_device_loader(ops, ds, batch_size: int, seed: int, *, device: str, dtype=None, workers: int = 0,
                        threads: int = 0, context=None) -> None:
    """``ds`` opened with ``v2.Compose(ops)``: each batch is torchvision's ``ops`` per sample, rounded
    once to ``dtype``, and the batch of the same loader with ``device=None``. The host stage runs in
    ``threads`` loader threads (``backend="threads"``), else in a torch DataLoader with ``workers``."""
    n = len(ds)
    bounds = [(s, min(s + batch_size, n)) for s in range(0, n, batch_size)]
    raw_all, labels_all = ds.read_batch(range(n))
    options = {"num_workers": workers, "multiprocessing_context": context,
               "backend": "threads" if threads else "dataloader", "num_threads": threads or None}
    loader = dlstore.loader(ds, batch_size, generator=gen(seed), device=device, dtype=dtype, **options)
    assert loader.backend == options["backend"] and loader.device == torch.device(device)
    got = list(loader)
    cpu = list(dlstore.loader(ds, batch_size, generator=gen(seed), **options))
    assert len(got) == len(cpu) == len(bounds)
    for (s, e), (x, y), (xc, yc) in zip(bounds, got, cpu):
        what = f"batch {s}:{e}, {workers} workers, {threads} threads, {device}, {dtype}"
        assert x.device.type == torch.device(device).type and y.device == x.device, what
        check_path(ops, raw_all[s:e], x, what=what)
        assert torch.equal(x.cpu(), xc if dtype is None or not xc.is_floating_point() else xc.to(dtype)), what
        assert torch.equal(y.cpu(), labels_all[s:e]) and torch.equal(y.cpu(), yc), what


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("case", DEVICE_CASES)
def test_device_loader_equals_torchvision_and_cpu_path(stores, case, threads, device):
    check_device_loader(CASES[case], _open(stores("lmdb" if threads else "shards"), case), 5, seed=3,
                        threads=threads, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["pipeline", "todtype+normalize", "crop-asym+flip-p0.5"])
def test_device_loader_forked_workers(stores, case, device):
    """Two real DataLoader workers run the host stage; only uint8 crosses to the main process."""
    ds = _open(stores("hdf5"), case)
    check_device_loader(CASES[case], ds, 4, seed=5, workers=2, context="fork", device=device, dtype=torch.float16)
    host_ds, _ = ds.host_stage()     # what the workers of a device= loader run
    host = dlstore.loader(host_ds, 4, num_workers=2, multiprocessing_context="fork", backend="dataloader")
    assert {x.dtype for x, _ in host} == {torch.uint8}


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(size=st.sampled_from([(13, 11), (7, 16), (1, 1)]), seed=st.integers(0, 2**31), batch_size=st.integers(1, 12),
       dtype=st.sampled_from(DTYPES), threads=st.sampled_from([0, 2]), grow=st.integers(-3, 2),
       padding=st.lists(st.integers(0, 3), min_size=4, max_size=4), p=st.sampled_from([0.0, 0.5, 1.0]),
       mean=st.tuples(*[st.floats(0, 1)] * 3), std=st.tuples(*[st.floats(0.05, 2)] * 3))
def test_device_loader_any_size_seed_and_dtype(stores, size, seed, batch_size, dtype, threads, grow, padding, p,
                                               mean, std):
    h, w = size
    left, top, right, bottom = padding
    crop = (max(1, min(h + top + bottom, h + grow)), max(1, min(w + left + right, w + grow)))
    ops = [v2.RandomCrop(crop, padding=padding), v2.RandomHorizontalFlip(p), v2.ToDtype(torch.float32, scale=True),
           v2.Normalize(mean, std)]
    ds = dlstore.open_dataset(stores("shards", size), transform=v2.Compose(ops))
    check_device_loader(ops, ds, batch_size, seed, threads=threads, device="cpu", dtype=dtype)


def test_imagenet_stats_fit_the_stated_bounds():
    """The bounds the docstring states hold, and are not loose, on the values a normalised batch holds."""
    x = torch.arange(256, dtype=torch.float32).div(255)[:, None].sub(torch.tensor(MEAN)).div(torch.tensor(STD))
    x = x.double().reshape(-1)
    for dtype, rel in ((torch.float16, 2.0 ** -11), (torch.bfloat16, 2.0 ** -8)):
        d = (x.float().to(dtype).double() - x).abs()
        assert bool((d <= rel * x.abs() + 2.0 ** -25).all())
        assert float((d / x.abs().clamp_min(1e-3)).max()) > 0.5 * rel
