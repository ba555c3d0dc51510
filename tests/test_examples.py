"""The recipes under examples/ run, on real stores, for a few steps.

Each example is imported from its file (examples/ is not a package). Examples that
need a client library (Lightning, timm) skip with the reason when it is not
installed: ``pip install -e '.[examples]'`` installs them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from torchvision.transforms.v2 import functional as F

import dlstore
from dlstore.sources import pil_loader

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"dlstore_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example(name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python examples/NAME.py ARGS`` with the dlstore this test imports."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(dlstore.__file__).resolve().parents[1]),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


def cifar_like(n: int = 512, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` 32x32x3 uint8 images whose pixels are a function of (label, index): a class colour,
    a gradient whose direction depends on the index, and noise; labels ``i % 10``."""
    rng = np.random.default_rng(seed)
    labels = (np.arange(n) % 10).astype(np.int64)
    y, x = np.mgrid[0:32, 0:32].astype(np.float32)
    colours = rng.uniform(40, 215, (10, 3)).astype(np.float32)
    angle = np.arange(n, dtype=np.float32)[:, None, None] * 0.7
    ramp = 30 * np.sin((np.cos(angle) * x + np.sin(angle) * y) / 5)
    images = colours[labels][:, None, None, :] + ramp[..., None] + rng.normal(0, 8, (n, 32, 32, 3))
    return np.clip(images, 0, 255).astype(np.uint8), labels


# --- CIFAR-10 from device memory (no client library needed) -------------------------------

def test_cifar10_recipe_trains_on_a_store_of_an_array(tmp_path):
    example = load_example("cifar10_gpu")
    images, labels = cifar_like()
    store = tmp_path / "cifar10.shards"
    dlstore.convert((images, labels), store, workers=0, progress=False)

    ds = dlstore.open_dataset(store)
    stored, stored_labels = ds.read_batch(list(range(len(ds))))
    assert torch.equal(stored, torch.from_numpy(images).permute(0, 3, 1, 2))
    assert torch.equal(stored_labels, torch.from_numpy(labels))

    # What GPUDataset serves is ToDtype(scale=True) + Normalize of those pixels.
    gpu = dlstore.GPUDataset(store, device="cpu", dtype=torch.float32, normalize=(example.MEAN, example.STD))
    mean, std = torch.tensor(example.MEAN).view(1, 3, 1, 1), torch.tensor(example.STD).view(1, 3, 1, 1)
    torch.testing.assert_close(gpu.data, (stored.float() / 255 - mean) / std, rtol=0, atol=1e-6)

    losses = example.train(store, device="cpu", steps=8, batch_size=64, width=8)
    assert len(losses) == 8
    assert all(math.isfinite(v) for v in losses), losses
    assert abs(losses[0] - math.log(10)) < 0.5, losses   # 10 classes, small logits at the start
    assert max(losses[-3:]) < losses[0], losses          # learning, not diverging (classes differ in colour)


def test_cifar10_recipe_refuses_a_device_that_is_not_there(tmp_path):
    example = load_example("cifar10_gpu")
    images, labels = cifar_like(16)
    store = tmp_path / "c.shards"
    dlstore.convert((images, labels), store, workers=0, progress=False)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        example.train(store, device="cuda", steps=1)


# --- timm -----------------------------------------------------------------------------------

@pytest.fixture
def timm_store(varsize_folder, tmp_path):
    """The variable-size folder converted with timm's static part (none): decoded images as they are."""
    pytest.importorskip("timm", reason="timm is not installed (pip install -e '.[examples]')")
    example = load_example("timm_pipeline")
    pipeline, hybrid = example.split_timm(32)
    store = tmp_path / "timm.shards"
    dlstore.convert(varsize_folder, store, static=hybrid, workers=0, progress=False)
    return example, pipeline, hybrid, store


def test_timm_split_places_each_op(timm_store):
    _, pipeline, hybrid, store = timm_store
    assert [type(t).__name__ for t in pipeline.transforms] == [
        "RandomResizedCropAndInterpolation", "RandomHorizontalFlip", "ColorJitter", "MaybeToTensor", "Normalize"]
    assert hybrid.static_spec == []
    assert [type(t).__name__ for t in hybrid.dynamic_ops] == [
        "RandomResizedCropAndInterpolation", "RandomHorizontalFlip", "ColorJitter", "ConvertImageDtype", "Normalize"]
    assert "RandomResizedCropAndInterpolation: dynamic" in repr(hybrid)
    ds = dlstore.open_dataset(store, transform=hybrid)
    # the store is variable-shape: timm's crop (which fixes the size) runs per sample; the flip per
    # batch, the jitter per sample inside the batch, ConvertImageDtype + Normalize as one batch op.
    assert [type(t).__name__ for t in ds.per_sample_ops] == ["RandomResizedCropAndInterpolation"]
    assert [type(t).__name__ for t in ds.batch_ops] == ["BatchRandomHorizontalFlip", "PerSample", "BatchNormalize"]


