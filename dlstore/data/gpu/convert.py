"""The conversion a GPUDataset serves its samples through: uint8 -> ``dtype``, normalised.

``ToDtype(float32, scale=True)`` (``x * (1 / 255)``), then ``(x - mean) / std`` when
normalising, in float32, then one cast to ``dtype``: the numbers of torchvision's
``ToDtype(scale=True)`` + ``Normalize``, rounded once. The preload (a block at a time,
through a workspace) and the per-batch path run the very same operations, so both
give the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...errors import ArgumentError


class Conversion:
    """uint8 images on the device -> ``dtype`` (float dtypes scaled to [0, 1], then normalised).

    Args:
        dtype: the served dtype; ``torch.uint8`` serves the stored bytes unchanged.
        normalize: ``(mean, std)``, 1 or ``channels`` values each, or None.
        channels: C of a sample.
        device: where mean and std are kept.
    """

    def __init__(self, dtype: torch.dtype, normalize: tuple[Sequence[float], Sequence[float]] | None,
                 channels: int, device: torch.device):
        self.dtype = dtype
        self.mean: torch.Tensor | None = None
        self.std: torch.Tensor | None = None
        if normalize is not None:
            mean, std = normalize
            mean_t = torch.as_tensor(mean, dtype=torch.float32).reshape(-1)
            std_t = torch.as_tensor(std, dtype=torch.float32).reshape(-1)
            if mean_t.numel() not in (1, channels) or std_t.numel() not in (1, channels):
                raise ArgumentError(f"normalize needs 1 or {channels} values for mean and std, got "
                                    f"{mean_t.numel()} and {std_t.numel()}")
            if (std_t == 0).any():
                raise ArgumentError(f"normalize: std must not be zero, got {std_t.tolist()}")
            self.mean = mean_t.view(1, -1, 1, 1).to(device)
            self.std = std_t.view(1, -1, 1, 1).to(device)

    def to_float32(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(torch.float32).mul_(1.0 / 255.0)
        if self.mean is not None:
            x.sub_(self.mean).div_(self.std)
        return x

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """A uint8 batch on the device -> what ``dtype`` promises."""
        if self.dtype == torch.uint8:
            return images
        return self.to_float32(images).to(self.dtype)

    def into(self, images: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor | None) -> None:
        """Write uint8 ``images`` (on the device, or a host chunk on CPU) into ``out``.

        Float output goes through ``workspace`` (float32) a block at a time, with the
        same operations as :meth:`to_float32`, so both give identical numbers.
        """
        if workspace is None:
            out.copy_(images)
            return
        for b in range(0, len(images), len(workspace)):
            e = min(len(images), b + len(workspace))
            x = workspace[:e - b]
            x.copy_(images[b:e])
            x.mul_(1.0 / 255.0)
            if self.mean is not None:
                x.sub_(self.mean).div_(self.std)
            out[b:e].copy_(x)

    def __repr__(self) -> str:
        return f"Conversion(uint8 -> {str(self.dtype).removeprefix('torch.')}, normalised={self.mean is not None})"
