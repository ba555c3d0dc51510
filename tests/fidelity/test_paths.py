"""Every read path gives torchvision's pixels for the parameters it drew (see fidelity_harness).

Reference: torchvision's v2 functional kernels per sample on the stored uint8
sample, with parameters torchvision can draw, then the GPU dataset's conversion
if any: for a path that draws its own, the parameters are recovered from its
output by trying every one torchvision can draw (``fidelity_harness.recover``);
for a batch op's kernel, they are drawn by torchvision's own transforms
(``tv_draw``) and given to its ``apply``. The ops are the pipeline as the user
wrote it (torchvision's transforms), never dlstore's mapping of it.

Path x op matrix (what these tests assert)::

                          Batch*  get_batch (shards,  dlstore.loader          GPU loader, device="cpu"          CUDA
                          on CPU  lmdb, hdf5)         in    2     2 w   2 w   uint8  fp16   fp16 held  stream  (GPU
                                  windows   loop      proc  thr   fork  spawn        held   as uint8           only)
  RandomCrop int padding    E       E        E        E     E     .     .     E      E      E          E       E
  RandomCrop [lr, tb]       E       E        E        E     E     .     .     E      E      E          E       E
  RandomCrop 4, asymmetric  E       E        E        E     E     E     E     E      E      E          E       E
  RandomCrop fill / per-ch  E       E        E        E     E     E     .     E      E      E          E       E
  edge/reflect/symmetric    E       E        E        E     E     E     .     E      E      E          E       E
  pad_if_needed (1 px too)  E       E        E        E     E     E     .     E      E      E          E       E
  HorizontalFlip p 0/.5/1   E       E        E        E     E     E     E     E      E      E          E       E
  asym crop + flip (bug 1)  E       E        E        E     E     E     E     E      E      E          E       E
  RandomResizedCrop         E       E        E        E     E     E     .     E      B1     E          E       B2
  BatchCutout (F.erase)     E       E        E        E     E     E     .     E      E      E          E       E
  RandomErasing (per smpl)  -       E        E        -     -     -     -     E      R      E          E       E
  ToDtype + Normalize       E       E        E        E     E     E     E     E      R      R          R       E

  E   exact: uint8 identical; float32 identical to torchvision's float32; float16 the float32
      reference rounded once (d <= 2**-11 |ref| + 2**-25, checked, and == ref.to(float16)).
  B1  bounded: resamples the converted fp16 values instead of uint8 pixels:
      d <= 1.05 / (255 min(std)) + 2**-10 max|ref| + 1e-5 (0.021 for ImageNet's mean/std;
      measured 0.018).
  B2  bounded: batched float32 resampling rounded as torchvision rounds on CUDA: uint8 within
      1 level of torchvision's CPU kernel; fp16 as B1.
  R   refused: TransformSpecError naming the op (a per-sample torchvision op cannot see
      pixels on data held converted; a Normalize on a dataset that already normalises).
  -   not applicable (no batch op; per-sample ops draw from torch's global generator there).
  .   not run separately: the same get_batch as the neighbouring columns; the worker columns
      change only where it runs and where its generator comes from (7 cases fork, 1 spawn).
  in proc: the DataLoader in this process (threads=0); 2 thr: dlstore's thread pool.
  get_batch's columns hold for a third kernel too, the compiled one-pass crop/flip (numba, the
  `fast` extra, the default where numba imports; skipped without it), on every format and in
  forked workers.
  CUDA: the same tests parametrised with device="cuda"; they run only where a GPU is present.

The device path, ``dlstore.loader(..., device=D)`` (host stage in threads / workers, the float
tail on D), is held to the same reference in test_device_path.py: E on every torchvision row
above (in proc, 2 threads, 2 forked workers; D = "cpu", and "cuda" where present), float16 and
bfloat16 the float32 reference rounded once; and equal to the same loader with device=None.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from fidelity_harness import (
    CUDA_RRC_LEVELS,
    FP16_REL,
    assert_same,
    check_path,
    convert,
    gen,
    hw_ok,
    make_store,
    ops_of,
    reference,
    rrc_bound,
    tv_draw,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchvision.transforms import v2

import dlstore
import dlstore.data.batch_path as dataset_module
from dlstore.errors import TransformSpecError
from dlstore.transforms import (
    BatchCompose,
    BatchCutout,
    BatchNormalize,
    BatchRandomCrop,
    BatchRandomHorizontalFlip,
    BatchRandomResizedCrop,
    compiled,
)
from dlstore.transforms.functional import crop_flip_loop, crop_flip_windows

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
H, W = 13, 11          # the stores' sample size: odd, not square
FORMATS = ["shards", "lmdb", "hdf5"]
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# The fused crop/flip gather kernels: numba's one-pass (the `fast` extra; the default where numba
# imports), and the pure ones: vectorised windows (small images) and the per-sample loop.
KERNELS = ["compiled", "windows", "loop"]


@contextlib.contextmanager
def kernel_selected(kernel: str):
    """Make get_batch take ``kernel`` (skips "compiled" where numba is not installed)."""
    if kernel == "compiled" and not compiled.available():
        pytest.skip(f"compiled kernel: {compiled.unavailable_reason()}")
    old_env, old_max = os.environ.get("DLSTORE_COMPILED"), dataset_module.VECTORISED_MAX_PIXELS
    os.environ["DLSTORE_COMPILED"] = "1" if kernel == "compiled" else "0"
    if kernel == "loop":
        dataset_module.VECTORISED_MAX_PIXELS = 0
    try:
        yield
    finally:
        dataset_module.VECTORISED_MAX_PIXELS = old_max
        if old_env is None:
            del os.environ["DLSTORE_COMPILED"]
        else:
            os.environ["DLSTORE_COMPILED"] = old_env


# One row of the matrix each: torchvision ops (what users write), or dlstore batch ops where
# torchvision has no per-batch counterpart (cutout). Sizes refer to the 13x11 stores.
CASES = {
    "crop-int-padding": [v2.RandomCrop(9, padding=3)],
    "crop-2-padding": [v2.RandomCrop((10, 12), padding=[2, 5])],
    "crop-4-padding-asym": [v2.RandomCrop((13, 11), padding=[4, 0, 1, 2])],
    "crop-fill": [v2.RandomCrop(11, padding=[3, 1, 0, 2], fill=77)],
    "crop-fill-per-channel": [v2.RandomCrop(11, padding=2, fill=[10, 200, 30])],
    "crop-edge": [v2.RandomCrop(12, padding=[1, 2, 3, 0], padding_mode="edge")],
    "crop-reflect": [v2.RandomCrop(10, padding=[2, 3], padding_mode="reflect")],
    "crop-symmetric": [v2.RandomCrop(9, padding=[0, 1, 4, 2], padding_mode="symmetric")],
    "crop-pad-if-needed": [v2.RandomCrop((16, 15), padding=1, pad_if_needed=True, fill=5)],
    "flip-p0": [v2.RandomHorizontalFlip(0.0)],
    "flip-p0.5": [v2.RandomHorizontalFlip(0.5)],
    "flip-p1": [v2.RandomHorizontalFlip(1.0)],
    "crop-asym+flip": [v2.RandomCrop((13, 11), padding=[4, 0, 0, 0]), v2.RandomHorizontalFlip(1.0)],
    "crop-asym+flip-p0.5": [v2.RandomCrop(9, padding=[1, 2, 5, 0], fill=3), v2.RandomHorizontalFlip(0.5)],
    "resized-crop": [v2.RandomResizedCrop(8, scale=(0.2, 1.0))],
    "resized-crop-up-noaa": [v2.RandomResizedCrop((15, 17), antialias=False)],
    "cutout": BatchCutout(5, fill=0),
    "cutout-fill": BatchCutout(4, fill=(255, 128, 0)),
    "random-erasing": [v2.RandomErasing(p=1.0, value=0)],
    "todtype+normalize": [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)],
    "pipeline": [v2.RandomCrop(11, padding=[3, 0, 1, 2]), v2.RandomHorizontalFlip(), v2.ToImage(),
                 v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)],
}


def _torchvision(case: str) -> bool:
    return isinstance(CASES[case], list)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("fidelity")
    made: dict = {}

    def get(fmt: str = "shards", size: tuple[int, int] = (H, W)):
        if (fmt, size) not in made:
            made[fmt, size] = make_store(root, fmt, size)
        return made[fmt, size]

    return get


@pytest.fixture(scope="module")
def raw(stores):
    return dlstore.open_dataset(stores()).read_batch(range(12))[0]


def _open(path, case: str):
    """The store opened with the case's transform, as users would: a torchvision pipeline
    (mapped to batch ops by ``batch_plan``) or ``batch_transform=`` for dlstore batch ops."""
    t = CASES[case]
    if _torchvision(case):
        return dlstore.open_dataset(path, transform=v2.Compose(t))
    return dlstore.open_dataset(path, batch_transform=t)


def _reference_ops(case: str) -> list:
    """The case's ops as the user wrote them: its torchvision pipeline, or dlstore batch ops."""
    return list(CASES[case]) if _torchvision(case) else ops_of(CASES[case])


