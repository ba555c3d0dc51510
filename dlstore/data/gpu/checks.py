"""The options of a GPUDataset checked before anything is allocated: the device, then the rest."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...errors import ArgumentError, ArgumentTypeError
from ...transforms.static import PADDING_MODES

ON_OVERFLOW = ("error", "uint8", "stream")
HOLD = ("dtype", "uint8")


def check_device(device: Any) -> torch.device:
    """``device`` as a torch.device that exists here; ArgumentError naming it otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ArgumentError(f"device {device!r} is not a torch device (e.g. 'cuda', 'cuda:1', 'cpu'): {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ArgumentError(f"device {device!r}: CUDA is not available here (torch.cuda.is_available() is False); "
                            "use device='cpu', which runs the same code")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ArgumentError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def check_options(*, dtype: Any, hold: str, padding_mode: str, on_overflow: str, normalize: Any,
                   chunk_size: Any, max_memory: Any, headroom: Any, shard: Any, rank: Any, world_size: Any) -> None:
    """ArgumentError (or ArgumentTypeError) naming the first option of ``GPUDataset`` that cannot work."""
    for name, value, valid in (("hold", hold, HOLD), ("padding_mode", padding_mode, PADDING_MODES),
                               ("on_overflow", on_overflow, ON_OVERFLOW)):
        if value not in valid:
            raise ArgumentError(f"{name} must be one of {', '.join(map(repr, valid))}, got {value!r}")
    if not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(f"dtype must be a torch.dtype (torch.float16, torch.uint8, ...), got {dtype!r}")
    for name, value, low in (("chunk_size", chunk_size, 1), ("max_memory", max_memory, 0), ("headroom", headroom, 0)):
        if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low):
            raise ArgumentError(f"{name} must be None or an int >= {low}, got {value!r}")
    if normalize is not None and (not isinstance(normalize, (tuple, list)) or len(normalize) != 2):
        raise ArgumentError(f"normalize must be a (mean, std) pair of per-channel sequences, got {normalize!r}")
    if not (dtype.is_floating_point or dtype == torch.uint8):
        raise ArgumentError(f"dtype must be a floating dtype or torch.uint8, got {dtype}")
    if normalize is not None and dtype == torch.uint8:
        raise ArgumentError("normalize needs a floating dtype (e.g. torch.float16), not torch.uint8")
    if not isinstance(shard, bool):
        raise ArgumentTypeError(f"shard must be True or False, got {shard!r}")
    if not shard and ((rank or 0) > 0 or (world_size or 1) > 1):
        raise ArgumentError(f"GPUDataset: rank={rank}, world_size={world_size} choose which share to hold, with "
                            "shard=True; to read one rank's share of the whole dataset pass "
                            "sampler=DistributedSampler(ds, num_replicas, rank) to dlstore.loader")
