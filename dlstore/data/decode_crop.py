"""RandomResizedCrop at decode time, for a store of JPEG/PNG records.

A pipeline that starts with ``RandomResizedCrop`` (bilinear) on an encoded store runs
it here, inside the batch the loader thread builds::

    records = one read of the batch
    images  = the batch decoded in one torchvision call (the GIL released; PIL where the
              reader's check says so, or for a record that does not decode, whose error names it)
    boxes   = drawn for every record at once from the batch's generator, on the decoded
              sizes, as v2.RandomResizedCrop.get_params draws on an image of that size
    for each record: crop + resize its box (torchvision's resized_crop kernel) into the
              batch, flipped there when a RandomHorizontalFlip follows (drawn after the boxes)

so the output equals torchvision's ``F.resized_crop`` on the decoded image with the
drawn box, which is ``v2.RandomResizedCrop`` given the same parameters. The draw
(``draw_boxes``) and the crop into the batch (``crop_into_batch``) are also those of the
device stage's decode (``device_decode.py``): one draw order for both. Draws come
from the loader's per-batch generator: reproducible whatever the thread count, which
is why the loader picks threads for such a pipeline. The Python per record is kept to
a few lines: at two loader threads the GIL it holds is what caps their scaling.

``reduced_decode=True`` (opt-in; exact is the default) decodes a JPEG at the smallest
DCT scale (1/2, 1/4, 1/8: ``Image.draft``) at which the drawn box still holds the
output size, and crops the box mapped to that scale (rounded to its pixels): a large
record cropped to a small output decodes 2-4x faster; the pixels are not the exact
path's (docs/reading.md has the measured PSNR). There the boxes come first, drawn on the
sizes in the records' headers, as each box picks its record's scale; the records whose
box picks scale 1 decode as the exact path's do (in one call, each then checked against
its header's size), the others one at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import StoreCorruptError, TransformSpecError
from ..formats.encoding import DecodingReader, image_size, reduced_scale
from ..transforms.batch import (
    BatchRandomHorizontalFlip,
    BatchRandomResizedCrop,
    BatchTransform,
)
from ..transforms.equivalents import batch_equivalent


def split_decode_crop(decodes: bool, per_sample_ops: list[Any], batch_ops: list[BatchTransform]
                      ) -> tuple[BatchRandomResizedCrop | None, list[Any], list[BatchTransform]]:
    """(the crop run at decode time or None, per-sample ops, batch ops) of an encoded store (``decodes``)
    whose dynamic part begins with a bilinear RandomResizedCrop; the other ops unchanged."""
    if not decodes:
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
    records = reader.records(idx)
    if not records:
        return torch.empty((0, 3, *crop.size), dtype=torch.uint8)
    if reduced:   # the boxes first, on the headers' sizes: each box picks its record's DCT scale
        sizes = [image_size(r, where=f"{reader.where} sample {i}") for r, i in zip(records, idx)]
        boxes, flips = draw_boxes(crop, torch.tensor(sizes, dtype=torch.long), generator, flip)
        images, boxes = _decode_reduced(reader, records, idx, boxes.tolist(), crop.size, sizes)
    else:         # the batch in one decode call, the boxes drawn on the decoded sizes
        images = [torch.from_numpy(sample) for sample in reader.decode_records(records, idx)]
        boxes, flips = draw_boxes(crop, torch.tensor([image.shape[1:] for image in images], dtype=torch.long),
                                  generator, flip)
        boxes = boxes.tolist()
    return crop_into_batch(images, idx, boxes, flips.tolist(), crop, new_batch, where=reader.where)


def draw_boxes(crop: BatchRandomResizedCrop, sizes: torch.Tensor, generator: torch.Generator | None,
               flip: BatchRandomHorizontalFlip | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The boxes ((B, 4) int64: top, left, height, width) of images of ``sizes`` ((B, 2) int64: height,
    width), then their flips ((B,) bool; none without ``flip``), drawn from ``generator`` in the order
    ``BatchCompose([crop, flip])`` draws them: the one draw of every decode-time crop."""
    drawn = crop.sample_sizes(sizes[:, 0], sizes[:, 1], generator=generator)
    boxes = torch.stack([drawn[k] for k in ("top", "left", "height", "width")], dim=1)
    flips = flip.sample((len(sizes), 1, *crop.size), generator=generator)["flip"] if flip is not None \
        else torch.zeros(len(sizes), dtype=torch.bool)
    return boxes, flips


