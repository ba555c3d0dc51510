"""Colour modes: a source mixing grayscale and colour becomes RGB as ImageFolder's loader makes it,
a grayscale-only one keeps one channel, ``mode=`` converts every image, and a disagreement names
the item, the channel counts and the fix.

References are PIL's ``img.convert(mode)`` (16-bit grayscale scaled ``v >> 8`` first, dlstore's
documented conversion of such images) followed by the same static ops in torchvision v2.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

import dlstore
from dlstore.errors import ArgumentError, DecodeError, SourceError
from dlstore.sources import DatasetSource, pil_loader
from dlstore.sources.demo import synthetic_image
from dlstore.sources.items import to_image
from dlstore.transforms.static import parse_static, to_torchvision

STATIC = "resize=20,center_crop=16"
SUFFIX = {"shards": ".shards", "lmdb": ".lmdb", "hdf5": ".h5"}
# grayscale first: the source's first image alone would make the store one channel
MODES = ["L", "LA", "P", "RGBA", "CMYK", "I;16", "RGB", "L"]


def _image(mode: str, k: int) -> Image.Image:
    rgb = synthetic_image(k % 3, k, (30 + k, 26))
    if mode == "I;16":   # values over 255, which PIL's own conversion would clip
        return Image.fromarray(rgb[..., 0].astype(np.uint16) * 257 + k)
    if mode == "LA":
        return Image.fromarray(np.stack([rgb[..., 0], rgb[..., 1]], -1))
    if mode == "P":
        return Image.fromarray(rgb).quantize(32)
    return Image.fromarray(rgb).convert(mode)


def _reference(img: Image.Image, mode: str, static: str = STATIC) -> torch.Tensor:
    if img.mode == "I;16":
        img = Image.fromarray((np.asarray(img) >> 8).astype(np.uint8))
    return v2.Compose([*to_torchvision(parse_static(static)), v2.PILToTensor()])(img.convert(mode))


def _convert(src, dst, **kw):
    return dlstore.convert(src, dst, progress=False, workers=kw.pop("workers", 0), **kw)


def _write(root, modes):
    """Files of ``modes`` under ``root`` (TIFF keeps CMYK, PNG the others); their relative paths."""
    rels = []
    for k, mode in enumerate(modes):
        rel = f"{k:02d}_{mode.replace(';', '')}.{'tif' if mode == 'CMYK' else 'png'}"
        _image(mode, k).save(root / rel)
        rels.append(rel)
    return rels


class Pairs(torch.utils.data.Dataset):
    def __init__(self, images, targets):
        self.images, self.targets, self.reads = images, targets, 0

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        self.reads += 1
        return self.images[i], self.targets[i]


class HFStyle(torch.utils.data.Dataset):
    """Dict items ``{"image": PIL, "label": int}`` as a Hugging Face dataset yields, opened lazily from files."""

    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return {"image": Image.open(self.paths[i]), "label": i % 2}


@pytest.mark.parametrize("fmt", ["shards", "hdf5"])
@pytest.mark.parametrize("kind", ["dataset", "hf-dict", "csv"])
def test_mixed_modes_become_rgb_as_imagefolders_loader_makes_them(tmp_path, fmt, kind):
    if kind == "dataset":
        images = [_image(m, k) for k, m in enumerate(MODES)]
        src = Pairs(images, [k % 2 for k in range(len(MODES))])
    else:
        (tmp_path / "imgs").mkdir()
        rels = _write(tmp_path / "imgs", MODES)
        images = [Image.open(tmp_path / "imgs" / rel) for rel in rels]
        assert [im.mode for im in images] == MODES
        if kind == "hf-dict":
            src = HFStyle([tmp_path / "imgs" / rel for rel in rels])
        else:
            src = tmp_path / "imgs" / "list.csv"
            src.write_text("".join(f"{rel},{k % 2}\n" for k, rel in enumerate(rels)))
    dst = tmp_path / f"s{SUFFIX[fmt]}"
    _convert(src, dst, static=STATIC)
    store = dlstore.open_dataset(dst)
    assert store.shape == (3, 16, 16) and len(store) == len(MODES)
    for k, img in enumerate(images):
        assert torch.equal(store[k][0], _reference(img, "RGB")), (k, MODES[k])
    assert store.manifest["source"]["mode"] == "RGB" and store.manifest["source"]["mode_given"] is False


def test_a_mixed_dataset_is_read_up_to_its_first_colour_image_before_converting():
    ds = Pairs([_image(m, k) for k, m in enumerate(["L", "L", "RGB", "L", "L"])], [0] * 5)
    source = DatasetSource(ds)
    assert (source.mode, source.channels, ds.reads) == ("RGB", 3, 3)   # items 0, 1, 2; not 3, 4
    ds.reads = 0
    assert DatasetSource(ds, mode="L").mode == "L" and ds.reads == 1   # given: item 0 only (its target)


@pytest.mark.parametrize("kind", ["dataset", "csv"])
def test_a_grayscale_only_source_keeps_one_channel(tmp_path, kind):
    modes = ["L", "LA", "I;16", "L"]
    (tmp_path / "imgs").mkdir()
    rels = _write(tmp_path / "imgs", modes)
    if kind == "dataset":
        images = [_image(m, k) for k, m in enumerate(modes)]
        src = Pairs(images, [0] * len(modes))
    else:
        images = [Image.open(tmp_path / "imgs" / rel) for rel in rels]
        src = tmp_path / "imgs" / "list.csv"
        src.write_text("".join(f"{rel},0\n" for rel in rels))
    _convert(src, tmp_path / "g.shards", static=STATIC)
    store = dlstore.open_dataset(tmp_path / "g.shards")
    assert store.shape == (1, 16, 16) and store.manifest["source"]["mode"] == "L"
    for k, img in enumerate(images):
        assert torch.equal(store[k][0], _reference(img, "L")), modes[k]


@pytest.mark.parametrize("fmt", ["shards", "lmdb"])
def test_mode_l_on_rgb_sources_gives_torchvisions_convert_l(tmp_path, rgb_folder, fmt):
    folder = ImageFolder(str(rgb_folder), loader=lambda p: Image.open(p).convert("L"))
    _convert(rgb_folder, tmp_path / f"f{SUFFIX[fmt]}", static=STATIC, mode="L")
    store = dlstore.open_dataset(tmp_path / f"f{SUFFIX[fmt]}")
    assert store.shape == (1, 16, 16) and store.manifest["source"]["mode_given"] is True
    tv = v2.Compose([*to_torchvision(parse_static(STATIC)), v2.PILToTensor()])
    for k in range(0, len(folder), 5):
        assert torch.equal(store[k][0], tv(folder[k][0])), k

    images = [_image("RGB", k) for k in range(4)]
    _convert(Pairs(images, [0] * 4), tmp_path / f"d{SUFFIX[fmt]}", static=STATIC, mode="L")
    store = dlstore.open_dataset(tmp_path / f"d{SUFFIX[fmt]}")
    assert store.shape == (1, 16, 16) and store.manifest["source"]["mode"] == "L"
    assert all(torch.equal(store[k][0], _reference(img, "L")) for k, img in enumerate(images))


def test_mode_rgb_on_a_grayscale_list_and_pil_loaders_mode(tmp_path):
    (tmp_path / "imgs").mkdir()
    rels = _write(tmp_path / "imgs", ["L", "I;16"])
    (tmp_path / "l.csv").write_text("".join(f"{rel},0\n" for rel in rels))
    _convert(tmp_path / "l.csv", tmp_path / "l.h5", root=tmp_path / "imgs", mode="RGB")
    store = dlstore.open_dataset(tmp_path / "l.h5")
    for k, rel in enumerate(rels):
        assert torch.equal(store[k][0], _reference(Image.open(tmp_path / "imgs" / rel), "RGB", "")), rel
    assert pil_loader(tmp_path / "imgs" / rels[0], mode="L").tobytes() == \
        Image.open(tmp_path / "imgs" / rels[0]).convert("L").tobytes()


def test_arrays_in_a_dataset_follow_the_mode_like_pil_would(tmp_path):
    rng = np.random.default_rng(4)
    hwc = [rng.integers(0, 256, (18, 22, 3), dtype=np.uint8) for _ in range(3)]
    mixed = [hwc[0][..., 0].copy(), hwc[1], hwc[2]]   # one (H, W) grayscale array, then colour
    _convert(Pairs(mixed, [0, 1, 0]), tmp_path / "m.shards", static=STATIC)
    store = dlstore.open_dataset(tmp_path / "m.shards")
    tensor_tv = v2.Compose([v2.ToImage(), *to_torchvision(parse_static(STATIC))])
    as_rgb = np.array(Image.fromarray(mixed[0]).convert("RGB"))   # PIL's L -> RGB
    assert torch.equal(store[0][0], tensor_tv(as_rgb))
    assert all(torch.equal(store[k][0], tensor_tv(mixed[k])) for k in (1, 2))
    _convert(Pairs(hwc, [0, 1, 0]), tmp_path / "l.shards", static=STATIC, mode="L")
    store = dlstore.open_dataset(tmp_path / "l.shards")
    for k, a in enumerate(hwc):
        assert torch.equal(store[k][0], tensor_tv(np.array(Image.fromarray(a).convert("L")))), k
    _convert((np.stack(hwc), np.array([0, 1, 0])), tmp_path / "a.h5", static=STATIC, mode="L")
    arrays = dlstore.open_dataset(tmp_path / "a.h5")
    assert arrays.manifest["source"]["mode"] == "L" and arrays.manifest["source"]["mode_given"] is True
    assert all(torch.equal(arrays[k][0], store[k][0]) for k in range(3))   # the same conversion as items


class Trusted(Pairs):
    """Looks like torchvision's in-memory datasets (an array ``data``), whose first image decides."""

    data = np.zeros((4, 8, 8), np.uint8)