# --- Batch* on CPU: any size, batch, padding and seed -----------------------------------------

def _crop_strategy(h: int, w: int):
    padding = st.one_of(st.integers(0, 4), st.lists(st.integers(0, 4), min_size=2, max_size=2),
                        st.lists(st.integers(0, 5), min_size=4, max_size=4))
    fill = st.one_of(st.integers(0, 255), st.tuples(st.integers(0, 255), st.integers(0, 255), st.integers(0, 255)))
    return st.builds(
        lambda size, padding, pad_if_needed, fill, mode: BatchRandomCrop(
            size, padding=padding, pad_if_needed=pad_if_needed,
            fill=fill if mode == "constant" else 0, padding_mode=mode),
        st.tuples(st.integers(1, h + 6), st.integers(1, w + 6)), padding, st.booleans(), fill,
        st.sampled_from(["constant", "constant", "edge", "reflect", "symmetric"]))


def _op_strategy(h: int, w: int):
    bigger = st.builds(lambda dy, dx, padding, fill: BatchRandomCrop((h + dy, w + dx), padding=padding,
                                                                     pad_if_needed=True, fill=fill),
                       st.integers(0, 5), st.integers(0, 5), st.integers(0, 2), st.integers(0, 255))
    return st.one_of(
        _crop_strategy(h, w),
        bigger,                      # larger than the (padded) image: pad_if_needed pads both sides
        st.builds(BatchRandomHorizontalFlip, st.sampled_from([0.0, 0.5, 1.0])),
        st.builds(lambda size, lo, aa: BatchRandomResizedCrop(size, scale=(lo, 1.0), antialias=aa),
                  st.tuples(st.integers(1, 20), st.integers(1, 20)), st.sampled_from([0.05, 0.3, 0.9]),
                  st.booleans()),
        st.builds(lambda s, fill: BatchCutout(s, fill=fill), st.integers(1, max(1, min(h, w))),
                  st.sampled_from([0, 255, (1, 2, 3)])),
    )


