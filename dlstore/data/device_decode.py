"""JPEG records decoded where the batch goes: the host stage draws, the device decodes and crops.

``dlstore.loader(ds, B, device="cuda")`` on a JPEG store whose dynamic part begins with a
bilinear ``RandomResizedCrop`` (and a flip) cuts the work between the two stages so::

    host (loader threads)  records = one read of the batch; sizes from their headers;
                           boxes, then flips, drawn from the batch's generator by
                           ``decode_crop_batch``'s own ``draw_boxes`` -> an EncodedBatch (no pixels)
    device                 decode_jpeg(records, device=...) (nvjpeg on CUDA), each box cropped
                           and resized there, flipped in the copy into one (B, C, h, w) batch
                           (``decode_crop.crop_into_batch``), then the rest of the device stage

so the host's cores only read and parse headers. The draws are those of the host path,
whatever the device; on ``device="cpu"`` (what the tests run) the pixels equal the host
path's exactly (the same decoder and kernel). On CUDA, nvjpeg's IDCT and the CUDA resize
round on their own: that bound against PIL is measured by ``scripts/gpu_check.py``.
A record the device cannot decode is decoded on the CPU (the host path's
``DecodingReader.decode_records``, whose error names the store and the sample) and copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..formats.encoding import DecodingReader, image_size
from ..transforms.batch import BatchRandomHorizontalFlip, BatchRandomResizedCrop
from .decode_crop import check_header, crop_into_batch, draw_boxes


@dataclass
class EncodedBatch:
    """A batch as the host hands it to the device: records as stored, their drawn boxes and flips."""

    records: list[torch.Tensor]     # each a 1-D uint8 tensor: the file's bytes
    indices: list[int]              # the samples (for errors)
    sizes: torch.Tensor             # (B, 2) int64: each record's (height, width) from its header
    boxes: torch.Tensor             # (B, 4) int64: top, left, height, width, in the record's pixels
    flips: torch.Tensor             # (B,) bool

    def __len__(self) -> int:
        return len(self.records)

    def pin_memory(self) -> EncodedBatch:
        return self   # the decoder reads the records where they are


def draw_encoded(reader: DecodingReader, idx: list[int], crop: BatchRandomResizedCrop,
                 generator: torch.Generator | None, flip: BatchRandomHorizontalFlip | None = None) -> EncodedBatch:
    """The host half: ``idx``'s records, each one's box (then flip) drawn as ``decode_crop_batch`` draws it."""
    records = reader.records(idx)
    sizes = torch.tensor([image_size(r, where=f"{reader.where} sample {i}") for r, i in zip(records, idx)],
                         dtype=torch.long).reshape(-1, 2)
    boxes, flips = draw_boxes(crop, sizes, generator, flip)
    # owned and writable (a record may be a view of a read buffer, and torch wants writable memory)
    tensors = [torch.from_numpy(r.reshape(-1).copy()) for r in records]
    return EncodedBatch(tensors, list(idx), sizes, boxes, flips)


class DeviceDecode:
    """The device stage's first step on a JPEG store: an EncodedBatch in, a (B, C, h, w) uint8 batch out.

    Args:
        reader: the store's DecodingReader: decodes on the CPU what the device cannot.
        crop: the RandomResizedCrop the host drew the boxes for (its output size, antialias).
    """

    def __init__(self, reader: DecodingReader, crop: BatchRandomResizedCrop):
        self.reader = reader
        self.crop = crop

    def _decoded(self, batch: EncodedBatch, device: torch.device) -> list[torch.Tensor]:
        """Each record decoded on ``device``: by nvjpeg off the CPU; on the CPU (``device="cpu"``, and
        a record nvjpeg cannot decode or that is CMYK) by the host path's ``decode_records``."""
        images: list[torch.Tensor | None] = [None] * len(batch)
        if device.type != "cpu":
            from torchvision.io import decode_jpeg

            try:
                images = [image if image.shape[0] in (1, 3) else None
                          for image in decode_jpeg(batch.records, device=device)]
            except RuntimeError:     # a record that does not decode: all on the CPU, whose error names it
                pass
        cpu = [j for j, image in enumerate(images) if image is None]
        samples = self.reader.decode_records([batch.records[j].numpy() for j in cpu], [batch.indices[j] for j in cpu])
        for j, sample in zip(cpu, samples):
            images[j] = torch.from_numpy(sample).to(device)
        return images  # type: ignore[return-value]

    def __call__(self, batch: EncodedBatch, device: torch.device) -> torch.Tensor:
        images = self._decoded(batch, device)
        for image, i, size in zip(images, batch.indices, batch.sizes.tolist()):
            check_header(image, size, self.reader.where, i)
        return crop_into_batch(images, batch.indices, batch.boxes.tolist(), batch.flips.tolist(), self.crop,
                               lambda shape: torch.empty(shape, dtype=torch.uint8, device=device),
                               where=self.reader.where)

    def __repr__(self) -> str:
        return f"DeviceDecode(jpeg, RandomResizedCrop {list(self.crop.size)})"


def decodes_on_device(dataset: Any) -> bool:
    """Whether ``dataset``'s batches can go to a device as records: a JPEG store whose dynamic part
    begins with the crop run at decode time, exact (not ``reduced_decode``), and then (after the
    flip) holds nothing more for the host."""
    reader = getattr(dataset, "reader", None)
    return (isinstance(reader, DecodingReader) and reader.manifest["sample"].get("encoding") == "jpeg"
            and getattr(dataset, "decode_crop", None) is not None and not dataset.reduced_decode
            and not dataset.batch_rest)
