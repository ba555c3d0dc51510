"""The static stage on (image, mask) pairs: bit-identical to torchvision v2 on ``(image, tv_tensors.Mask)``.

Differential: real JPEG images and PNG masks (palette, 16-bit) written with PIL, decoded as a store
decodes them (``pil_loader``, ``load_mask``) and as a torchvision user reads them
(``Image.open(...).convert("RGB")``, ``tv_tensors.Mask(F.pil_to_tensor(Image.open(mask)))``); the
spec is written as the user's v2 transforms, run by torchvision on the pair and by
``apply_static_pair`` on what ``parse_static`` makes of them.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as F

from dlstore.errors import ArgumentError, TransformSpecError
from dlstore.sources import load_mask, pil_loader
from dlstore.sources.demo import synthetic_image
from dlstore.transforms import ResizeMax, parse_static
from dlstore.transforms.joint_static import apply_static_pair, mask_static

SIZES = [(37, 53), (53, 37), (17, 19), (224, 301), (5, 3)]   # odd sizes; sizes smaller than the crops
PIPELINES = {   # what a segmentation user writes; parse_static makes the spec of each
    "resize, crop": [v2.Resize(32), v2.CenterCrop(24)],
    "crop larger than the image": [v2.Resize([29, 41]), v2.CenterCrop(64)],        # padded, the mask with 0
    "bicubic, odd crop": [v2.Resize(64, interpolation=InterpolationMode.BICUBIC), v2.CenterCrop([33, 47])],
    "nearest-exact": [v2.Resize(31, interpolation=InterpolationMode.NEAREST_EXACT)],
    "nearest, upscale": [v2.Resize(45, interpolation=InterpolationMode.NEAREST)],
    "no antialias": [v2.Resize(13, antialias=False), v2.CenterCrop(11)],
    "crop, grayscale": [v2.CenterCrop([21, 9]), v2.Grayscale()],
    "reflect pad, crop": [v2.Pad(3, padding_mode="reflect"), v2.CenterCrop(30)],
    "pad fill, max_size": [v2.Pad([1, 2, 3, 4], fill=7), v2.Resize(26, max_size=40)],
}


def _classes(h, w, k):
    """Class indices in regions, as real masks have them, with a 255 'ignore' grid."""
    yy, xx = np.mgrid[0:h, 0:w]
    classes = ((yy * 3 // h) * 5 + xx * 5 // w + k) % 21
    classes[::7, ::5] = 255
    return classes, xx


def _write_pair(image_file, mask_file, wide_file, h, w, k, quality=85):
    Image.fromarray(synthetic_image(k, k, (h, w))).save(image_file, format="JPEG", quality=quality)
    classes, xx = _classes(h, w, k)
    palette = Image.fromarray(classes.astype(np.uint8), "P")
    palette.putpalette([(i * 41 + c * 89) % 256 for i in range(256) for c in range(3)])   # colours != indices
    palette.save(mask_file, format="PNG")
    Image.fromarray((classes * 250 + xx).astype(np.uint16)).save(wide_file, format="PNG")   # values up to 63750


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    """A JPEG image, a palette PNG mask and a 16-bit PNG mask (values above 255) per size."""
    root = tmp_path_factory.mktemp("pairs")
    out = []
    for k, (h, w) in enumerate(SIZES):
        files = (root / f"x{k}.jpg", root / f"x{k}.png", root / f"x{k}-16.png")
        _write_pair(*files, h, w, k)
        out.append(files)
    return out


def _torchvision(transforms, image_file, mask_file):
    """The pair as a torchvision v2 user transforms it: the PIL RGB image, the mask's indices as a Mask."""
    image = Image.open(image_file).convert("RGB")
    mask = tv_tensors.Mask(F.pil_to_tensor(Image.open(mask_file)))
    out_image, out_mask = v2.Compose(transforms)(image, mask)
    return F.pil_to_tensor(out_image).numpy(), out_mask.numpy()[0]


def _check_pair(image, mask, ref_image, ref_mask, what):
    assert np.array_equal(image, ref_image), what
    assert mask.dtype == ref_mask.dtype and np.array_equal(mask, ref_mask), what
    assert mask.shape == image.shape[1:] and mask.flags["C_CONTIGUOUS"] and image.flags["C_CONTIGUOUS"]


@pytest.mark.parametrize("name", PIPELINES)
def test_pairs_of_files_are_torchvisions_bit_for_bit(pair_files, name):
    transforms = PIPELINES[name]
    spec = parse_static(transforms)
    for image_file, mask_file, wide_file in pair_files:
        for file in (mask_file, wide_file):
            try:
                ref_image, ref_mask = _torchvision(transforms, image_file, file)
            except (RuntimeError, ValueError) as exc:    # reflect padding wider than the image: v2 fails, so do we
                with pytest.raises(type(exc)):
                    apply_static_pair(pil_loader(image_file), load_mask(file), spec)
                continue
            image, mask = apply_static_pair(pil_loader(image_file), load_mask(file), spec)
            _check_pair(image, mask, ref_image, ref_mask, (name, file))
            assert mask.dtype == (np.uint16 if file == wide_file else np.uint8)


