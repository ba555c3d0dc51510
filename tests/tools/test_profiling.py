"""TimedDataset across real worker processes (fork and spawn); profile_loader stall fractions."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import time

import pytest
import torch
from _datasets import SleepyDataset
from click.testing import CliRunner
from torch.utils.data import DataLoader

import dlstore
from dlstore.cli import main
from dlstore.sources.demo import make_image_folder
from dlstore.tools.profiling import (
    LoaderProfile,
    TimedDataset,
    profile_loader,
    synthetic_step,
)


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


class _TimedFetches(SleepyDataset):
    """SleepyDataset that records, outside the profiler, how long each of its fetches took."""

    def __init__(self, n: int, delay: float):
        super().__init__(n=n, delay=delay)
        self.fetches: list[float] = []

    def __getitem__(self, i):
        start = time.perf_counter()
        try:
            return super().__getitem__(i)
        finally:
            self.fetches.append(time.perf_counter() - start)


def _profile(dataset_delay: float, step_delay: float):
    """Profile 8 batches of 2 and measure, independently of the profiler, each batch's fetches
    (inside the wait, workers=0), each loop body (inside the step) and the wall time of the
    measured steps (from the end of the first body, which the skipped first step contains)."""
    ds = _TimedFetches(n=16, delay=dataset_delay)
    loader = DataLoader(ds, batch_size=2, num_workers=0)
    bodies, start = [], None
    with profile_loader(loader) as p:
        for _x, _y in p:
            body = time.perf_counter()
            time.sleep(step_delay)
            bodies.append(time.perf_counter() - body)
            start = start if start is not None else time.perf_counter()
    wall = time.perf_counter() - start
    fetched = [ds.fetches[k] + ds.fetches[k + 1] for k in range(0, 16, 2)]
    report = p.report()
    assert report.steps == 7  # 8 batches, the first skipped
    assert len(p.waits) == len(p.steps) == 8
    assert all(w >= f for w, f in zip(p.waits, fetched)) and all(s >= b for s, b in zip(p.steps, bodies))
    assert report.first_wait == p.waits[0] >= fetched[0]
    # the measured steps lie inside the wall time, and contain the fetches and bodies measured outside
    assert sum(fetched[1:]) <= report.wait and sum(bodies[1:]) <= report.step
    assert report.wait + report.step <= wall
    assert sum(fetched[1:]) / wall <= report.stall_fraction <= 1 - sum(bodies[1:]) / wall
    assert 1.0 <= report.speedup_if_free <= wall / max(sum(bodies[1:]), 1e-9)
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


def test_loader_report_of_known_waits_and_steps():
    """Hand-computed: skip the first step; wait 1+3+2 = 6 s, step 1+1+2 = 4 s: stall 6/10, speed-up
    10/4; numpy's linear percentiles of (1, 2, 3) and (1, 1, 2): p50 2 and 1, p95 2.9 and 1.9."""
    p = LoaderProfile([], sync=None, skip_first=1, record_function=False)
    p.waits, p.steps = [5.0, 1.0, 3.0, 2.0], [9.0, 1.0, 1.0, 2.0]
    r = p.report()
    assert (r.steps, r.first_wait, r.wait, r.step) == (3, 5.0, 6.0, 4.0)
    assert r.stall_fraction == pytest.approx(0.6) and r.speedup_if_free == pytest.approx(2.5)
    assert (r.wait_p50, r.step_p50) == (2.0, 1.0)
    assert r.wait_p95 == pytest.approx(2.9) and r.step_p95 == pytest.approx(1.9)
    p.waits, p.steps = [5.0, 1.0, 3.0], [9.0, 1.0]   # a step in progress: its wait is not counted
    r = p.report()
    assert (r.steps, r.wait, r.step, r.stall_fraction) == (1, 1.0, 1.0, 0.5)


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


def test_synthetic_sleep_step_sleeps_its_milliseconds():
    step = synthetic_step("sleep:30", device="cpu")
    start = time.perf_counter()
    step(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.tensor([0, 1]))
    assert time.perf_counter() - start >= 0.030   # time.sleep never returns early


def test_synthetic_matmul_step_costs_2_n_cubed_flops_whatever_the_batch():
    from torch.utils.flop_counter import FlopCounterMode

    step = synthetic_step("matmul:32", device="cpu")
    for batch in (torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.zeros(9, 1, 4, 4, dtype=torch.uint8)):
        with FlopCounterMode(display=False) as counter:
            step(batch, torch.zeros(len(batch), dtype=torch.int64))
        assert counter.get_total_flops() == 2 * 32 ** 3


def test_synthetic_conv_step_trains_on_labels_modulo_the_classes():
    """A forward, a backward and an SGD update, on labels beyond num_classes (taken modulo it)."""
    from torch.utils.flop_counter import FlopCounterMode

    step = synthetic_step("conv", device="cpu", num_classes=10)
    x, y = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8), torch.tensor([0, 9, 13, 25])
    with FlopCounterMode(display=False) as counter:
        step(x, y)
    ops = {str(op) for counts in counter.get_flop_counts().values() for op in counts}
    assert any("convolution_backward" in op for op in ops), ops
    assert any("convolution" in op and "backward" not in op for op in ops), ops


def test_synthetic_step_rejects_unknown():
    with pytest.raises(ValueError, match="matmul:N"):
        synthetic_step("resnet")
    with pytest.raises(ValueError, match="number"):
        synthetic_step("sleep:fast")


def test_cli_profile(store):
    runner = CliRunner()
    result = runner.invoke(main, ["profile", str(store), "-b", "4", "--steps", "8", "--num-workers", "2",
                                  "--step", "sleep:2", "--loader", "dataloader"])
    assert result.exit_code == 0, result.output
    assert "data-stall fraction" in result.output and "worker 1" in result.output
    result = runner.invoke(main, ["profile", str(store), "-b", "4", "--steps", "20", "--num-workers", "0",
                                  "--step", "matmul:16", "--json", "--loader", "dataloader"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["report"]["steps"] == 19  # 20 steps over several epochs of 6 batches, first skipped
    assert data["dataset_latency"]["__getitems__"]["samples"] >= 20 * 4
