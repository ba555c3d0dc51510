"""TimedDataset across real worker processes (fork and spawn); profile_loader stall fractions."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import time

import pytest
import torch
from click.testing import CliRunner
from torch.utils.data import DataLoader, Dataset

import dlstore
from dlstore.cli import main
from dlstore.sources.demo import make_image_folder
from dlstore.tools.profiling import TimedDataset, profile_loader, synthetic_step


class SleepyDataset(Dataset):
    """Every ``__getitem__`` sleeps ``delay`` seconds; sample i is filled with i."""

    def __init__(self, n: int = 24, delay: float = 0.0):
        self.n, self.delay = n, delay
        self.classes = ["a", "b"]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        return torch.full((2, 4, 4), i, dtype=torch.int32), i % 2


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("prof")
    make_image_folder(root / "images", classes=2, per_class=12, size=(24, 32))
    dlstore.convert(root / "images", root / "p.shards", static="center_crop=16", progress=False,
                    workers=1)
    return root / "p.shards"


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_timed_dataset_collects_from_two_workers(context):
    if context not in multiprocessing.get_all_start_methods():
        pytest.skip(f"{context} not available here")
    delay = 0.003
    timed = TimedDataset(SleepyDataset(n=24, delay=delay), max_workers=4)
    loader = DataLoader(timed, batch_size=3, num_workers=2, multiprocessing_context=context)
    seen = torch.cat([x[:, 0, 0, 0] for x, _ in loader])
    assert sorted(seen.tolist()) == list(range(24))  # the wrapper changes nothing in the data
    stats = timed.stats()["__getitem__"]
    assert stats.calls == stats.samples == 24
    assert stats.processes == 2
    # Each call slept `delay`: every statistic is at least that (sleep never returns early).
    assert delay <= stats.p50 <= stats.p95 <= stats.max and stats.mean >= delay
    per = timed.stats(per_process=True)
    assert set(per) == {"worker 0", "worker 1"}
    assert sum(s["__getitem__"].calls for s in per.values()) == 24
    assert "worker 1" in timed.report()


def test_timed_dataset_getitems_follows_the_wrapped_dataset(store):
    plain = TimedDataset(SleepyDataset())
    assert not hasattr(plain, "__getitems__")
    timed = TimedDataset(dlstore.open_dataset(store))
    assert hasattr(timed, "__getitems__")
    batches = list(DataLoader(timed, batch_size=5, num_workers=0))
    stats = timed.stats()
    assert set(stats) == {"__getitems__"}  # DataLoader fetched whole batches
    s = stats["__getitems__"]
    assert s.calls == len(batches) and s.samples == len(timed) and s.processes == 1
    assert s.per_sample == pytest.approx(s.mean * s.calls / s.samples)
    assert list(timed.stats(per_process=True)) == ["main"]
    image, label = timed[0]  # a single index goes through __getitem__
    assert torch.equal(image, dlstore.open_dataset(store)[0][0])
    assert timed.stats()["__getitem__"].calls == 1


def test_timed_dataset_passthrough_reset_and_pickle():
    timed = TimedDataset(SleepyDataset(n=5), capacity=2)
    assert timed.classes == ["a", "b"] and len(timed) == 5
    for i in range(5):
        timed[i]
    assert timed.stats()["__getitem__"].calls == 5  # more calls than the ring holds: counts stay exact
    clone = pickle.loads(pickle.dumps(timed))
    assert clone.stats()["__getitem__"].calls == 5
    timed.reset()
    assert timed.stats() == {} and timed.report() == "no calls recorded"
    with pytest.raises(AttributeError):
        timed.no_such_attribute
    with pytest.raises(ValueError, match="max_workers"):
        TimedDataset(SleepyDataset(), max_workers=-1)


def test_timed_dataset_refuses_more_workers_than_rows():
    timed = TimedDataset(SleepyDataset(n=4), max_workers=1)
    iterator = iter(DataLoader(timed, batch_size=1, num_workers=2))
    with pytest.raises(ValueError, match="max_workers"):
        list(iterator)
    iterator._shutdown_workers()  # now, not at a later garbage collection (which waits 5 s a worker)


def _profile(dataset_delay: float, step_delay: float):
    loader = DataLoader(SleepyDataset(n=16, delay=dataset_delay), batch_size=2, num_workers=0)
    with profile_loader(loader) as p:
        for _x, _y in p:
            time.sleep(step_delay)
    report = p.report()
    assert report.steps == 7  # 8 batches, the first skipped
    assert len(p.waits) == len(p.steps) == 8
    assert report.wait == pytest.approx(sum(p.waits[1:])) and report.step == pytest.approx(sum(p.steps[1:]))
    assert report.stall_fraction == pytest.approx(report.wait / (report.wait + report.step))
    assert report.speedup_if_free == pytest.approx((report.wait + report.step) / report.step)
    return p, report


def test_profile_loader_stall_tracks_the_slow_side():
    # Lower bounds only (time.sleep never returns early), so outside load cannot fail them: each
    # wait holds the two samples' sleeps when the data is slow, each step its sleep when the step is.
    delay = 0.01
    slow_data, data_report = _profile(dataset_delay=delay, step_delay=0.0)
    assert all(w >= 2 * delay for w in slow_data.waits)
    assert data_report.wait >= 7 * 2 * delay
    slow_step, step_report = _profile(dataset_delay=0.0, step_delay=2 * delay)
    assert all(s >= 2 * delay for s in slow_step.steps)
    assert step_report.step >= 7 * 2 * delay


def test_profile_loader_early_break_and_misuse():
    loader = DataLoader(SleepyDataset(n=20), batch_size=2)
    with profile_loader(loader, skip_first=0) as p:
        for i, _ in enumerate(p):
            if i == 2:
                break
    assert len(p.waits) == len(p.steps) == 3
    assert p.report().steps == 3
    with profile_loader(loader) as unused:
        for _ in loader:  # iterating the loader, not the profiler
            pass
    with pytest.raises(ValueError, match="iterate the profiler"):
        unused.report()


def test_profile_loader_labels_show_in_a_torch_profiler_trace():
    loader = DataLoader(SleepyDataset(n=6), batch_size=2)
    # The legacy profiler: same record_function ranges, without kineto's seconds of start-up.
    with torch.autograd.profiler.profile(use_kineto=False) as prof:
        with profile_loader(loader, record_function=True) as p:
            for x, _ in p:
                x.float().sum()
    names = {e.key for e in prof.key_averages()}
    assert {"dlstore.wait_for_data", "dlstore.step"} <= names


@pytest.mark.parametrize("spec", ["conv", "matmul:32", "sleep:1"])
def test_synthetic_steps_run_on_cpu(spec):
    step = synthetic_step(spec, device="cpu")
    step(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.tensor([0, 1]))


def test_synthetic_step_rejects_unknown():
    with pytest.raises(ValueError, match="matmul:N"):
        synthetic_step("resnet")
    with pytest.raises(ValueError, match="number"):
        synthetic_step("sleep:fast")


def test_cli_profile(store):
    runner = CliRunner()
    result = runner.invoke(main, ["profile", str(store), "-b", "4", "--steps", "8", "--workers", "2",
                                  "--step", "sleep:2"])
    assert result.exit_code == 0, result.output
    assert "data-stall fraction" in result.output and "worker 1" in result.output
    result = runner.invoke(main, ["profile", str(store), "-b", "4", "--steps", "20", "--workers", "0",
                                  "--step", "matmul:16", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["report"]["steps"] == 19  # 20 steps over several epochs of 6 batches, first skipped
    assert data["dataset_latency"]["__getitems__"]["samples"] >= 20 * 4
