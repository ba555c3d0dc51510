"""The read paths run their torch ops on one thread each, and leave torch's setting to the user.

Observed from inside the batch path (a batch transform records ``torch.get_num_threads()``
in the thread that builds the batch) and from the caller's threads around it; and the
batches are the same, bit for bit, with the guard off (torch's own thread count).
"""

from __future__ import annotations

import threading

import pytest
import torch

import dlstore
from dlstore.data import intraop
from dlstore.transforms.batch import (
    BatchCompose,
    BatchNormalize,
    BatchRandomResizedCrop,
)

pytestmark = pytest.mark.skipif(intraop.runtime() is None,
                                reason="torch's parallel backend here is not OpenMP: nothing to set per thread")


class Record:
    """A batch transform that records the intra-op thread count of the thread it runs in."""

    def __init__(self):
        self.seen: list[int] = []

    def __call__(self, images, generator=None):
        self.seen.append(torch.get_num_threads())
        return images


@pytest.fixture
def two_threads():
    """torch's count at 2 in this process (the default of a machine with 2 or more cores), restored after."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def store(rgb_folder, tmp_path_factory):
    """The 24-sample RGB folder as a 3x32x32 shards store."""
    return dlstore.convert(rgb_folder, tmp_path_factory.mktemp("intraop") / "s.shards",
                           static="resize=36,center_crop=32", workers=0, progress=False).path


def _in_new_thread() -> int:
    out = []
    t = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
    t.start()
    t.join()
    return out[0]


def _same_batches_on_torchs_pool(loader, monkeypatch, dtype):
    """An epoch of ``loader()`` with the guard (one intra-op thread) and one without it (main's
    behaviour: torch's own count) give more than one batch, of ``dtype``, equal bit for bit."""
    guarded = list(loader())
    monkeypatch.setattr(intraop, "runtime", lambda: None)
    pooled = list(loader())
    assert len(guarded) == len(pooled) > 1
    for (a, la), (b, lb) in zip(guarded, pooled):
        assert a.dtype == dtype and torch.equal(a, b) and torch.equal(la, lb)


def test_loader_threads_build_on_one_intra_op_thread_and_leave_the_callers_count(store, two_threads):
    record = Record()
    ds = dlstore.open_dataset(store, batch_transform=record)
    batches = list(dlstore.loader(ds, 8, backend="threads", num_threads=2))
    assert len(batches) > 1 and record.seen and set(record.seen) == {1}
    assert torch.get_num_threads() == 2          # the caller's thread
    assert _in_new_thread() == 2                 # and torch's default for threads started later


def test_dataloader_back_end_in_the_callers_thread_builds_on_one_and_restores(store, two_threads):
    record = Record()
    ds = dlstore.open_dataset(store, batch_transform=record)
    loader = dlstore.loader(ds, 8, backend="dataloader")
    seen_between = []
    for _ in loader:
        seen_between.append(torch.get_num_threads())   # the user's code between batches
    assert record.seen and set(record.seen) == {1}
    assert set(seen_between) == {2} and torch.get_num_threads() == 2
    assert _in_new_thread() == 2


def test_one_thread_restores_the_count_even_when_the_block_raises(two_threads):
    with pytest.raises(ValueError), intraop.one_thread():
        assert torch.get_num_threads() == 1
        raise ValueError
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("options", [{"backend": "threads", "num_threads": 2}, {"backend": "dataloader"}],
                         ids=["threads", "dataloader"])
def test_batches_equal_those_built_on_torchs_pool(store, two_threads, monkeypatch, options):
    # float ops and a resize: kernels torch splits over its pool; one thread must not change a bit
    pipeline = BatchCompose([BatchRandomResizedCrop(24), BatchNormalize([0.5, 0.4, 0.3], [0.2, 0.25, 0.3])])
    ds = dlstore.open_dataset(store, batch_transform=pipeline)
    _same_batches_on_torchs_pool(
        lambda: dlstore.loader(ds, 8, shuffle=True, generator=torch.Generator().manual_seed(3), **options),
        monkeypatch, torch.float32)


def test_gpu_dataset_on_cpu_builds_its_groups_on_one_thread_and_restores(store, two_threads):
    record = Record()
    gpu = dlstore.GPUDataset(store, device="cpu", dtype=torch.uint8, transform=record)
    seen_between = []
    for _ in dlstore.loader(gpu, 8, shuffle=True, seed=0):
        seen_between.append(torch.get_num_threads())
    assert len(record.seen) > 1 and set(record.seen) == {1}
    assert set(seen_between) == {2} and torch.get_num_threads() == 2
    assert _in_new_thread() == 2


@pytest.mark.parametrize("fused", [False, True])
def test_gpu_dataset_on_cpu_batches_equal_those_built_on_torchs_pool(store, two_threads, monkeypatch, fused):
    # crop with padding + flip, then the conversion to float16 with normalisation (float math)
    from dlstore.transforms.batch import BatchRandomCrop, BatchRandomHorizontalFlip

    aug = BatchCompose([BatchRandomCrop(28, padding=3), BatchRandomHorizontalFlip()])
    gpu = dlstore.GPUDataset(store, device="cpu", dtype=torch.float16, hold="uint8",
                             normalize=([0.5, 0.4, 0.3], [0.2, 0.25, 0.3]), transform=aug)
    _same_batches_on_torchs_pool(lambda: dlstore.loader(gpu, 8, shuffle=True, seed=3, fused=fused),
                                 monkeypatch, torch.float16)
