"""Per-step timelines (wait vs step, timestamps), the torch.profiler trace with dlstore's named
ranges, the comparison with ImageFolder and its plot."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
import torch
from _datasets import SleepyDataset
from click.testing import CliRunner
from torch.utils.data import DataLoader

import dlstore
from dlstore.cli import main
from dlstore.sources.demo import make_image_folder
from dlstore.tools.timeline import Timeline, record_timeline, trace_schedule


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("timeline")
    make_image_folder(root / "images", classes=2, per_class=12, size=(24, 32))
    dlstore.convert(root / "images", root / "p.shards", static="center_crop=16", progress=False, workers=1)
    return root


def test_each_step_is_timed_at_its_place_in_the_loop():
    """4 ms of fetch per batch in the loop (num_workers=0) against a 12 ms step: every wait and step
    is as long as it should be, and each step starts where the one before ended."""
    loader = DataLoader(SleepyDataset(n=8, delay=0.002), batch_size=2)   # 4 batches an epoch: restarts
    report, tl = record_timeline(loader, lambda x, y: time.sleep(0.012), steps=7, label="sleepy")
    assert report.steps == 6 and len(tl.starts) == len(tl.waits) == len(tl.steps) == 6
    assert tl.starts[0] == 0.0 and all(w >= 0.004 for w in tl.waits) and all(s >= 0.012 for s in tl.steps)
    for k in range(1, 6):   # contiguous: step k's wait starts right after step k-1's body
        assert tl.starts[k] - (tl.starts[k - 1] + tl.waits[k - 1] + tl.steps[k - 1]) < 0.002
    assert tl.wait_share() == pytest.approx(report.stall_fraction)
    assert 0.15 < tl.wait_share() < 0.45 and tl.util == [] and tl.util_reason


def test_timeline_report_with_and_without_utilisation():
    tl = Timeline("t", starts=[0.0, 0.1], waits=[0.03, 0.07], steps=[0.07, 0.03])
    assert tl.duration == pytest.approx(0.2) and tl.wait_share() == pytest.approx(0.5)
    assert tl.summary() == "wait share 50%" and "not sampled" in str(tl)
    tl.util = [(0.0, 100), (0.05, 0), (0.1, 0), (0.15, 100), (0.5, 0)]   # the last one after the steps
    assert tl.summary() == "wait share 50%, GPU util mean 50 %, at 0 % 50%"
    assert json.loads(json.dumps(tl.to_json()))["util"]["samples"] == 4


def test_trace_schedule_covers_the_steps():
    assert trace_schedule(10) == {"wait": 1, "warmup": 1, "active": 8, "repeat": 1}
    assert trace_schedule(2) == {"wait": 0, "warmup": 1, "active": 1, "repeat": 1}


def test_profile_trace_has_dlstores_named_ranges(store, tmp_path):
    """Three epochs of 6 batches, so the builder threads build batches while the profiler records."""
    result = CliRunner().invoke(main, ["profile", str(store / "p.shards"), "-b", "4", "--num-threads", "2",
                                       "--steps", "14", "--step", "sleep:1", "--trace", str(tmp_path / "tr")])
    assert result.exit_code == 0, result.output
    assert "timeline" in result.output and "waiting for data" in result.output
    traces = list((tmp_path / "tr").glob("*.pt.trace.json"))
    assert len(traces) == 1
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert {"dlstore.wait_for_data", "dlstore.step", "dlstore.build_batch", "dlstore.read"} <= names


def test_profiling_range_marks_a_users_loop(tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with dlstore.profiling_range("user.augment"):
            torch.ones(4).add_(1)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    assert "user.augment" in {e.get("name") for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]}



def test_profiling_range_decides_per_call_whether_to_record(tmp_path):
    # decorated, and called once, before any profiler runs: recorded all the same once one does
    @dlstore.profiling_range("user.decorated")
    def step():
        return torch.ones(4).add_(1)

    step()
    with dlstore.profiling_range("user.before"):     # entered with nobody listening, left while one is
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
            with dlstore.profiling_range("user.outer"), dlstore.profiling_range("user.inner"):
                torch.ones(2).mul_(3)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    names = {e.get("name") for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]}
    assert {"user.decorated", "user.outer", "user.inner"} <= names and "user.before" not in names
    assert step().tolist() == [2.0] * 4


def test_one_profiling_range_entered_inside_itself_and_from_two_threads(tmp_path):
    shared = dlstore.profiling_range("user.shared")
    errors: list[BaseException] = []

    def work():
        try:
            for _ in range(50):
                with shared:
                    with shared:
                        torch.ones(2).add_(1)
                    torch.ones(2).add_(1)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        threads = [threading.Thread(target=work) for _ in range(2)]
        for t in threads:
            t.start()
        work()
        for t in threads:
            t.join()
    assert errors == []
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    events = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e.get("name") == "user.shared"]
    # the profiling thread's ranges all recorded (kineto records other threads' only on request),
    # each outer one closing after its inner one, not when the inner one began
    by_thread: dict = {}
    for e in events:
        by_thread.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    assert max(len(spans) for spans in by_thread.values()) == 100
    for spans in by_thread.values():
        spans.sort()
        outers, inners = spans[0::2], spans[1::2]
        assert all(o[0] <= i[0] and i[1] <= o[1] for o, i in zip(outers, inners))

def test_compare_with_imagefolder_and_plot_both(store, tmp_path):
    pytest.importorskip("matplotlib", exc_type=ImportError)   # installed but built for a newer numpy: skip too
    from dlstore.tools.timeline_plot import plot_timelines

    png = tmp_path / "cmp.png"
    result = CliRunner().invoke(main, ["profile", str(store / "p.shards"), "-b", "4", "--num-workers", "0",
                                       "--backend", "threads", "--num-threads", "2", "--steps", "5", "--step",
                                       "sleep:1", "--json", "--compare", f"imagefolder:{store / 'images'}",
                                       "--plot", str(png)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["loader"].endswith("-> backend='threads', num_threads=2") and data["backend"] == "threads"
    # the current pipeline is a DataLoader: dlstore.loader's own arguments stay with dlstore's run
    assert data["compare"]["backend"] is None and data["compare"]["kwargs"] == {
        "batch_size": 4, "num_workers": 0, "pin_memory": False}
    assert data["compare"]["loader"].startswith("DataLoader(dataset, batch_size=4, num_workers=0")
    assert data["compare"]["transform"] == "" and len(data["compare"]["timeline"]["steps"]) == 4
    assert data["compare"]["dataset_latency"]["__getitem__"]["calls"] >= 16   # decoded per sample: the folder
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the figure itself: two panels, the current pipeline on top, the stall share written on each
    keys = ("label", "starts", "waits", "steps")
    timelines = [Timeline(**{k: run["timeline"][k] for k in keys}) for run in (data["compare"], data)]
    fig = plot_timelines(timelines)
    assert len(fig.axes) == 2 and fig.axes[0].get_title(loc="left").startswith("current pipeline: ImageFolder")
    for ax, tl in zip(fig.axes, timelines):
        texts = [t.get_text() for t in ax.texts]
        assert any(f"data stall (wait share) {tl.wait_share():.0%}" in t for t in texts), texts


def test_plot_needs_matplotlib_and_says_how_to_install(store, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # as if not installed
    result = CliRunner().invoke(main, ["profile", str(store / "p.shards"), "-b", "4", "--plot", "x.png"])
    assert result.exit_code == 2 and "pip install 'dlstore[plot]'" in result.output


def test_compare_refuses_other_forms(store):
    result = CliRunner().invoke(main, ["profile", str(store / "p.shards"), "-b", "4", "--compare", str(store)])
    assert result.exit_code == 2 and "imagefolder:PATH" in result.output


def test_profile_training_runs_the_users_own_step_over_each_loader(store, tmp_path):
    from torchvision import datasets
    from torchvision.transforms import v2

    from dlstore.tools import profile_training, training_step

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 2))
    before = model[1].weight.detach().clone()
    step = training_step(model, torch.nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    folder = datasets.ImageFolder(str(store / "images"), transform=v2.Compose([v2.CenterCrop(16), v2.PILToTensor()]))
    loaders = {"ImageFolder": DataLoader(folder, batch_size=4, shuffle=True),
               "dlstore": dlstore.loader(dlstore.open_dataset(store / "p.shards"), batch_size=4, shuffle=True)}
    result = profile_training(loaders, step, steps=4, trace_dir=tmp_path / "tr")
    assert [label for label, _, _ in result.runs] == ["ImageFolder", "dlstore"]
    assert all(report.steps == 3 and len(tl.steps) == 3 for _, report, tl in result.runs)
    assert not torch.equal(model[1].weight, before)                       # the optimiser stepped
    assert "compare   ImageFolder: wait share" in str(result) and set(result.to_json()) == {"ImageFolder", "dlstore"}
    assert len(list((tmp_path / "tr" / "dlstore").glob("*.pt.trace.json"))) == 1
    assert len(list((tmp_path / "tr" / "ImageFolder").glob("*.pt.trace.json"))) == 1


def test_plot_draws_the_utilisation_line_where_there_are_readings(tmp_path):
    pytest.importorskip("matplotlib", exc_type=ImportError)   # installed but built for a newer numpy: skip too
    from dlstore.tools.timeline_plot import plot_timelines

    swinging = Timeline("cuda run", starts=[0.0, 0.1], waits=[0.05, 0.05], steps=[0.05, 0.05],
                        util=[(0.0, 0), (0.05, 100), (0.1, 0), (0.15, 100)])
    cpu = Timeline("cpu run", starts=[0.0, 0.1], waits=[0.01, 0.01], steps=[0.09, 0.09])
    fig = plot_timelines([swinging, cpu], tmp_path / "u.png", title="t")
    (top, bottom) = fig.axes
    assert [line.get_ydata().tolist() for line in top.lines] == [[0, 100, 0, 100]] and len(bottom.lines) == 0
    assert "GPU util mean 50 %, at 0 % 50% of the time" in top.texts[0].get_text()
    assert "wait share) 10%" in bottom.texts[0].get_text() and "no GPU utilisation" in bottom.texts[0].get_text()
    assert (tmp_path / "u.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU utilisation is sampled on CUDA only")
def test_profile_on_cuda_reports_utilisation(store):
    result = CliRunner().invoke(main, ["profile", str(store / "p.shards"), "-b", "4", "--steps", "30",
                                       "--device", "cuda", "--step", "matmul:2048", "--json"])
    assert result.exit_code == 0, result.output
    timeline = json.loads(result.stdout)["timeline"]
    if timeline["util"] is None:
        pytest.skip(f"NVML not usable: {timeline['util_reason']}")
    assert timeline["util"]["samples"] >= 1 and 0 <= timeline["util"]["mean"] <= 100


def test_trace_names_every_stage_of_a_device_loader(store, tmp_path):
    """dlstore.loader(device=) on the CPU: the device stage's copy and transforms are ranges too."""
    loader = dlstore.loader(dlstore.open_dataset(store / "p.shards"), batch_size=4, shuffle=True, device="cpu",
                            backend="threads", num_threads=2)
    record_timeline(loader, lambda x, y: None, steps=14, trace_dir=tmp_path / "tr")
    (trace,) = (tmp_path / "tr").glob("*.pt.trace.json")
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"dlstore.build_batch", "dlstore.read", "dlstore.host_transforms", "dlstore.copy_to_device",
            "dlstore.device_transforms", "dlstore.wait_for_data", "dlstore.step"} <= names
