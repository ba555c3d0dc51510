"""The padding a GPUDataset can hold around each sample (``padding=``), as torchvision pads.

The dataset writes each preloaded chunk's border once (:func:`pad_border`); a loader
whose first op is a crop with that same padding reads the padded copy instead of
padding every batch (:func:`unpadded_crop`): the same pixels. Every index map is
torchvision's own ``F.pad`` applied to ``arange`` (:func:`pad_map`), so every padding
mode matches it exactly.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ...transforms.batch import BatchRandomCrop
from .resident import Resident

NO_PADDING = (0, 0, 0, 0)


def pad_map(size: int, before: int, after: int, mode: str) -> torch.Tensor:
    """Source index of each position of an axis of ``size`` padded by (before, after), -1 for the fill.

    torchvision's ``F.pad`` applied to ``arange(size)``: exactly its index arithmetic for
    every padding mode (and its errors, e.g. reflect padding wider than the image).
    """
    from torchvision.transforms.v2 import functional as F

    line = torch.arange(size, dtype=torch.float64).view(1, size, 1)
    if mode == "constant":
        padded = F.pad(line, [0, before, 0, after], fill=-1.0)
    else:
        padded = F.pad(line, [0, before, 0, after], padding_mode=mode)
    return padded.view(-1).round().long()


def fill_vector(fill: Any, channels: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """(C,) the value ``F.pad(images of dtype, fill=fill)`` writes into each channel."""
    from torchvision.transforms.v2 import functional as F

    fill = list(fill) if isinstance(fill, tuple) else fill
    pixel = F.pad(torch.zeros((channels, 1, 1), dtype=dtype), [1, 0, 0, 0], fill=fill)[:, 0, 0]
    return pixel.to(device)


def interior(data: torch.Tensor, padding: tuple[int, int, int, int], shape: tuple[int, int, int]) -> torch.Tensor:
    """The samples of shape ``shape`` inside ``data``'s held ``padding`` (a view; ``data`` without padding)."""
    left, top, _, _ = padding
    _, h, w = shape
    return data if padding == NO_PADDING else data[:, :, top:top + h, left:left + w]


def pad_border(chunk: torch.Tensor, padding: tuple[int, int, int, int], shape: tuple[int, int, int],
               mode: str, fill: torch.Tensor | None) -> None:
    """Write the border of ``chunk`` (its interior written), as ``F.pad`` pads each sample;
    ``fill``: the (C,) value of constant padding as held."""
    if padding == NO_PADDING:
        return
    left, top, right, bottom = padding
    _, h, w = shape
    if mode == "constant":
        value = fill.view(1, -1, 1, 1)
        for border in (chunk[:, :, :top], chunk[:, :, top + h:], chunk[:, :, :, :left], chunk[:, :, :, left + w:]):
            border.copy_(value.expand_as(border))
        return
    rows = pad_map(h, top, bottom, mode).to(chunk.device) + top
    cols = pad_map(w, left, right, mode).to(chunk.device) + left
    chunk.copy_(chunk.index_select(2, rows).index_select(3, cols))


def unpadded_crop(op: BatchRandomCrop, ds: Resident) -> BatchRandomCrop:
    """``op`` reading ``ds``'s padded resident copy when its padding is the dataset's, else ``op``.

    The copy has no padding of its own; its draws are the same (the padded image has
    the same size), so it gives the same pixels as ``op`` on the unpadded samples.
    """
    h, w = ds.shape[1:]
    if ds.data is None or op.padding_for(h, w) != ds.padding or op.padding_mode != ds.padding_mode:
        return op
    # the fill as held (the loader's plan already maps a crop's fill to held values)
    if op.padding_mode == "constant" and not torch.equal(
            fill_vector(op.fill, ds.shape[0], ds.data.dtype, "cpu"), ds.held_fill.cpu()):
        return op
    reads = copy.copy(op)
    reads.padding = (0, 0, 0, 0)
    reads.pad_if_needed = False
    return reads