@st.composite
def _batch_case(draw_):
    h, w = draw_(st.sampled_from([1, 2, 7, 13, 24])), draw_(st.sampled_from([1, 3, 11, 16, 31]))
    b = draw_(st.integers(1, 9))
    ops = []
    shape = (b, 3, h, w)
    for _ in range(draw_(st.integers(1, 3))):
        op = draw_(_op_strategy(shape[2], shape[3]))
        if not hw_ok(op, shape[2], shape[3]):
            continue
        ops.append(op)
        if hasattr(op, "output_size"):
            shape = (b, 3, *op.output_size(shape[2], shape[3]))
    if draw_(st.booleans()):
        ops.append(BatchNormalize(MEAN, STD, dtype=draw_(st.sampled_from([torch.float32, torch.float16]))))
    return torch.randint(0, 256, (b, 3, h, w), generator=gen(h * 1000 + w * 10 + b), dtype=torch.uint8), \
        ops, draw_(st.integers(0, 2**31))


@settings(SETTINGS, max_examples=50)
@given(_batch_case())
def test_batch_transforms_on_cpu_equal_torchvision(case):
    """Each op's kernel (``apply``) on parameters torchvision's own transforms drew."""
    x, ops, seed = case
    params = tv_draw(ops, x.shape, seed)
    got = x
    for op, p in zip(ops, params):
        got = op.apply(got, p)
    assert_same(got, reference(ops, params, x), what=repr(ops))


