"""The numpy kernels of ``BatchRandomHorizontalFlip`` and ``BatchCutout`` on CPU batches, against torch.

Two references on the same input and parameters: the torch kernels these replace on the
CPU (the transform with ``numpy_view`` switched off, i.e. the code path every other
device takes), bit for bit, and torchvision's per-sample ``horizontal_flip`` / ``erase``.
Over batch sizes, shapes (widths around the 8-byte word of ``copy_reversed``), dtypes,
fills (numbers out of range of the dtype, fractions, one per channel) and seeds.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchvision.transforms.v2 import functional as F

from dlstore.transforms import batch as batch_module
from dlstore.transforms.batch import BatchCutout, BatchRandomHorizontalFlip
from dlstore.transforms.cpu_kernels import numpy_view

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
          torch.float64, torch.bool]


def _images(b: int, c: int, h: int, w: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(b, c, h, w, generator=g) < 0.5
    if dtype.is_floating_point:
        return (torch.randn(b, c, h, w, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, (b, c, h, w), generator=g, dtype=dtype)


def _torch_path(op, images, params, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(batch_module, "numpy_view", lambda images: None)
        return op.apply(images, params)


shapes = st.tuples(st.integers(0, 9), st.integers(1, 4), st.integers(1, 12), st.integers(1, 40))


@settings(max_examples=150, deadline=None)
@given(shape=shapes, dtype=st.sampled_from(DTYPES), p=st.sampled_from([0.0, 0.5, 1.0]), seed=st.integers(0, 2**31))
def test_flip_numpy_kernel_equals_torch_and_torchvision(shape, dtype, p, seed):
    monkeypatch = pytest.MonkeyPatch()
    images = _images(*shape, dtype, seed)
    op = BatchRandomHorizontalFlip(p)
    params = op.sample(images.shape, generator=torch.Generator().manual_seed(seed))
    assert numpy_view(images) is not None            # the numpy kernel is the one under test
    got = op.apply(images, params)
    assert got.dtype == dtype and got.shape == images.shape
    assert torch.equal(got, _torch_path(op, images, params, monkeypatch))
    for k in range(len(images)):
        want = F.horizontal_flip(images[k]) if params["flip"][k] else images[k]
        assert torch.equal(got[k], want)
    assert images.numel() == 0 or got.data_ptr() != images.data_ptr()    # a new tensor


fills = st.one_of(st.integers(0, 255), st.floats(0, 200, allow_nan=False, width=32),
                  st.lists(st.integers(0, 120), min_size=1, max_size=1).map(tuple))


@settings(max_examples=150, deadline=None)
@given(shape=shapes, dtype=st.sampled_from([d for d in DTYPES if d != torch.bool]), size=st.integers(1, 12),
       fill=fills, seed=st.integers(0, 2**31))
def test_cutout_numpy_kernel_equals_torch_and_torchvision(shape, dtype, size, fill, seed):
    b, c, h, w = shape
    size = min(size, h, w)
    if isinstance(fill, tuple) and c > 1:
        fill = tuple(fill[0] + 3 * i for i in range(c))     # one value per channel
    if dtype == torch.int8 and not isinstance(fill, tuple):
        fill = fill % 100                                   # in range: masked_fill refuses an overflow
    monkeypatch = pytest.MonkeyPatch()
    images = _images(b, c, h, w, dtype, seed)
    op = BatchCutout(size, fill=fill)
    params = op.sample(images.shape, generator=torch.Generator().manual_seed(seed))
    got = op.apply(images, params)
    assert got.dtype == dtype
    assert torch.equal(got, _torch_path(op, images, params, monkeypatch))
    for k in range(b):
        v = torch.tensor(op.fill if isinstance(op.fill, tuple) else [op.fill]).to(dtype).view(-1, 1, 1)
        want = F.erase(images[k], int(params["top"][k]), int(params["left"][k]), size, size, v=v)
        assert torch.equal(got[k], want)


def test_cutout_fill_out_of_range_raises_as_the_torch_kernel_does():
    images = torch.zeros(2, 3, 8, 8, dtype=torch.int8)
    op = BatchCutout(2, fill=300)
    params = op.sample(images.shape)
    with pytest.raises(RuntimeError) as ours:
        op.apply(images, params)
    with pytest.MonkeyPatch().context() as m, pytest.raises(RuntimeError) as theirs:
        m.setattr(batch_module, "numpy_view", lambda images: None)
        op.apply(images, params)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(2, 3, 4, 4, dtype=torch.bfloat16),
    lambda: torch.zeros(2, 4, 4, 3, dtype=torch.uint8).permute(0, 3, 1, 2),     # channels-last view
    lambda: torch.zeros(2, 3, 4, 4, requires_grad=True),
])
def test_batches_numpy_cannot_take_stay_on_torch(make):
    images = make()
    assert numpy_view(images) is None
    op = BatchRandomHorizontalFlip(1.0)
    out = op.apply(images, op.sample(images.shape))
    assert torch.equal(out.detach(), images.detach().flip(-1))
