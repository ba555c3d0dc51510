"""Training parity, fast: benchmarks/train_parity.py's four paths, one seed, two epochs, a tiny CNN.

The benchmark (5 seeds, the full model) is the measurement; this keeps its code running in CI
and catches a path that stops learning, drifts far from torchvision, or serves other pixels.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn", reason="scikit-learn provides the digits: pip install -e '.[test]'")

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "train_parity.py"
# Chance is 10 %. Two epochs of the tiny CNN, seeds 0-3 measured: 92-97 % on the test set and
# 85-93 % on the shifted one on every path; a path was at most 4.5 (test) and 7.3 (shifted) points
# from (a) of the same seed. One seed is noisy: these bounds catch a path that does not learn or
# learns something else; the pixel tests in this file catch the subtle drifts.
MIN_ACCURACY = 80.0
TOLERANCE = 10.0


@pytest.fixture(scope="module")
def parity():
    """The benchmark script as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("train_parity", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_parity"] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("train_parity", None)


@pytest.fixture(scope="module")
def setup(parity, tmp_path_factory):
    return parity.prepare(tmp_path_factory.mktemp("parity"))


def test_digits_are_a_fixed_stratified_split(setup):
    assert len(setup.base) == 1347 and len(setup.test_y) == 450
    assert setup.base.dtype == torch.uint8 and tuple(setup.base.shape[1:]) == (1, 32, 32)
    assert torch.bincount(setup.test_y).tolist() == [44, 46, 44, 46, 45, 46, 45, 45, 44, 45]
    assert setup.shifted_x.shape == setup.test_x.shape and not torch.equal(setup.shifted_x, setup.test_x)


@pytest.mark.parametrize("path", ["a", "b", "c"])
def test_first_batch_is_torchvisions_pixels(parity, setup, path):
    """Each sample equals torchvision's RandomCrop(32, padding=4) + ToDtype + Normalize of the stored
    image for some offset, and the offsets differ between samples."""
    result = parity.check_pixels(path, setup, batch_size=64, gpu={})
    assert result["matched"] == result["samples"] == 64, result
    assert result["distinct"] > 10, result


@pytest.mark.parametrize(("control", "matched", "distinct"), [("n", 64, 1), ("m", 1, 1)])
def test_pixel_check_sees_a_drifted_crop(parity, setup, control, matched, distinct):
    """No crop: every sample is the centre offset. Mean-grey padding: only an uncropped sample matches."""
    result = parity.check_pixels(control, setup, batch_size=64)
    assert result["matched"] <= matched and result["distinct"] <= distinct, result


def test_block_shuffled_paths_cover_the_epoch_and_mix_less(parity, setup):
    """(d) and the control (k) read every sample at most once per epoch, all but the dropped last
    batch, in orders more local than (b)'s full shuffle: fewer classes per batch, (k) fewest."""
    for path in parity.BLOCKS:
        labels = torch.cat([y for _, y in parity.make_loader(path, setup, seed=1, batch_size=64)])
        assert len(labels) == len(setup.base) // 64 * 64
        full = torch.bincount(setup.test_y.new_tensor(parity.datasets.ImageFolder(str(setup.train_dir)).targets))
        assert (torch.bincount(labels, minlength=10) <= full).all()
    mixing = {path: parity.classes_per_batch(path, setup, batch_size=64) for path in ("b", "d", "k")}
    assert mixing["k"] < mixing["d"] < mixing["b"], mixing


@pytest.mark.slow  # about 8 s of CPU (three trainings); CI runs it, `-m 'not slow'` skips it
def test_every_path_learns_and_stays_near_torchvision(parity, setup):
    """Test and shifted-test accuracy: every path (block shuffle included) far above chance and
    within TOLERANCE of (a)."""
    torch.set_num_threads(1)  # deterministic, and fair to the other jobs on the machine
    gpu: dict = {}
    runs = {path: parity.run_path(path, setup, seed=0, epochs=2, batch_size=32, width=4, lr=0.1, device="cpu",
                                  gpu=gpu) for path in parity.PATHS}
    for metric in ("accuracy", "shifted"):
        scores = {path: r[metric] for path, r in runs.items()}
        for score in scores.values():
            assert score >= MIN_ACCURACY, (metric, scores)
            assert abs(score - scores["a"]) <= TOLERANCE, (metric, scores)