@SETTINGS
@given(h=st.sampled_from([1, 2, 5, 13, 16]), w=st.sampled_from([1, 3, 11, 16]), b=st.integers(1, 8),
       padding=st.lists(st.integers(0, 5), min_size=4, max_size=4), grow=st.tuples(st.integers(-4, 3), st.integers(-4, 3)),
       fill=st.integers(0, 255), flips=st.sampled_from(["none", "all", "some"]), seed=st.integers(0, 2**31))
def test_fused_crop_flip_kernels_equal_torchvision(h, w, b, padding, grow, fill, flips, seed):
    """Both gather kernels, fed straight from an array: any size (1 pixel included), asymmetric padding."""
    left, top, right, bottom = padding
    th = max(1, min(h + top + bottom, h + grow[0]))
    tw = max(1, min(w + left + right, w + grow[1]))
    x = torch.randint(0, 256, (b, 3, h, w), generator=gen(seed), dtype=torch.uint8)
    crop = BatchRandomCrop((th, tw), padding=padding, fill=fill)
    p_crop, = tv_draw([crop], x.shape, seed)
    p_flip = {"flip": {"none": torch.zeros(b, dtype=torch.bool), "all": torch.ones(b, dtype=torch.bool),
                       "some": torch.rand(b, generator=gen(seed + 1)) < 0.5}[flips]}
    flip = BatchRandomHorizontalFlip()
    ref = reference([crop, flip], [p_crop, p_flip], x)
    tops, lefts, fl = p_crop["top"].numpy(), p_crop["left"].numpy(), p_flip["flip"].numpy()
    idx = torch.randperm(b, generator=gen(seed)).numpy()   # gathered out of order, as a shuffled batch is
    a = x.numpy()
    ref = ref[torch.from_numpy(idx)]
    tops, lefts, fl = tops[idx], lefts[idx], fl[idx]
    windows, _ = crop_flip_windows(a[idx[~fl]] if (~fl).any() else None, a[idx[fl]] if fl.any() else None,
                                   (3, h, w), (th, tw), tops, lefts, fl, crop.padding, fill)
    assert_same(windows, ref, what="crop_flip_windows")
    out = torch.empty((b, 3, th, tw), dtype=torch.uint8)
    crop_flip_loop((a[i] for i in idx), out.numpy(), tops, lefts, fl, crop.padding, fill)
    assert_same(out, ref, what="crop_flip_loop")
    if compiled.available():
        out = torch.empty((b, 3, th, tw), dtype=torch.uint8)
        compiled.crop_flip([a[i] for i in idx], out.numpy(), tops, lefts, fl, crop.padding, fill)
        assert_same(out, ref, what="compiled.crop_flip")


# --- StoreDataset.get_batch: the fused gather on every format, vectorised and loop --------------

@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(CASES))
def test_get_batch_on_every_format_equals_torchvision(stores, case, fmt, kernel):
    ds = _open(stores(fmt), case)
    idx = [5, 0, 11, 7, 7, 2, 9]
    raw_batch, labels = ds.read_batch(idx)
    for seed in (0, 1):
        torch.manual_seed(seed)       # per-sample torchvision ops draw from torch's global generator
        with kernel_selected(kernel):
            got, got_labels = ds.get_batch(idx, generator=gen(seed))
            torch.manual_seed(seed)
            again, _ = ds.get_batch(idx, generator=gen(seed))
        check_path(_reference_ops(case), raw_batch, got, what=f"{case} {fmt} {kernel} seed {seed}")
        assert torch.equal(got, again)          # the same generators, the same batch
        assert torch.equal(got_labels, labels)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("size,crop", [((1, 1), (3, 3)), ((1, 1), (1, 1)), ((2, 7), (5, 4))])
