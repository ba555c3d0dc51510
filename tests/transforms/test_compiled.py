"""The compiled crop+flip kernel (numba, the ``fast`` extra) against torchvision, and its wiring.

Reference: torchvision's v2 ``pad`` (constant) -> ``crop`` -> ``horizontal_flip`` per
sample, on the same uint8 samples with the same parameters. The kernel writes through
raw addresses with bounds checks off, so the property test also fences ``out`` with
guard bytes: a write outside the batch would show there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchvision.transforms.v2 import functional as F

import dlstore
from dlstore.transforms import compiled

pytestmark = pytest.mark.skipif(not compiled.available(),
                                reason=f"compiled kernel: {compiled.unavailable_reason()}")


def reference(samples: np.ndarray, tops, lefts, flips, padding, fill, th, tw) -> np.ndarray:
    out = []
    for x, top, left, flip in zip(samples, tops, lefts, flips):
        img = F.pad(torch.from_numpy(x), list(padding), fill=fill)
        img = F.crop(img, int(top), int(left), th, tw)
        out.append(F.horizontal_flip(img) if flip else img)
    return torch.stack(out).numpy()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=st.sampled_from([1, 3, 4]), h=st.integers(1, 40), w=st.integers(1, 40), b=st.integers(1, 6),
       padding=st.tuples(*[st.integers(0, 6)] * 4), grow=st.tuples(st.integers(-8, 2), st.integers(-8, 2)),
       same_width=st.booleans(), fill=st.integers(0, 255), flips=st.sampled_from(["none", "all", "some"]),
       seed=st.integers(0, 2**32 - 1))
def test_crop_flip_equals_torchvision(c, h, w, b, padding, grow, same_width, fill, flips, seed):
    """Any size, asymmetric padding, windows partly or wholly in the padding; ``same_width``
    makes the output as wide as the image, the kernel's one-memcpy path for unflipped samples."""
    rng = np.random.default_rng(seed)
    left, top, right, bottom = padding
    ph, pw = h + top + bottom, w + left + right
    th = max(1, min(ph, h + grow[0]))
    tw = w if same_width else max(1, min(pw, w + grow[1]))
    pool = rng.integers(0, 256, (b + 3, c, h, w), dtype=np.uint8)
    idx = rng.integers(0, len(pool), b)
    tops, lefts = rng.integers(0, ph - th + 1, b), rng.integers(0, pw - tw + 1, b)
    fl = {"none": np.zeros(b, bool), "all": np.ones(b, bool), "some": rng.random(b) < 0.5}[flips]
    guard = 64
    buf = rng.integers(0, 256, b * c * th * tw + 2 * guard, dtype=np.uint8)
    before = buf.copy()
    out = buf[guard:guard + b * c * th * tw].reshape(b, c, th, tw)
    got = compiled.crop_flip([pool[i] for i in idx], out, tops, lefts, fl, padding, fill)
    assert got is out
    np.testing.assert_array_equal(out, reference(pool[idx], tops, lefts, fl, padding, fill, th, tw))
    np.testing.assert_array_equal(buf[:guard], before[:guard])
    np.testing.assert_array_equal(buf[-guard:], before[-guard:])



@settings(max_examples=200, deadline=None)
@given(c=st.integers(1, 3), h=st.integers(1, 5), w=st.integers(1, 150), b=st.integers(1, 4),
       padding=st.tuples(st.integers(0, 100), st.integers(0, 3), st.integers(0, 100), st.integers(0, 3)),
       fill=st.integers(0, 255), seed=st.integers(0, 2**32 - 1))
