"""Static transform specs: parsing, torchvision round trip, refusal of random ops, bit-exactness."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image
from torchvision.transforms import v2

from dlstore.errors import TransformSpecError
from dlstore.sources.demo import synthetic_image
from dlstore.transforms import (
    apply_static,
    describe,
    output_shape,
    parse_static,
    to_torchvision,
)


def test_cli_string_and_torchvision_give_the_same_spec():
    from_string = parse_static("resize=256,center_crop=224")
    from_v2 = parse_static(v2.Compose([v2.Resize(256), v2.CenterCrop(224), v2.PILToTensor()]))
    from_v1 = parse_static(T.Compose([T.Resize(256), T.CenterCrop(224)]))
    from_dicts = parse_static([{"op": "resize", "size": 256}, {"op": "center_crop", "size": 224}])
    assert from_string == from_v2 == from_v1 == from_dicts
    assert from_string[0] == {"op": "resize", "size": 256, "interpolation": "bilinear",
                              "antialias": True, "max_size": None}
    assert from_string[1] == {"op": "center_crop", "size": [224, 224]}


def test_string_forms():
    spec = parse_static("resize=64x48:bicubic,pad=2:reflect,grayscale=3,center_crop=30x20")
    assert spec[0]["size"] == [64, 48] and spec[0]["interpolation"] == "bicubic"
    assert spec[1] == {"op": "pad", "padding": [2, 2, 2, 2], "fill": 0, "padding_mode": "reflect"}
    assert spec[2] == {"op": "grayscale", "num_output_channels": 3}
    assert parse_static('[{"op": "grayscale"}]') == [{"op": "grayscale", "num_output_channels": 1}]
    assert parse_static("") == parse_static(None) == []
    assert describe(parse_static("resize=256,center_crop=224")) == "resize=256,center_crop=224x224"


@pytest.mark.parametrize("bad, message", [
    ("resize", "cannot parse"),
    ("blur=3", "unknown static op 'blur'"),
    ("resize=abc", "cannot parse"),
    ('[{"op": "resize", "size": 10, "bogus": 1}]', "unknown field"),
    ('[{"op": "resize", "size": 10, "interpolation": "cubic"}]', "unknown interpolation"),
    ('[{"op": "center_crop", "size": -3}]', "positive"),
])
def test_bad_specs_are_explained(bad, message):
    with pytest.raises(TransformSpecError, match=message):
        parse_static(bad)


@pytest.mark.parametrize("transform", [
    v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(), v2.RandomResizedCrop(224),
    v2.ColorJitter(0.4), T.RandomCrop(32),
])
def test_random_ops_are_refused_with_the_reason(transform):
    with pytest.raises(TransformSpecError) as info:
        parse_static(v2.Compose([v2.Resize(64), transform]))
    text = str(info.value)
    assert "random" in text and "freeze" in text and "dynamic" in text


def test_float_ops_are_refused():
    with pytest.raises(TransformSpecError, match="float"):
        parse_static([v2.ToDtype(torch.float32, scale=True)])
    with pytest.raises(TransformSpecError, match="float"):
        parse_static([v2.Normalize([0.5] * 3, [0.5] * 3)])


def test_output_shape():
    assert output_shape(parse_static("resize=256,center_crop=224")) == (3, 224, 224)
    assert output_shape(parse_static("resize=256")) is None
    assert output_shape(parse_static("resize=40x30,pad=2")) == (3, 44, 34)
    assert output_shape(parse_static("center_crop=20,grayscale")) == (1, 20, 20)
    assert output_shape([]) is None


I = v2.InterpolationMode
SPECS = [  # (spec as a user writes it, the torchvision pipeline it must equal)
    ("resize=37,center_crop=30", [v2.Resize(37), v2.CenterCrop(30)]),
    ("resize=37:bicubic,center_crop=31x29", [v2.Resize(37, I.BICUBIC), v2.CenterCrop((31, 29))]),
    ("resize=20x50:nearest", [v2.Resize((20, 50), I.NEAREST)]),
    ('[{"op": "resize", "size": 40, "antialias": false}]', [v2.Resize(40, antialias=False)]),
    ("pad=3:reflect,center_crop=30", [v2.Pad(3, padding_mode="reflect"), v2.CenterCrop(30)]),
    ("grayscale,resize=33", [v2.Grayscale(), v2.Resize(33)]),
    ("grayscale=3,center_crop=17", [v2.Grayscale(3), v2.CenterCrop(17)]),
    ('[{"op": "pad", "padding": [1, 2, 3, 4], "fill": [10, 20, 30]}]', [v2.Pad([1, 2, 3, 4], fill=(10, 20, 30))]),
]


@pytest.mark.parametrize("spec, pipeline", SPECS, ids=[s for s, _ in SPECS])
@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "P"])
def test_apply_static_is_bit_identical_to_torchvision(spec, pipeline, mode):
    img = Image.fromarray(synthetic_image(3, 7, (45, 61))).convert(mode).convert("RGB")
    reference = v2.Compose([*pipeline, v2.PILToTensor()])(img)
    ours = apply_static(img, parse_static(spec))
    assert ours.dtype == np.uint8 and ours.flags.c_contiguous
    assert torch.equal(torch.from_numpy(ours), reference)
    # the spec also round-trips through torchvision objects
    assert parse_static(to_torchvision(parse_static(spec))) == parse_static(spec)
