"""timm's training transform on a dlstore store: split, placed, read a batch at a time.

    pipeline = timm.data.create_transform(224, is_training=True)
    hybrid = dlstore.split_transforms(pipeline)
    dlstore.convert(IMAGES, STORE, static=hybrid)          # decode once (no static op in timm's pipeline)
    loader = dlstore.loader(dlstore.open_dataset(STORE, transform=hybrid), batch_size=64, shuffle=True)

timm's pipeline starts with its own ``RandomResizedCropAndInterpolation``, so it has
no static part: the store holds every image decoded, at its own size. For large
photos add ``--resize-max 512`` (the ImageNet recipe, docs/recipes.md): the random
crop then reads a downscaled copy, an approximation measured there.

``timm_for_dlstore`` adapts the one timm op that a store's uint8 tensors break:
``MaybeToTensor`` converts a PIL image to float in [0, 1] but passes a tensor through
unchanged, so the ``Normalize`` after it would see 0..255. It becomes torchvision's
``ConvertImageDtype(float32)``, which divides by 255 as it does to a PIL image.

    python examples/timm_pipeline.py IMAGES [--store train.shards] [--size 224] [--batches 3]
"""

from __future__ import annotations

import argparse
from typing import Any

import timm.data
import torch
import torchvision.transforms as transforms
from torchvision.transforms import v2

import dlstore
from dlstore.transforms import HybridTransform


def timm_for_dlstore(pipeline: Any) -> v2.Compose:
    """``pipeline``'s ops with timm's tensor converters replaced by what they do to a PIL image.

    ``split_transforms`` does this itself (timm's ``MaybeToTensor`` is a ``ToTensor``
    subclass; ``MaybePILToTensor`` is dropped like ``PILToTensor``): this spells it out,
    and the tests use it as the torchvision reference.
    """
    ops = []
    for t in pipeline.transforms:
        name = type(t).__name__
        if name == "MaybeToTensor":          # PIL -> float [0, 1]; a uint8 tensor would pass unscaled
            ops.append(transforms.ConvertImageDtype(torch.float32))
        elif name == "MaybePILToTensor":     # PIL -> uint8 tensor (use_prefetcher=True): a store has that
            continue
        else:
            ops.append(t)
    return v2.Compose(ops)


def split_timm(size: int = 224, *, resize_max: int | None = None, **timm_options: Any) -> tuple[Any, HybridTransform]:
    """timm's training transform and its dlstore split (optionally downscaled at conversion)."""
    pipeline = timm.data.create_transform(size, is_training=True, **timm_options)
    return pipeline, dlstore.split_transforms(pipeline, resize_max=resize_max)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("images", help="an ImageFolder tree (ROOT/CLASS/IMAGE.jpg)")
    parser.add_argument("--store", default="timm.shards")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--resize-max", type=int, default=None, help="cap the stored longer side")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=3)
    args = parser.parse_args()

    pipeline, hybrid = split_timm(args.size, resize_max=args.resize_max)
    print("timm:", pipeline)
    print(hybrid)                                  # where each op went, and why
    print(dlstore.convert(args.images, args.store, static=hybrid, overwrite=True, progress=False))
    ds = dlstore.open_dataset(args.store, transform=hybrid)
    print("per sample:", ds.per_sample_ops)        # timm's crop fixes the size of a variable-shape store
    print("per batch: ", ds.batch_ops)
    loader = dlstore.loader(ds, batch_size=args.batch_size, shuffle=True)
    for k, (images, labels) in zip(range(args.batches), loader):
        print(f"batch {k}: {tuple(images.shape)} {images.dtype}, mean {images.mean():+.3f}, "
              f"std {images.std():.3f}, labels {labels[:8].tolist()}")


if __name__ == "__main__":
    main()
