"""The batch transforms' kernels for CPU tensors in numpy: one thread, the GIL released, no torch pool.

torch runs ``where`` / ``masked_fill`` over a batch on its intra-op pool, an OpenMP team
that waits at a barrier for its slowest member: on a busy machine every batch waits for a
member the scheduler left off a core (docs/reading.md, shared machines). A loader already
builds batches in parallel (threads, worker processes), so these kernels do a batch on the
calling thread, in numpy copies that release the GIL, one call a sample: the pixels of the
torch kernels they stand for (``BatchRandomHorizontalFlip``, ``BatchCutout``), bit for bit,
and faster on one core than torch's on two (a flip copies each sample once, where
``torch.where(flip, x.flip(-1), x)`` flips the whole batch first).

They take what ``numpy_view`` accepts (a contiguous CPU tensor of a dtype numpy has, not
requiring grad) and return a new tensor; anything else stays on the torch kernel.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .functional import copy_reversed

# torch dtypes without a numpy equivalent (or whose numpy view would change the values' meaning)
_NO_NUMPY = (torch.bfloat16, torch.complex32)


def numpy_view(images: torch.Tensor) -> np.ndarray | None:
    """``images`` as a numpy array sharing its memory, or None where the numpy kernels do not apply."""
    if images.device.type != "cpu" or images.requires_grad or images.dtype in _NO_NUMPY \
            or not images.is_contiguous() or images.is_quantized or images.dtype.is_complex:
        return None
    return images.numpy()


def flip_samples(images: np.ndarray, flips: np.ndarray) -> torch.Tensor:
    """A copy of the (B, C, H, W) ``images`` with sample k reversed along W where ``flips[k]``."""
    out = np.empty_like(images)
    for k, flipped in enumerate(flips.tolist()):
        if flipped:
            copy_reversed(out[k], images[k])
        else:
            np.copyto(out[k], images[k])
    return torch.from_numpy(out)


def cutout_samples(images: np.ndarray, dtype: torch.dtype, tops: np.ndarray, lefts: np.ndarray, size: int,
                   fill: Any) -> torch.Tensor | None:
    """A copy of ``images`` with a ``size`` square at (tops[k], lefts[k]) of sample k set to ``fill``.

    The fill is converted as torch converts it (``masked_fill`` for a number, ``.to(dtype)``
    for one value per channel), so the bytes are the torch kernel's; None when a per-channel
    fill does not match the channels (the torch kernel then raises its own error).
    """
    if isinstance(fill, tuple):
        value = torch.tensor(fill).to(dtype)
        if value.numel() not in (1, images.shape[1]):
            return None
        value = value.numpy().reshape(-1, 1, 1)
    else:
        value = torch.zeros(1, dtype=dtype).masked_fill_(torch.ones(1, dtype=torch.bool), fill).numpy()[0]
    out = images.copy()
    for k, (top, left) in enumerate(zip(tops.tolist(), lefts.tolist())):
        out[k, :, top:top + size, left:left + size] = value
    return torch.from_numpy(out)