def test_get_batch_tiny_images_pad_if_needed(stores, size, crop, kernel):
    """1-pixel and thin images, smaller than the crop: pad_if_needed pads both sides, as torchvision."""
    path = stores("shards", size)
    ops = [v2.RandomCrop(crop, padding=[0, 1, 0, 0], pad_if_needed=True, fill=9), v2.RandomHorizontalFlip()]
    ds = dlstore.open_dataset(path, transform=v2.Compose(ops))
    assert ds.batch_path.crop is not None and ds.batch_path.flip is not None
    idx = list(range(12))
    raw_batch, _ = ds.read_batch(idx)
    for seed in range(3):
        with kernel_selected(kernel):
            got, _ = ds.get_batch(idx, generator=gen(seed))
        check_path(ops, raw_batch, got, what=f"{size} crop {crop} {kernel} seed {seed}")


@settings(max_examples=15, deadline=None, derandomize=True)
@given(padding=st.lists(st.integers(0, 4), min_size=4, max_size=4), p=st.sampled_from([0.0, 0.5, 1.0]),
       grow=st.tuples(st.integers(-5, 3), st.integers(-5, 3)), fill=st.integers(0, 255),
       idx=st.lists(st.integers(0, 11), min_size=1, max_size=12), seed=st.integers(0, 2**31),
       kernel=st.sampled_from(KERNELS if compiled.available() else KERNELS[1:]),
       fmt=st.sampled_from(FORMATS))
def test_get_batch_any_padding_and_batch(stores, padding, p, grow, fill, idx, seed, kernel, fmt):
    left, top, right, bottom = padding
    th, tw = max(1, min(H + top + bottom, H + grow[0])), max(1, min(W + left + right, W + grow[1]))
    ops = [v2.RandomCrop((th, tw), padding=padding, fill=fill), v2.RandomHorizontalFlip(p)]
    ds = dlstore.open_dataset(stores(fmt), transform=v2.Compose(ops))
    with kernel_selected(kernel):        # hypothesis: no function-scoped monkeypatch
        got, _ = ds.get_batch(idx, generator=gen(seed))
    raw_batch, _ = ds.read_batch(idx)
    check_path(ops, raw_batch, got)


# --- dlstore.loader: in process, forked and spawned workers ------------------------------------



def _check_loader(case: str, ds, batch_size: int, seed: int, *, workers: int = 0, threads: int = 0, context=None,
                  backend: str = "auto") -> None:
    n = len(ds)
    bounds = [(s, min(s + batch_size, n)) for s in range(0, n, batch_size)]
    raw_all, labels_all = ds.read_batch(range(n))
    options = {"num_threads": threads} if threads else {}
    loader = dlstore.loader(ds, batch_size, num_workers=workers, generator=gen(seed), multiprocessing_context=context,
                            backend=backend, **options)
    ring = loader.backend == "ring"
    assert ring == (workers > 0 and backend != "dataloader")   # the ring is the default for workers
    batches = list(loader)
    assert len(batches) == len(bounds)
    for (s, e), (x, y) in zip(bounds, batches):
        check_path(_reference_ops(case), raw_all[s:e], x,
                   what=f"{case} batch {s}:{e}, {workers} workers ({loader.backend}), {threads} threads")
        assert torch.equal(y, labels_all[s:e])
    # documented: every back-end builds the threads' batches, whatever the thread or worker count
    one = list(dlstore.loader(ds, batch_size, generator=gen(seed), backend="threads", num_threads=1))
    assert all(torch.equal(x, x1) for (x, _), (x1, _) in zip(batches, one))