def test_a_colour_image_in_a_source_chosen_grayscale_is_named_with_the_fix(tmp_path):
    ds = Trusted([_image(m, k) for k, m in enumerate(["L", "L", "RGBA", "L"])], [0] * 4)
    for on_error in ("fail", "skip"):   # not a bad item to skip: the source's images disagree
        with pytest.raises(SourceError, match=r"Trusted item 2: is a PIL RGBA image \(3 channel\(s\) once stored\), but the "
                                              r"source's mode was chosen as L \(1 channel\(s\)\).*mode=\"RGB\" "
                                              r"\(--mode RGB\)"):
            _convert(ds, tmp_path / "x.shards", static=STATIC, on_error=on_error)
    assert not (tmp_path / "x.shards").exists()
    _convert(ds, tmp_path / "x.shards", static=STATIC, mode="RGB")
    store = dlstore.open_dataset(tmp_path / "x.shards")
    assert torch.equal(store[2][0], _reference(ds.images[2], "RGB"))


class Unconverted(DatasetSource):
    """A source object of its own whose loader hands out every image in its own mode."""

    def loader(self, decode=None):
        return lambda i: (to_image(self.dataset[i][0], f"item {i}"), 0)


def test_a_channel_mismatch_names_the_counts_and_the_mode_fix_not_a_resize(tmp_path):
    ds = Pairs([_image(m, k) for k, m in enumerate(["RGB", "L"])], [0, 0])
    with pytest.raises(DecodeError, match=r"Pairs item 1: has 1 channel\(s\), the store 3 \(source mode RGB\); "
                                          r"pass mode=\"RGB\" \(--mode RGB\)") as info:
        _convert(Unconverted(ds), tmp_path / "x.shards", static=STATIC)
    assert "resize" not in str(info.value)
    with pytest.raises(ArgumentError, match=r"mode='RGBA' \(4 channel\(s\)\).*give mode \"L\".*or \"RGB\""):
        _convert(ds, tmp_path / "y.shards", mode="RGBA")


