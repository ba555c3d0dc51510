"""What the GPU loader, its steps, the fused gather and the preload use of a dataset held on a device.

:class:`~dlstore.data.gpu.GPUDataset` is the one implementation; the modules that serve
it name this Protocol rather than the class, so that the dataset (which builds on them)
and they never import each other.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from .convert import Conversion


class Resident(Protocol):
    """A fixed-shape dataset held on ``device`` (see :class:`~dlstore.data.gpu.GPUDataset`)."""

    source: Any                           # the dataset read from (``manifest``/``path`` when a store)
    shape: tuple[int, int, int]           # (C, H, W) of a sample as stored
    device: torch.device
    dtype: torch.dtype                    # what batches are served as
    mode: str                             # "preload", "uint8" or "stream"
    data: torch.Tensor | None             # the held (N, C, H', W') tensor, padding included
    labels: torch.Tensor
    padding: tuple[int, int, int, int]    # (left, top, right, bottom) held around each sample
    padding_mode: str
    held_fill: torch.Tensor | None        # (C,) the constant padding's value as held
    normalize: Any
    conversion: Conversion                # uint8 -> ``dtype``
    pin: bool                             # host buffers are pinned (CUDA)
    rank: int
    world_size: int
    sharded: bool
    total_samples: int

    def __len__(self) -> int: ...

    def held_samples(self) -> torch.Tensor | None: ...

    def read(self, indices: np.ndarray) -> torch.Tensor: ...

    def read_into(self, indices: np.ndarray, out: torch.Tensor) -> torch.Tensor: ...