# RandomErasing runs per sample inside the batch, torchvision's own draws from the global generators
# seeded from the loader's generator (wrappers.PerSample): the same batches whatever the thread count
LOADER_CASES = list(CASES)
WORKER_CASES = ["crop-4-padding-asym", "crop-asym+flip-p0.5", "crop-pad-if-needed", "crop-symmetric",
                "resized-crop", "cutout-fill", "pipeline"]


@pytest.mark.parametrize("case", LOADER_CASES)
def test_loader_in_process_equals_torchvision(stores, case):
    _check_loader(case, _open(stores(), case), 5, seed=3)


@pytest.mark.parametrize("case", LOADER_CASES)
def test_loader_threads_equal_torchvision(stores, case):
    _check_loader(case, _open(stores("lmdb"), case), 5, seed=4, threads=2)


@pytest.mark.parametrize("backend", ["auto", "dataloader"], ids=["ring", "dataloader"])
@pytest.mark.parametrize("case,kernel", [(c, "windows") for c in WORKER_CASES]
                         + [("crop-asym+flip-p0.5", k) for k in ("loop", "compiled")]
                         + [("pipeline", k) for k in ("loop", "compiled")])
def test_loader_forked_workers_equal_torchvision(stores, case, kernel, backend):
    with kernel_selected(kernel):       # set before the fork: the workers inherit it
        _check_loader(case, _open(stores({"loop": "lmdb", "compiled": "hdf5"}.get(kernel, "shards")), case), 4,
                      seed=5, workers=2, context="fork", backend=backend)


@pytest.mark.slow
def test_loader_spawned_workers_equal_torchvision(stores):
    _check_loader("pipeline", _open(stores("hdf5"), "pipeline"), 6, seed=7, workers=2, context="spawn")


# --- the GPU loader: uint8 and fp16 residency, the uint8 fallback, stream mode -------------------

RESIDENCIES = {
    # name: GPUDataset options. Held / served: uint8 / uint8; fp16 / fp16 (normalised);
    # uint8 / fp16 (converted per batch); read from the store per batch / fp16
    "uint8": {"dtype": torch.uint8},
    "fp16": {"dtype": torch.float16, "normalize": (MEAN, STD)},
    "fp16-held-uint8": {"dtype": torch.float16, "normalize": (MEAN, STD), "max_memory": 6000, "on_overflow": "uint8"},
    "stream": {"dtype": torch.float16, "normalize": (MEAN, STD), "max_memory": 1000, "on_overflow": "stream"},
}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def gpu_sets(stores):
    made: dict = {}

    def get(residency: str, device: str):
        if (residency, device) not in made:
            made[residency, device] = dlstore.GPUDataset(stores(), device, chunk_size=5, **RESIDENCIES[residency])
        return made[residency, device]

    return get


def _refused(case: str, residency: str) -> bool:
    """What the GPU loader refuses, with a TransformSpecError naming the op: a per-sample
    torchvision op on data held converted, and a Normalize on a dataset that normalises."""
    ops = CASES[case] if _torchvision(case) else []
    normalises = any(type(t).__name__ == "Normalize" for t in ops)
    per_sample = any(type(t).__name__ == "RandomErasing" for t in ops)
    return (residency != "uint8" and normalises) or (residency == "fp16" and per_sample)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("residency", list(RESIDENCIES))
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_loader_equals_torchvision(gpu_sets, raw, case, residency, device):
    ds = gpu_sets(residency, device)
    transform = v2.Compose(CASES[case]) if _torchvision(case) else CASES[case]
    if _refused(case, residency):
        with pytest.raises(TransformSpecError, match="Normalize|RandomErasing"):
            ds.transform = transform
        return
    ds.transform = transform
    loader = dlstore.loader(ds, 5, seed=2)
    ops = _reference_ops(case)
    got = torch.cat([x for x, _ in loader])
    what = f"{case} {residency} {device}"

    def finish(x):
        return convert(x, ds.dtype, ds.normalize)

    resamples = any(isinstance(op, (BatchRandomResizedCrop, v2.RandomResizedCrop)) for op in ops)
    converted = ds.mode == "preload" and ds.dtype != torch.uint8     # resamples fp16 values, not pixels
    bound = None
    if resamples and ds.device.type == "cuda" and got.dtype == torch.uint8:
        bound = CUDA_RRC_LEVELS      # levels from torchvision's CPU kernel
    elif resamples and (converted or ds.device.type == "cuda"):
        bound = rrc_bound(STD, finish(raw))   # resampled values stay within the converted pixels' range
    check_path(ops, raw, got, finish=finish, bound=bound, what=what)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(residency=st.sampled_from(list(RESIDENCIES)), padding=st.lists(st.integers(0, 4), min_size=4, max_size=4),
       fill=st.integers(0, 255), p=st.sampled_from([0.0, 0.5, 1.0]), batch_size=st.integers(1, 12),
       seed=st.integers(0, 2**31), cutout=st.booleans())