def _seeded(seed: int) -> None:
    random.seed(seed)           # timm's RandomResizedCropAndInterpolation draws from Python's random
    torch.manual_seed(seed)     # torchvision's flip and colour jitter from torch's


def test_timm_per_sample_equals_timm(timm_store, varsize_folder):
    example, pipeline, hybrid, store = timm_store
    ds = dlstore.open_dataset(store, transform=hybrid)
    adapted = example.timm_for_dlstore(pipeline)
    for i in range(len(ds)):
        path = Path(ds.samples[i][0])
        path = path if path.is_absolute() else varsize_folder / path
        original = pil_loader(path)
        decoded = F.pil_to_tensor(original)
        assert torch.equal(ds.read(i), decoded)
        _seeded(i)
        got = ds[i][0]
        _seeded(i)
        want = adapted(decoded)
        # Exact: the same draws and the same kernels on the same decoded image.
        assert got.dtype == torch.float32 and torch.equal(got, want), i
        # timm's own pipeline on the PIL image draws the same crop, flip and jitter; only the
        # kernels differ (PIL's resize and enhancers vs torchvision's tensor ones).
        _seeded(i)
        timm_pil = pipeline(original)
        levels = (got - timm_pil).abs() * 0.229 * 255
        assert levels.mean() < 1.0 and levels.max() < 6, (i, float(levels.mean()), float(levels.max()))


def test_timm_loader_batches_are_reproducible(timm_store):
    # The batch path's pixels are held to timm's kernels in tests/fidelity/test_planned_paths.py
    # (its draws come from the loader's generator, not op by op from the global ones).
    example, pipeline, hybrid, store = timm_store
    ds = dlstore.open_dataset(store, transform=hybrid)
    epochs = []
    for _ in range(2):
        batches = dlstore.loader(ds, batch_size=len(ds), backend="dataloader", seed=3)
        epochs.append(next(iter(batches)))
    (images, labels), (again, _) = epochs
    assert torch.equal(images, again)
    assert labels.tolist() == ds.targets
    assert images.shape[1:] == (3, 32, 32) and -2.2 < images.min() and images.max() < 2.7


def test_timm_pipeline_split_as_given_equals_the_torchvision_reference(timm_store):
    # timm's MaybeToTensor passes a uint8 tensor through unscaled: split as given, the Normalize
    # after it once saw 0..255 (values up to ~1100). split_transforms must map it to ToDtype(scale=True).
    example, pipeline, _, store = timm_store
    as_given = dlstore.open_dataset(store, transform=dlstore.split_transforms(pipeline))
    reference = dlstore.open_dataset(store, transform=dlstore.split_transforms(example.timm_for_dlstore(pipeline)))
    _seeded(3)
    got, _ = as_given.get_batch(list(range(len(as_given))))
    _seeded(3)
    want, _ = reference.get_batch(list(range(len(reference))))
    assert torch.equal(got, want)
    assert got.max() < 2.7     # (1 - 0.406) / 0.225: the largest normalised value


def _seed_all(seed: int) -> None:
    random.seed(seed)           # timm's crop interpolation, RandAugment and RandomErasing draw from Python's random,
    np.random.seed(seed)        # some of timm's ops from numpy's,
    torch.manual_seed(seed)     # torchvision's flip and timm's pixel-mode erasing from torch's


def test_timm_train_py_default_with_rand_augment_equals_timm_on_its_pil_image(timm_store, varsize_folder):
    """train.py's --train-interpolation random --aa rand-m9-mstd0.5 --reprob 0.25 --remode pixel,
    assigned as create_loader assigns it: exactly timm's pipeline on timm's own decoded image.

    The crop (random interpolation) and RandAugment get a PIL image made from the stored sample,
    which on this store (no static op, raw) holds the decoded original: ImageFolder's pixels. The
    flip between them runs on the tensor (the same pixels as on PIL)."""
    import timm.data          # the timm_store fixture skips without timm

    _, _, _, store = timm_store
    pipeline = timm.data.create_transform(32, is_training=True, auto_augment="rand-m9-mstd0.5",
                                          interpolation="random", re_prob=0.25, re_mode="pixel")
    ds = dlstore.open_dataset(store)
    ds.transform = pipeline                    # what timm's create_loader does
    assert "RandAugment" in repr(ds) and "OnPIL" in repr(ds)
    reference = timm.data.create_dataset("", root=str(varsize_folder), split="", is_training=True)
    assert reference.reader.class_to_idx == ds.class_to_idx
    for i in range(len(ds)):
        path, target = reference.reader.samples[i]
        assert Path(path).name == Path(ds.samples[i][0]).name and target == ds.targets[i]
        image, _ = reference[i]                # timm's ImageDataset: the PIL image, no transform set
        _seed_all(i)
        got = ds[i][0]
        _seed_all(i)
        want = pipeline(image)
        assert got.dtype == torch.float32 and torch.equal(got, want), i