def test_full_width_strips_of_every_length_equal_torchvision(c, h, w, b, padding, fill, seed):
    """Unflipped crops as wide as the image, shifted by 0-100 columns: the strips of padding filled
    after the one memcpy take every length from 1 to past 64 bytes (each store width, and the loop)."""
    rng = np.random.default_rng(seed)
    left, top, right, bottom = padding
    x = rng.integers(0, 256, (b, c, h, w), dtype=np.uint8)
    tops = rng.integers(0, h + top + bottom - h + 1, b)
    lefts = rng.integers(0, left + right + 1, b)
    guard = 64
    buf = rng.integers(0, 256, b * c * h * w + 2 * guard, dtype=np.uint8)
    before = buf.copy()
    out = buf[guard:guard + b * c * h * w].reshape(b, c, h, w)
    compiled.crop_flip(list(x), out, tops, lefts, np.zeros(b, bool), padding, fill)
    np.testing.assert_array_equal(out, reference(x, tops, lefts, np.zeros(b, bool), padding, fill, h, w))
    np.testing.assert_array_equal(buf[:guard], before[:guard])
    np.testing.assert_array_equal(buf[-guard:], before[-guard:])

def test_imagenet_sized_batch_equals_torchvision():
    """224x224, padding 4, the loader benchmark's case: every sample padded, half flipped."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (16, 3, 224, 224), dtype=np.uint8)
    tops, lefts, fl = rng.integers(0, 9, 16), rng.integers(0, 9, 16), rng.random(16) < 0.5
    out = np.empty_like(x)
    compiled.crop_flip(list(x), out, tops, lefts, fl, (4, 4, 4, 4), 0)
    np.testing.assert_array_equal(out, reference(x, tops, lefts, fl, (4, 4, 4, 4), 0, 224, 224))


def test_bad_arguments_are_refused_naming_the_problem():
    x = np.zeros((2, 3, 5, 5), np.uint8)
    out = np.empty((2, 3, 5, 5), np.uint8)
    z, f = np.zeros(2, np.int64), np.zeros(2, bool)
    with pytest.raises(ValueError, match="sample 1: .*C-contiguous uint8"):
        compiled.crop_flip([x[0], x[1][:, :, ::-1]], out, z, z, f, (0, 0, 0, 0), 0)
    with pytest.raises(ValueError, match="sample 1: .*float32"):
        compiled.crop_flip([x[0], x[1].astype(np.float32)], out, z, z, f, (0, 0, 0, 0), 0)
    with pytest.raises(ValueError, match="out must be a C-contiguous uint8"):
        compiled.crop_flip(list(x), out.astype(np.int16), z, z, f, (0, 0, 0, 0), 0)
    with pytest.raises(ValueError, match="out must be"):
        compiled.crop_flip(list(x), out[:, :, :, ::-1], z, z, f, (0, 0, 0, 0), 0)
    with pytest.raises(ValueError, match="fill must be 0-255"):
        compiled.crop_flip(list(x), out, z, z, f, (0, 0, 0, 0), 256)
    with pytest.raises(ValueError, match="2 samples but 1 tops"):
        compiled.crop_flip(list(x), out, z[:1], z, f, (0, 0, 0, 0), 0)
    with pytest.raises(ValueError, match="out has 3 channels, the samples 1"):
        compiled.crop_flip([x[0, :1].copy(), x[1, :1].copy()], out, z, z, f, (0, 0, 0, 0), 0)


def _store(tmp_path, fmt: str, n: int = 40, **options) -> tuple:
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (n, 13, 17, 3), dtype=np.uint8)
    path = tmp_path / f"s.{fmt}"
    dlstore.convert((images, np.arange(n) % 3), path, progress=False, workers=0, **options)
    return path, torch.from_numpy(images).permute(0, 3, 1, 2).numpy()


def _spy(monkeypatch) -> dict:
    """Count the kernel entry points get_batch calls (they still run: a spy, not a stub)."""
    calls = {"crop_flip": 0, "crop_flip_at": 0}
    for name in calls:
        real = getattr(compiled, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(compiled, name, spy)
    return calls


@pytest.mark.parametrize("fmt,options,path_taken", [
    ("shards", {"shard_size": 7}, "crop_flip_at"),     # in place, across 6 files
    ("lmdb", {}, "crop_flip_at"),                      # in place: values read from a map of data.mdb
    ("hdf5", {}, "crop_flip_at"),                      # in place: one uncompressed chunk per sample
    ("hdf5", {"compression": "lzf"}, "crop_flip"),     # natively: h5py decodes each chunk, then the crop
])
def test_get_batch_takes_the_compiled_kernel_and_gives_torchvision_pixels(tmp_path, monkeypatch, fmt, options,
                                                                           path_taken):
    from torchvision.transforms import v2
    path, chw = _store(tmp_path, fmt, **options)
    ds = dlstore.open_dataset(path, transform=v2.Compose([v2.RandomCrop((11, 17), padding=[3, 1, 2, 0], fill=9),
                                                          v2.RandomHorizontalFlip()]))
    calls = _spy(monkeypatch)
    monkeypatch.setenv("DLSTORE_COMPILED", "1")
    idx = [39, 0, 6, 7, 13, 14, 30, 30, 2]
    got, labels = ds.get_batch(idx, generator=torch.Generator().manual_seed(3))
    # crop_flip (views from get_many) ends in crop_flip_at; the in-place path calls only the latter
    assert calls == {"crop_flip": int(path_taken == "crop_flip"), "crop_flip_at": 1}
    g = torch.Generator().manual_seed(3)     # the draws get_batch made: crop's, then flip's
    params = ds.batch_path.crop.sample((len(idx), 3, 13, 17), generator=g)
    flips = ds.batch_path.flip.sample((len(idx),), generator=g)["flip"].numpy()
    ref = reference(chw[idx], params["top"].numpy(), params["left"].numpy(), flips, (3, 1, 2, 0), 9, 11, 17)
    np.testing.assert_array_equal(got.numpy(), ref)
    assert labels.tolist() == [i % 3 for i in idx]


def test_shards_with_per_sample_sums_read_through_get_many(tmp_path, monkeypatch):
    """check="sample" hashes every sample read: the in-place path would skip that, so it is not taken."""
    from torchvision.transforms import v2
    path, _ = _store(tmp_path, "shards")
    ds = dlstore.open_dataset(path, check="sample",
                              transform=v2.Compose([v2.RandomCrop(13, padding=2), v2.RandomHorizontalFlip()]))
    calls = _spy(monkeypatch)
    ds.get_batch([1, 2, 3], generator=torch.Generator().manual_seed(0))
    assert calls == {"crop_flip": 1, "crop_flip_at": 1}


def test_environment_switch_selects_the_pure_kernel(tmp_path, monkeypatch):
    from torchvision.transforms import v2
    path, _ = _store(tmp_path, "shards")
    ds = dlstore.open_dataset(path, transform=v2.Compose([v2.RandomCrop(13, padding=2), v2.RandomHorizontalFlip()]))
    calls = _spy(monkeypatch)
    idx = list(range(20))
    fast, _ = ds.get_batch(idx, generator=torch.Generator().manual_seed(5))
    monkeypatch.setenv("DLSTORE_COMPILED", "0")
    assert not compiled.available() and "DLSTORE_COMPILED=0" in compiled.unavailable_reason()
    pure, _ = ds.get_batch(idx, generator=torch.Generator().manual_seed(5))
    assert calls == {"crop_flip": 0, "crop_flip_at": 1}
    assert torch.equal(fast, pure)


def test_threads_calling_the_kernel_at_once_get_their_own_pixels(tmp_path):
    """The kernel releases the GIL for the whole batch; 4 threads x 30 batches each equal one thread's."""
    from torchvision.transforms import v2
    path, _ = _store(tmp_path, "shards", n=64, shard_size=16)
    ds = dlstore.open_dataset(path, transform=v2.Compose([v2.RandomCrop(15, padding=3), v2.RandomHorizontalFlip()]))
    jobs = [(np.random.default_rng(k).permutation(64)[:32], k) for k in range(120)]
    expected = [ds.get_batch(i, generator=torch.Generator().manual_seed(s))[0] for i, s in jobs]
    got: dict = {}

    def work(part: int) -> None:
        for k in range(part, len(jobs), 4):
            i, s = jobs[k]
            got[k] = ds.get_batch(i, generator=torch.Generator().manual_seed(s))[0]
    threads = [threading.Thread(target=work, args=(p,)) for p in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(got[k], expected[k]) for k in range(len(jobs)))