def test_gpu_loader_any_padding_batch_and_seed(gpu_sets, raw, residency, padding, fill, p, batch_size, seed, cutout):
    ds = gpu_sets(residency, "cpu")
    ops = [BatchRandomCrop((H, W), padding=padding, fill=fill), BatchRandomHorizontalFlip(p)]
    if cutout:
        ops.append(BatchCutout(3, fill=255 - fill))
    ds.transform = BatchCompose(ops)
    loader = dlstore.loader(ds, batch_size, seed=seed)
    got = torch.cat([x for x, _ in loader])
    check_path(ops, raw, got, finish=lambda x: convert(x, ds.dtype, ds.normalize), what=residency)


def test_gpu_loader_takes_plain_modules_and_calls_generator_only_by_name(gpu_sets):
    """nn.Identity / nn.Sequential forward **kwargs: they must not get generator=."""
    ds = gpu_sets("uint8", "cpu")
    for t in (torch.nn.Identity(), torch.nn.Sequential(), torch.nn.Sequential(v2.RandomHorizontalFlip(1.0))):
        ds.transform = t
        x, _ = next(iter(dlstore.loader(ds, 8)))
        assert x.shape == (8, 3, H, W)
    seen = []

    def kw_only(images, **kwargs):
        seen.append(kwargs)
        return images

    ds.transform = kw_only
    next(iter(dlstore.loader(ds, 4)))
    assert seen == [{}]


def test_gpu_loader_random_crop_draws_per_sample(gpu_sets, raw):
    """A plain v2.RandomCrop(12) is mapped to a batch op: every sample its own offset."""
    ds = gpu_sets("uint8", "cpu")
    ds.transform = v2.RandomCrop((9, 7))
    x, _ = next(iter(dlstore.loader(ds, 12, seed=0)))
    offsets = set()
    for j in range(12):
        hits = [(t, l) for t in range(H - 9 + 1) for l in range(W - 7 + 1)
                if torch.equal(raw[j][:, t:t + 9, l:l + 7], x[j])]
        offsets.add(hits[0])
    assert len(offsets) >= 8


def test_fp16_residency_is_torchvision_float32_rounded_once(gpu_sets, raw):
    """A normalised fp16 GPUDataset holds torchvision's float32 ToDtype + Normalize of each stored
    sample, rounded once to float16: within the harness's FP16 bound, equal to the rounding, and
    the bound is reached on these samples (it is not loose)."""
    from torchvision.transforms.v2 import functional as F

    held = gpu_sets("fp16", "cpu").data
    ref = F.normalize(F.to_dtype(raw, torch.float32, scale=True), list(MEAN), list(STD))
    got = held[:len(raw)]
    assert got.dtype == torch.float16 and got.shape == ref.shape
    d = (got.double() - ref.double()).abs()
    assert bool((d <= FP16_REL * ref.double().abs() + 2.0 ** -25).all()), float(d.max())
    assert torch.equal(got, ref.to(torch.float16))
    assert float((d / ref.double().abs().clamp_min(2.0 ** -14)).max()) > 0.9 * FP16_REL
