"""What fits on the device: the memory free for a GPUDataset after the headroom, and the
message when its preload does not fit."""

from __future__ import annotations

from typing import Any

import torch

from ...units import human_bytes

# Kept free on a CUDA device on top of the dataset: the model, activations and the
# allocator's own slack have to live somewhere.
MIN_HEADROOM = 1 << 30
HEADROOM_FRACTION = 0.05


def free_memory(device: torch.device, headroom: int | None) -> tuple[int | None, int]:
    """(bytes free for the dataset on ``device`` after the headroom, headroom), or None if unknown."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        keep = max(MIN_HEADROOM, int(total * HEADROOM_FRACTION)) if headroom is None else int(headroom)
        return max(0, free - keep), keep
    if device.type == "cpu":
        keep = MIN_HEADROOM if headroom is None else int(headroom)
        try:
            with open("/proc/meminfo", encoding="ascii") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return max(0, int(line.split()[1]) * 1024 - keep), keep
        except OSError:
            pass
        return None, keep
    return None, 0


def overflow_message(name: Any, n: int, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
                     needed: int, uint8_bytes: int, work: int, limit: int, max_memory: int | None, keep: int,
                     on_overflow: str) -> str:
    """The DeviceMemoryError message: what the preload needs, what is free, and the options (each
    a number the message quotes: hence many arguments)."""
    c, h, w = shape
    dtype_name = str(dtype).removeprefix("torch.")
    where = (f"max_memory={human_bytes(limit)}" if max_memory is not None and limit == max_memory
             else f"{human_bytes(limit)} free on {device} after keeping {human_bytes(keep)} headroom")
    lines = [
        f"{name}: {n:,} samples of {c}x{h}x{w} {dtype_name} need {human_bytes(needed)}"
        + (f" (+ {human_bytes(work)} of preload buffers)" if work else "")
        + f" on {device}, but only {where}.",
    ]
    if on_overflow == "uint8":
        lines.append(f"Even uint8 (on_overflow='uint8') needs {human_bytes(uint8_bytes)}.")
    lines.append("Options:")
    if on_overflow != "uint8" and dtype != torch.uint8:
        fit = "fits" if uint8_bytes <= limit else "does not fit either"
        lines.append(f"  on_overflow='uint8'   keep uint8 on the device, convert per batch "
                     f"({human_bytes(uint8_bytes)}: {fit})")
    lines.append("  on_overflow='stream'  read batches from the store through pinned memory")
    lines.append("  max_memory=BYTES / headroom=BYTES  change the budget; a smaller chunk_size "
                 "shrinks the preload buffers")
    return "\n".join(lines)