@pytest.mark.parametrize("name", PIPELINES)
def test_tensor_images_are_torchvisions_on_image_and_mask(pair_files, name):
    """A dataset source's tensor image: the pair as v2 transforms (tv_tensors.Image, tv_tensors.Mask)."""
    transforms = PIPELINES[name]
    for image_file, mask_file, wide_file in pair_files[:3]:
        for file in (mask_file, wide_file):
            tensor = F.pil_to_tensor(pil_loader(image_file))
            values = torch.from_numpy(load_mask(file))
            ref_image, ref_mask = v2.Compose(transforms)(tv_tensors.Image(tensor), tv_tensors.Mask(values))
            image, mask = apply_static_pair(tensor, values, parse_static(transforms))
            _check_pair(image, mask, ref_image.numpy(), ref_mask.numpy(), (name, file))


def test_resize_max_is_v2s_resize_to_max_size_on_the_pair_and_never_upscales(pair_files):
    for image_file, mask_file, wide_file in pair_files:
        for file, n in ((mask_file, 20), (wide_file, 41), (mask_file, 400)):
            image = Image.open(image_file).convert("RGB")
            mask = tv_tensors.Mask(F.pil_to_tensor(Image.open(file)))
            longer = max(image.size)
            reference = v2.Resize(size=None, max_size=n) if longer > n else v2.Identity()
            ref_image, ref_mask = reference(image, mask)
            out_image, out_mask = apply_static_pair(pil_loader(image_file), load_mask(file), f"resize_max={n}")
            _check_pair(out_image, out_mask, F.pil_to_tensor(ref_image).numpy(), ref_mask.numpy()[0], (file, n))
            tv_image, tv_mask = v2.Compose([ResizeMax(n)])(image, mask)     # ResizeMax takes the pair in a Compose
            assert np.array_equal(F.pil_to_tensor(tv_image).numpy(), out_image) and np.array_equal(tv_mask[0], out_mask)


@settings(max_examples=60, deadline=None)
@given(h=st.integers(1, 90), w=st.integers(1, 90), resize=st.integers(1, 80), crop_h=st.integers(1, 100),
       crop_w=st.integers(1, 100), k=st.integers(0, 20), wide=st.booleans(),
       interpolation=st.sampled_from([InterpolationMode.BILINEAR, InterpolationMode.BICUBIC,
                                      InterpolationMode.NEAREST, InterpolationMode.NEAREST_EXACT]))
def test_any_sizes_are_torchvisions_on_decoded_files(h, w, resize, crop_h, crop_w, k, wide, interpolation):
    """Real JPEG and PNG files of any size; resize then crop, the crop often larger than the resized image."""
    transforms = [v2.Resize(resize, interpolation=interpolation), v2.CenterCrop([crop_h, crop_w])]
    spec = parse_static(transforms)
    with tempfile.TemporaryDirectory() as root:
        files = [os.path.join(root, name) for name in ("x.jpg", "x.png", "x-16.png")]
        _write_pair(*files, h, w, k)
        image_file, file = files[0], files[2 if wide else 1]
        ref_image, ref_mask = _torchvision(transforms, image_file, file)
        image, mask = apply_static_pair(pil_loader(image_file), load_mask(file), spec)
        _check_pair(image, mask, ref_image, ref_mask, (h, w))
        tensor, values = F.pil_to_tensor(pil_loader(image_file)), torch.from_numpy(load_mask(file))
        ref_image, ref_mask = v2.Compose(transforms)(tv_tensors.Image(tensor), tv_tensors.Mask(values))
        image, mask = apply_static_pair(tensor, values, spec)
        _check_pair(image, mask, ref_image.numpy(), ref_mask.numpy(), ("tensor", h, w))


def test_the_mask_holds_only_its_own_classes_after_a_bilinear_resize(pair_files):
    image_file, mask_file, _ = pair_files[3]
    values = load_mask(mask_file)
    _, mask = apply_static_pair(pil_loader(image_file), values, "resize=57,center_crop=50")
    assert set(np.unique(mask)) <= set(np.unique(values))       # nearest: no blended class indices
    assert len(np.unique(mask)) > 5


def test_a_centre_crop_larger_than_the_mask_pads_it_with_zero():
    mask = np.full((4, 6), 9, np.uint16)
    out = mask_static(mask, "center_crop=8x10")
    assert out.shape == (8, 10) and out.dtype == np.uint16 and out[0].sum() == 0 and out[2:6, 2:8].min() == 9


def test_what_a_mask_cannot_take_is_refused():
    image = Image.new("RGB", (6, 4))
    with pytest.raises(TransformSpecError, match="per-channel fill"):
        apply_static_pair(image, np.zeros((4, 6), np.uint8), [{"op": "pad", "padding": 2, "fill": [1, 2, 3]}])
    with pytest.raises(ArgumentError, match=r"the mask is \(6, 4\) \(H, W\) but its image 4x6"):
        apply_static_pair(image, np.zeros((6, 4), np.uint8), "resize=8")
    with pytest.raises(ArgumentError, match="uint8 or uint16 class indices, got a int64"):
        apply_static_pair(image, torch.zeros(4, 6, dtype=torch.int64), "resize=8")
    with pytest.raises(ArgumentError, match=r"got a uint8 array of shape \(1, 4, 6\)"):
        mask_static(np.zeros((1, 4, 6), np.uint8), "resize=8")
