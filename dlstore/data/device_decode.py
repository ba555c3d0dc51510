"""JPEG records decoded where the batch goes: the host stage draws, the device decodes and crops.

``dlstore.loader(ds, B, device="cuda")`` on a JPEG store whose dynamic part begins with a
bilinear ``RandomResizedCrop`` (and a flip) cuts the work between the two stages so::

    host (loader threads)  records = one read of the batch; sizes from their headers;
                           boxes, then flips, drawn from the batch's generator exactly as
                           ``decode_crop_batch`` draws them -> an EncodedBatch (no pixels)
    device                 decode_jpeg(records, device=...) (nvjpeg on CUDA), each box cropped
                           and resized there, flipped in the copy into one (B, C, h, w) batch,
                           then the rest of the device stage (normalise, ...)

so the host's cores only read and parse headers. The draws are those of the host path,
whatever the device; on ``device="cpu"`` (what the tests run) the pixels equal the host
path's exactly (the same decoder and kernel). On CUDA, nvjpeg's IDCT and the CUDA resize
round on their own: that bound against PIL is measured by ``scripts/gpu_check.py``.
A record the device cannot decode is decoded on the CPU (the host path's decoder, whose
error names the store and the sample) and copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import StoreCorruptError, TransformSpecError
from ..formats.encoding import DecodingReader, image_size
from ..transforms.batch import BatchRandomHorizontalFlip, BatchRandomResizedCrop


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
    where = str(getattr(reader.raw, "path", "store"))
    records = reader.records(idx)
    sizes = torch.tensor([image_size(r, where=f"{where} sample {i}") for r, i in zip(records, idx)],
                         dtype=torch.long).reshape(-1, 2)
    drawn = crop.sample_sizes(sizes[:, 0], sizes[:, 1], generator=generator)
    boxes = torch.stack([drawn[k].to(torch.long).reshape(-1) for k in ("top", "left", "height", "width")], dim=1)
    flips = (flip.sample((len(idx), 1, *crop.size), generator=generator)["flip"].reshape(-1) if flip is not None
             else torch.zeros(len(idx), dtype=torch.bool))
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
        self.size = list(crop.size)
        self.antialias = crop.antialias

    def _decoded(self, batch: EncodedBatch, device: torch.device) -> list[torch.Tensor | None]:
        """Each record decoded on ``device``; None where it must go through the CPU decoder."""
        if device.type == "cpu":   # the host path's own decode, with its once-per-reader check against PIL
            images = self.reader._decode_batch([r.numpy() for r in batch.records])
            return list(images) if images is not None else [None] * len(batch)
        from torchvision.io import decode_jpeg

        try:
            return list(decode_jpeg(batch.records, device=device))
        except RuntimeError:     # a record that does not decode: each on the CPU, whose error names it
            return [None] * len(batch)

    def __call__(self, batch: EncodedBatch, device: torch.device) -> torch.Tensor:
        from torchvision.transforms.v2 import functional as F

        where = self.reader._where
        out = torch.empty((0, 3, *self.size), dtype=torch.uint8, device=device)
        for j, (image, i) in enumerate(zip(self._decoded(batch, device), batch.indices)):
            if image is None or image.shape[0] not in (1, 3):   # CMYK, or undecodable there: the CPU decoder
                sample, _ = self.reader.decode_record(batch.records[j].numpy(), i)
                image = torch.from_numpy(sample).to(device)
            if tuple(image.shape[1:]) != tuple(batch.sizes[j].tolist()):
                raise StoreCorruptError(f"{where} sample {i}: decodes to {tuple(image.shape[1:])}, its "
                                        f"header says {tuple(batch.sizes[j].tolist())}")
            if j == 0:
                out = torch.empty((len(batch), image.shape[0], *self.size), dtype=torch.uint8, device=device)
            elif image.shape[0] != out.shape[1]:
                raise TransformSpecError(f"{where}: cannot batch samples of {out.shape[1]} and "
                                         f"{image.shape[0]} channels (sample {i}); convert with one colour mode")
            t, left, h, w = batch.boxes[j].tolist()
            resized = F.resized_crop(image, t, left, h, w, self.size, antialias=self.antialias)
            out[j] = resized.flip(-1) if batch.flips[j] else resized
        return out

    def __repr__(self) -> str:
        return f"DeviceDecode(jpeg, RandomResizedCrop {self.size})"


def decodes_on_device(dataset: Any) -> bool:
    """Whether ``dataset``'s batches can go to a device as records: a JPEG store whose dynamic part
    begins with the crop run at decode time, exact (not ``reduced_decode``), and then (after the
    flip) holds nothing more for the host."""
    reader = getattr(dataset, "reader", None)
    return (isinstance(reader, DecodingReader) and reader.manifest["sample"].get("encoding") == "jpeg"
            and getattr(dataset, "decode_crop", None) is not None and not dataset.reduced_decode
            and not dataset._batch_rest)