def crop_into_batch(images: list[torch.Tensor], idx: list[int], boxes: list[list[int]], flips: list[bool],
                    crop: BatchRandomResizedCrop, new_batch: Callable[[tuple[int, ...]], torch.Tensor], *,
                    where: str) -> torch.Tensor:
    """Image j's box ``boxes[j]`` (top, left, height, width) resized to ``crop.size`` by torchvision's
    ``resized_crop`` kernel (the crop's: v2's, or v1's for a v1 RandomResizedCrop) and flipped where
    ``flips[j]``, in the copy into one (B, C, h, w) batch from ``new_batch``; TransformSpecError
    (naming ``where`` and the sample) where channels differ."""
    size = list(crop.size)
    out = None
    for j, (image, i, (t, l, h, w)) in enumerate(zip(images, idx, boxes)):
        if out is None:
            out = new_batch((len(images), image.shape[0], *size))
        elif image.shape[0] != out.shape[1]:
            raise TransformSpecError(f"{where}: cannot batch samples of {out.shape[1]} and "
                                     f"{image.shape[0]} channels (sample {i}); convert with one colour mode")
        resized = crop.resize_one(image, t, l, h, w)
        out[j] = resized.flip(-1) if flips[j] else resized     # the flip in the copy into the batch
    return out if out is not None else new_batch((0, 3, *size))


def check_header(image: torch.Tensor, header: Any, where: str, i: int) -> torch.Tensor:
    """``image`` (sample ``i``), once its size is ``header``'s ((height, width) read before the decode,
    which the box was drawn on); else StoreCorruptError naming ``where`` and the sample."""
    if tuple(image.shape[1:]) != tuple(header):
        raise StoreCorruptError(f"{where} sample {i}: decodes to {tuple(image.shape[1:])}, its "
                                f"header says {tuple(header)}")
    return image


def _decode_reduced(reader: DecodingReader, records: list[Any], idx: list[int], boxes: list[list[int]],
                    size: tuple[int, int], headers: list[tuple[int, int]]
                    ) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Each record decoded at the smallest DCT scale that keeps its box holding ``size``, and the box at
    that scale, rounded to its pixels. The records of scale 1 decode as the exact path's do, in one
    ``decode_records`` call; those of a larger scale one at a time (``Image.draft``)."""
    scales = [reduced_scale(h, w, size) for _, _, h, w in boxes]
    whole = [j for j, s in enumerate(scales) if s == 1]
    images: list[Any] = [None] * len(records)
    for j, sample in zip(whole, reader.decode_records([records[j] for j in whole], [idx[j] for j in whole])):
        images[j] = check_header(torch.from_numpy(sample), headers[j], reader.where, idx[j])
    for j, s in enumerate(scales):
        if s == 1:
            continue
        sample, s = reader.decode_record(records[j], idx[j], reduce=s)
        images[j] = torch.from_numpy(sample)
        if s == 1:   # the file allows no reduction (progressive, CMYK): decoded whole
            check_header(images[j], headers[j], reader.where, idx[j])
            continue
        t, l, h, w = boxes[j]
        height, width = images[j].shape[1:]
        t, b = min(round(t / s), height - 1), min(round((t + h) / s), height)
        l, r = min(round(l / s), width - 1), min(round((l + w) / s), width)
        boxes[j] = [t, l, max(1, b - t), max(1, r - l)]
    return images, boxes