def test_timm_eval_static_from_the_pretrained_config(timm_store, varsize_folder, tmp_path):
    import timm.data

    example = timm_store[0]
    assert example.eval_static("resnet50") == "resize=235:bicubic,center_crop=224x224"   # 224 / 0.95
    assert example.eval_static("resnet50", use_test_size=True) == "resize=288:bicubic,center_crop=288x288"
    config = {"input_size": (3, 24, 24), "interpolation": "bicubic", "crop_pct": 0.875}
    spec = example.eval_static(config)
    assert spec == "resize=27:bicubic,center_crop=24x24"                                   # floor(24 / 0.875)
    with pytest.raises(ValueError, match="no pretrained config"):
        example.eval_static("no_such_model")
    # The eval store made with it reads back as timm's own eval path on timm's own dataset, bit for bit.
    store = dlstore.convert(varsize_folder, tmp_path / "val.shards", static=spec, workers=0, progress=False).path
    ds = dlstore.open_dataset(store)
    reference = timm.data.create_dataset("", root=str(varsize_folder), split="", is_training=False)
    loaders = []
    for dataset in (reference, ds):
        loaders.append(timm.data.create_loader(dataset, batch_size=4, is_training=False, use_prefetcher=False,
                                               num_workers=0, **example.data_config(config)))
    assert [type(op).__name__ for op in ds.already_applied] == ["Resize", "CenterCrop"]
    for (want, want_labels), (got, got_labels) in zip(*loaders):
        assert got.dtype == torch.float32 and torch.equal(got, want) and torch.equal(got_labels, want_labels)
    # another crop_pct (another model's config) on that store: refused, never resized again
    with pytest.raises(dlstore.StaticMismatchError):
        dlstore.open_dataset(store, transform=timm.data.create_transform(
            **example.data_config({**config, "crop_pct": 0.95}), is_training=False))


# --- Lightning ------------------------------------------------------------------------------

@pytest.mark.slow
def test_lightning_ddp_two_processes_read_disjoint_shares(tmp_path):
    pytest.importorskip("lightning", reason="Lightning is not installed (pip install -e '.[examples]')")
    n, n_val = 64, 32
    images, _ = cifar_like(n)
    labels = np.arange(n)                 # label = index: the labels a rank saw are the samples it read
    dlstore.convert((images, labels), tmp_path / "train.shards", workers=0, progress=False)
    dlstore.convert((images[:n_val], labels[:n_val]), tmp_path / "val.shards", workers=0, progress=False)
    record = tmp_path / "record"
    done = run_example("lightning_datamodule", str(tmp_path / "train.shards"), "--val", str(tmp_path / "val.shards"),
                       "--devices", "2", "--accelerator", "cpu", "--epochs", "2", "--batch-size", "8",
                       "--record", str(record))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((record / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    for epoch in range(2):
        shares = [r["train"][epoch] for r in ranks]
        assert [len(s) for s in shares] == [n // 2, n // 2]             # 4 steps of 8 on each rank
        assert not set(shares[0]) & set(shares[1])
        assert sorted(shares[0] + shares[1]) == list(range(n))         # together: every sample, once
    # Lightning forwards set_epoch to the loader's sampler: each epoch is a new shuffle.
    assert ranks[0]["train"][0] != ranks[0]["train"][1]
    val = [r["val"][-1] for r in ranks]
    assert not set(val[0]) & set(val[1]) and sorted(val[0] + val[1]) == list(range(n_val))


# --- every example explains itself ----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name, client", [("cifar10_gpu", None), ("timm_pipeline", "timm"),
                                          ("lightning_datamodule", "lightning")])
def test_example_help(name, client):
    if client:
        pytest.importorskip(client, reason=f"{client} is not installed (pip install -e '.[examples]')")
    done = run_example(name, "--help", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage:") and f"{name}.py" in done.stdout


# --- segmentation: images with masks --------------------------------------------------------

@pytest.mark.slow
def test_segmentation_example_learns_the_demo_shapes():
    """examples/segmentation.py trains its small FCN through dlstore.loader (joint crop + flip, the
    colour ops on the image only) to a validation mIoU of 0.86 in 3 epochs (seeded); the same run
    with the masks left unflipped by the gather reaches 0.69."""
    segmentation = load_example("segmentation")
    assert segmentation.main(["--epochs", "3", "--count", "60"]) > 0.8
