"""RandomResizedCrop at decode time, for a store of JPEG/PNG records.

A pipeline that starts with ``RandomResizedCrop`` (bilinear) on an encoded store runs
it here, record by record, inside the batch the loader thread builds::

    records = one read of the batch
    sizes   = each record's (height, width), from its header (no decode)
    boxes   = drawn for every record at once from the batch's generator, as
              v2.RandomResizedCrop.get_params draws on an image of that size
    for each record: decode it (torchvision, the GIL released), crop + resize its box
              (torchvision's resized_crop kernel) into the batch, while it is in cache,
              flipped there when a RandomHorizontalFlip follows (drawn after the boxes)

so the output equals torchvision's ``F.resized_crop`` on the decoded image with the
drawn box, which is ``v2.RandomResizedCrop`` given the same parameters. Draws come
from the loader's per-batch generator: reproducible whatever the thread count, which
is why the loader picks threads for such a pipeline.

``reduced_decode=True`` (opt-in; exact is the default) decodes a JPEG at the smallest
DCT scale (1/2, 1/4, 1/8: ``Image.draft``) at which the drawn box still holds the
output size, and crops the box mapped to that scale (rounded to its pixels): a large
record cropped to a small output decodes 2-4x faster; the pixels are not the exact
path's (docs/reading.md has the measured PSNR).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import StoreCorruptError, TransformSpecError
from ..formats.encoding import DecodingReader, image_size, reduced_scale
from ..transforms.batch import BatchRandomHorizontalFlip, BatchRandomResizedCrop, BatchTransform
from ..transforms.equivalents import batch_equivalent


def split_decode_crop(reader: Any, per_sample_ops: list[Any], batch_ops: list[BatchTransform]
                      ) -> tuple[BatchRandomResizedCrop | None, list[Any], list[BatchTransform]]:
    """(the crop run at decode time or None, per-sample ops, batch ops) of an encoded store whose
    dynamic part begins with a bilinear RandomResizedCrop; the other ops unchanged."""
    if not isinstance(reader, DecodingReader):
        return None, per_sample_ops, batch_ops
    if len(per_sample_ops) == 1:           # a variable-shape store: the crop is what fixes the size
        crop = batch_equivalent(per_sample_ops[0])
        if isinstance(crop, BatchRandomResizedCrop):
            return crop, [], batch_ops
    elif not per_sample_ops and batch_ops and isinstance(batch_ops[0], BatchRandomResizedCrop):
        return batch_ops[0], [], batch_ops[1:]
    return None, per_sample_ops, batch_ops


def decode_crop_batch(reader: DecodingReader, idx: list[int], crop: BatchRandomResizedCrop,
                      generator: torch.Generator | None, new_batch: Callable[[tuple[int, ...]], torch.Tensor],
                      *, flip: BatchRandomHorizontalFlip | None = None, reduced: bool = False) -> torch.Tensor:
    """Samples ``idx`` decoded and cropped by ``crop`` into one (B, C, h, w) uint8 batch (``new_batch``),
    each flipped as ``flip`` draws (drawn after the boxes, as ``BatchCompose([crop, flip])`` draws)."""
    from torchvision.transforms.v2 import functional as F

    where = str(getattr(reader.raw, "path", "store"))
    records = reader.records(idx)
    sizes = torch.tensor([image_size(r, where=f"{where} sample {i}") for r, i in zip(records, idx)],
                         dtype=torch.long).reshape(-1, 2)
    boxes = crop.sample_sizes(sizes[:, 0], sizes[:, 1], generator=generator)
    out_size = list(crop.size)
    flips = flip.sample((len(idx), 1, *out_size), generator=generator)["flip"].tolist() if flip is not None \
        else [False] * len(idx)
    out = None
    for j, (record, i, t, l, h, w) in enumerate(zip(records, idx, *(boxes[k].tolist() for k in
                                                                    ("top", "left", "height", "width")))):
        scale = reduced_scale(h, w, crop.size) if reduced else 1   # type: ignore[arg-type]
        sample, s = reader.decode_record(record, i, reduce=scale)
        image = torch.from_numpy(sample)
        if s > 1:    # the box at the scale decoded, rounded to its pixels
            height, width = image.shape[1:]
            t, b = min(round(t / s), height - 1), min(round((t + h) / s), height)
            l, r = min(round(l / s), width - 1), min(round((l + w) / s), width)
            h, w = max(1, b - t), max(1, r - l)
        elif tuple(image.shape[1:]) != tuple(sizes[j].tolist()):
            raise StoreCorruptError(f"{where} sample {i}: decodes to {tuple(image.shape[1:])}, its "
                                    f"header says {tuple(sizes[j].tolist())}")
        if out is None:
            out = new_batch((len(idx), image.shape[0], *out_size))
        elif image.shape[0] != out.shape[1]:
            raise TransformSpecError(f"{where}: cannot batch samples of {out.shape[1]} and "
                                     f"{image.shape[0]} channels (sample {i}); convert with one colour mode")
        resized = F.resized_crop(image, t, l, h, w, out_size, antialias=crop.antialias)
        out[j] = resized.flip(-1) if flips[j] else resized     # the flip in the copy into the batch
    if out is None:
        return torch.empty((0, 3, *out_size), dtype=torch.uint8)
    return out