def test_without_numba_the_pure_path_runs(tmp_path):
    """numba not importable (a floor install): available() says why, get_batch still gives the same pixels."""
    from torchvision.transforms import v2
    path, _ = _store(tmp_path, "shards")
    ds = dlstore.open_dataset(path, transform=v2.Compose([v2.RandomCrop(13, padding=2), v2.RandomHorizontalFlip()]))
    fast, _ = ds.get_batch(list(range(30)), generator=torch.Generator().manual_seed(2))
    np.save(tmp_path / "fast.npy", fast.numpy())
    script = textwrap.dedent(f"""
        import sys
        sys.modules["numba"] = None          # import numba -> ImportError
        import numpy as np, torch
        from torchvision.transforms import v2
        import dlstore
        from dlstore.transforms import compiled
        assert not compiled.available()
        print(compiled.unavailable_reason())
        ds = dlstore.open_dataset({str(path)!r}, transform=v2.Compose(
            [v2.RandomCrop(13, padding=2), v2.RandomHorizontalFlip()]))
        got, _ = ds.get_batch(list(range(30)), generator=torch.Generator().manual_seed(2))
        assert np.array_equal(got.numpy(), np.load({str(tmp_path / "fast.npy")!r}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "DLSTORE_COMPILED"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "numba is not importable" in done.stdout and "dlstore[fast]" in done.stdout


def test_read_only_install_without_a_cache_directory_still_compiles(tmp_path):
    """numba caches the kernel beside its source, else under ~/.cache; with neither writable (a
    read-only image and HOME) ``cache=True`` fails at definition: the kernel is then compiled in
    each process, not switched off (it was: "numba is not importable ... no locator available")."""
    import shutil

    package = tmp_path / "ro"
    shutil.copytree(Path(dlstore.__file__).parent, package / "dlstore",
                    ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"))
    home = tmp_path / "home"
    home.mkdir()
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(f"""
        import sys, warnings
        sys.path.insert(0, {str(package)!r})
        import numpy as np
        import dlstore
        from dlstore.transforms import compiled
        assert dlstore.__file__.startswith({str(package)!r}), dlstore.__file__
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            available = compiled.available()
        assert available, compiled.unavailable_reason()
        ours = [str(w.message) for w in caught if "dlstore" in str(w.message)]
        assert not ours, ours                   # no warning from dlstore either: nothing is wrong
        x = np.arange(2 * 3 * 5 * 7, dtype=np.uint8).reshape(2, 3, 5, 7)
        out = np.empty_like(x)
        compiled.crop_flip(list(x), out, np.zeros(2, np.int64), np.zeros(2, np.int64), np.array([True, False]),
                           (0, 0, 0, 0), 0)
        assert np.array_equal(out[0], x[0, :, :, ::-1]) and np.array_equal(out[1], x[1])
        print("ok")
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "DLSTORE_", "XDG_"))}
    env["HOME"] = str(home)
    cmd = (f"mount --bind {package} {package} && mount -o remount,bind,ro {package} && "
           f"mount --bind {home} {home} && mount -o remount,bind,ro {home} && exec {sys.executable} {script}")
    done = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=300,
                          env=env, check=False)
    if done.returncode != 0 and ("mount" in done.stderr or "unshare" in done.stderr):
        pytest.skip(f"cannot make a read-only mount here (needs root): {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")
