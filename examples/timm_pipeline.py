"""timm's training and eval transforms on dlstore stores: split, placed, read a batch at a time.

    pipeline = timm.data.create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5")
    hybrid = dlstore.split_transforms(pipeline, resize_max=512)
    dlstore.convert(IMAGES, STORE, static=hybrid)          # decode once, the longer side capped at 512
    loader = dlstore.loader(dlstore.open_dataset(STORE, transform=hybrid), batch_size=64, shuffle=True)

timm's pipeline starts with its own ``RandomResizedCropAndInterpolation``, so it has
no static part: without ``--resize-max`` the store holds every image decoded, at its own
size; with it, the longer side capped (the ImageNet recipe, docs/recipes.md: the random
crop then reads a downscaled copy, an approximation measured there). ``--aa`` adds timm's
RandAugment (``rand-m9-mstd0.5``): it works on PIL images, so dlstore gives it one made from
the stored sample, per sample (``--train-interpolation random``, train.py's default, does
the same for the crop).

``eval_static`` derives the eval store's static spec from a model's pretrained config
(``timm.data.resolve_data_config``): timm's eval transform resizes to
``floor(img_size / crop_pct)`` with the model's interpolation and center-crops; convert the
validation folder with that, and timm's own eval transform (``create_loader(...,
is_training=False)`` sets it) then runs only its tensor conversion and normalisation.

``timm_for_dlstore`` spells out what ``split_transforms`` does to timm's tensor converters:
``MaybeToTensor`` converts a PIL image to float in [0, 1] but passes a tensor through
unchanged, so the ``Normalize`` after it would see 0..255; it becomes torchvision's
``ConvertImageDtype(float32)``, which divides by 255 as it does to a PIL image.

    python examples/timm_pipeline.py IMAGES [--store train.shards] [--size 224] [--aa rand-m9-mstd0.5]
        [--resize-max 512] [--eval-model resnet50 [--val VAL_IMAGES --val-store val.shards]]
"""

from __future__ import annotations

import argparse
from typing import Any

import timm.data
import timm.models
import torch
import torchvision.transforms as transforms
from torchvision.transforms import v2

import dlstore
from dlstore.transforms import HybridTransform, describe


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
    """timm's training transform (``timm_options``: ``create_transform``'s, e.g. ``auto_augment``)
    and its dlstore split (optionally downscaled at conversion)."""
    pipeline = timm.data.create_transform(size, is_training=True, **timm_options)
    return pipeline, dlstore.split_transforms(pipeline, resize_max=resize_max)


def data_config(model: str | torch.nn.Module | dict, *, use_test_size: bool = False) -> dict:
    """timm's resolved data config of ``model``: a model name (its pretrained config, no weights
    fetched), a timm model, or a data config (``input_size``, ``interpolation``, ``crop_pct``, ...)."""
    if isinstance(model, dict):
        return timm.data.resolve_data_config(dict(model), use_test_size=use_test_size)
    if isinstance(model, str):
        cfg = timm.models.get_pretrained_cfg(model)
        if cfg is None:
            raise ValueError(f"timm has no pretrained config named {model!r} (timm.list_pretrained() lists them)")
        return timm.data.resolve_data_config({}, pretrained_cfg=cfg.to_dict(), use_test_size=use_test_size)
    return timm.data.resolve_data_config({}, model=model, use_test_size=use_test_size)


def eval_static(model: str | torch.nn.Module | dict, *, use_test_size: bool = False) -> str:
    """The static spec of ``model``'s eval store (``dlstore convert VAL VAL_STORE --static SPEC``):
    the deterministic head of timm's eval transform for its data config, e.g.
    ``"resize=235:bicubic,center_crop=224x224"`` for resnet50 (224 / 0.95, bicubic).

    ``use_test_size``: the config's ``test_input_size`` / ``test_crop_pct`` (timm's validate.py
    option), else the training size that train.py's eval uses.
    """
    config = data_config(model, use_test_size=use_test_size)
    hybrid = dlstore.split_transforms(timm.data.create_transform(**config, is_training=False))
    if not hybrid.static_spec:
        raise ValueError(f"timm's eval transform for {config} has no static part to precompute: {hybrid}")
    return describe(hybrid.static_spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("images", help="an ImageFolder tree (ROOT/CLASS/IMAGE.jpg)")
    parser.add_argument("--store", default="timm.shards")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--aa", default=None, help="timm's auto-augment policy, e.g. rand-m9-mstd0.5")
    parser.add_argument("--train-interpolation", default="bilinear", help="timm's: bilinear, bicubic or random")
    parser.add_argument("--resize-max", type=int, default=None, help="cap the stored longer side")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--eval-model", help="a timm model name: print its eval store's static spec")
    parser.add_argument("--val", help="an ImageFolder tree to convert with --eval-model's spec")
    parser.add_argument("--val-store", default="val.shards")
    args = parser.parse_args()

    pipeline, hybrid = split_timm(args.size, resize_max=args.resize_max, auto_augment=args.aa,
                                  interpolation=args.train_interpolation)
    print("timm:", pipeline)
    print(hybrid)                                  # where each op went, and why
    print(dlstore.convert(args.images, args.store, static=hybrid, overwrite=True, progress=False))
    ds = dlstore.open_dataset(args.store, transform=hybrid)
    print("per sample:", ds.per_sample_ops)        # timm's crop fixes the size of a variable-shape store
    print("per batch: ", ds.batch_ops)             # RandAugment: PerSample(OnPIL(...)), a PIL image each
    loader = dlstore.loader(ds, batch_size=args.batch_size, shuffle=True)
    for k, (images, labels) in zip(range(args.batches), loader):
        print(f"batch {k}: {tuple(images.shape)} {images.dtype}, mean {images.mean():+.3f}, "
              f"std {images.std():.3f}, labels {labels[:8].tolist()}")
    if args.eval_model:
        spec = eval_static(args.eval_model)
        print(f"{args.eval_model}: eval store --static {spec}")
        if args.val:
            print(dlstore.convert(args.val, args.val_store, static=spec, overwrite=True, progress=False))
            val = dlstore.open_dataset(args.val_store, transform=timm.data.create_transform(
                **data_config(args.eval_model), is_training=False))
            print(val)                             # the resize and crop not run again


if __name__ == "__main__":
    main()