def test_stores_whose_manifest_has_no_mode_still_open(tmp_path):
    _convert(Pairs([_image("RGB", k) for k in range(3)], [0, 1, 0]), tmp_path / "o.shards", static=STATIC)
    path = tmp_path / "o.shards" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["source"]["mode"], manifest["source"]["mode_given"]
    path.write_text(json.dumps(manifest))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()   # as its writer sealed it
    (tmp_path / "o.shards" / "manifest.json.sha256").write_text(f"{digest}  manifest.json\n")
    store = dlstore.open_dataset(tmp_path / "o.shards")
    assert "mode" not in store.manifest["source"] and store[1][0].shape == (3, 16, 16)
    assert dlstore.verify(tmp_path / "o.shards").ok


class Interrupting(Pairs):
    stop_at: int | None = None

    def __getitem__(self, i):
        if i == self.stop_at:
            raise KeyboardInterrupt
        return super().__getitem__(i)


def test_resume_continues_the_same_mode_and_refuses_another(tmp_path):
    ds = Interrupting([_image("L", k).resize((20, 20)) for k in range(100)], [k % 3 for k in range(100)])
    # built before the interruption is armed: the scan of a grayscale dataset reads every item
    chosen, as_rgb = DatasetSource(ds), DatasetSource(ds, mode="RGB")
    dst, options = tmp_path / "r.shards", {"static": STATIC, "shard_size": 16 * 16 * 4}
    ds.stop_at = 90   # 64 items are written, with checkpoints
    with pytest.raises(KeyboardInterrupt):
        _convert(chosen, dst, **options)
    ds.stop_at = None
    with pytest.raises(SourceError, match="other settings"):   # RGB samples would follow L ones
        _convert(as_rgb, dst, resume=True, **options)
    messages = []
    _convert(chosen, dst, resume=True, log=messages.append, **options)
    assert any(m.startswith("resuming after") for m in messages), messages
    _convert(chosen, tmp_path / "clean.shards", **options)
    a, b = dlstore.open_dataset(dst), dlstore.open_dataset(tmp_path / "clean.shards")
    assert a.shape == (1, 16, 16) and a.manifest["checksums"] == b.manifest["checksums"]
