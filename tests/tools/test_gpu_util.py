"""GPU utilisation: the summary of recorded readings (hand-made), and the NVML sampler where CUDA is."""

from __future__ import annotations

import time

import pytest
import torch

from dlstore.tools.gpu_util import UtilSampler, summarise_utilisation


def test_summary_of_recorded_readings():
    # nvidia-smi's swing: busy, idle, busy... every 50 ms
    samples = [(0.00, 100), (0.05, 0), (0.10, 0), (0.15, 90), (0.20, 0), (0.25, 50), (0.30, 100), (0.35, 0)]
    stats = summarise_utilisation(samples)
    assert stats.samples == 8 and stats.mean == pytest.approx(340 / 8)
    assert stats.zero_share == pytest.approx(4 / 8) and stats.interval == pytest.approx(0.05)
    window = summarise_utilisation(samples, start=0.12, end=0.31)      # 90, 0, 50, 100
    assert window.samples == 4 and window.mean == pytest.approx(60) and window.zero_share == 0.25


def test_summary_drops_readings_nvml_cannot_give():
    stats = summarise_utilisation([(0.2, 40), (0.0, -1), (0.1, 4294967295), (0.3, 0)])
    assert stats.samples == 2 and stats.mean == 20 and stats.zero_share == 0.5 and stats.interval == pytest.approx(0.1)
    assert summarise_utilisation([]) is None
    assert summarise_utilisation([(5.0, 30)], start=0, end=1) is None
    assert summarise_utilisation([(0.5, 30)]).interval == 0.0


def test_sampler_off_cuda_says_why_and_samples_nothing():
    sampler = UtilSampler("cpu", interval=0.001)
    with sampler:
        time.sleep(0.01)
    assert not sampler.available and sampler.samples == [] and "cpu" in sampler.reason


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the NVML sampler needs a CUDA device")
def test_sampler_reads_nvml_beside_a_busy_gpu():
    sampler = UtilSampler("cuda", interval=0.02)
    if not sampler.available:
        pytest.skip(f"NVML not usable here: {sampler.reason}")
    a = torch.randn(4096, 4096, device="cuda")
    with sampler:
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:
            a = a @ a
            a = a / a.norm()
        torch.cuda.synchronize()
    stats = summarise_utilisation(sampler.samples)
    assert stats.samples >= 10 and 0 < stats.mean <= 100
    assert stats.interval == pytest.approx(0.02, abs=0.03)
