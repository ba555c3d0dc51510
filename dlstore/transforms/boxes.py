"""The crop boxes of ``RandomResizedCrop``, drawn for many samples at once, each of its own size.

``random_resized_boxes`` draws as ``v2.RandomResizedCrop.get_params`` draws for one image
(up to 10 tries of a uniform area fraction in ``scale`` and a log-uniform aspect ratio in
``ratio``, the first that fits wins, else torchvision's centre-crop fallback), vectorised
over a batch whose samples may differ in size: the box of a JPEG record can be drawn from
its header's size before the record is decoded (``dlstore.data.decode_crop``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def random_resized_boxes(heights: torch.Tensor, widths: torch.Tensor, scale: Sequence[float],
                         ratio: Sequence[float], *, generator: Any = None) -> dict[str, torch.Tensor]:
    """``{"top", "left", "height", "width"}`` (int64, (B,)) for images of ``heights`` x ``widths``.

    Draws ``torch.rand(4, B)`` (float64) from ``generator`` per try, on the device of ``heights``.
    """
    device = heights.device
    b = len(heights)
    heights, widths = heights.to(torch.int64), widths.to(torch.int64)
    area = (heights * widths).to(torch.float64)
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    # the 10 tries at once, (10, B) each (a loop over tries is ~200 small ops a batch, each holding the
    # GIL); drawn as 10 rand(4, B) calls, in order, so the draws are those of a loop on any device
    u = torch.stack([torch.rand(4, b, generator=generator, device=device, dtype=torch.float64) for _ in range(10)], 1)
    target = area * (scale[0] + u[0] * (scale[1] - scale[0]))
    aspect = torch.exp(log_ratio[0] + u[1] * (log_ratio[1] - log_ratio[0]))
    w = torch.round(torch.sqrt(target * aspect)).long()
    h = torch.round(torch.sqrt(target / aspect)).long()
    ok = (w > 0) & (w <= widths) & (h > 0) & (h <= heights)
    i = (u[2] * (heights - h + 1).clamp_min(1)).long()
    j = (u[3] * (widths - w + 1).clamp_min(1)).long()
    done = ok.any(0)
    first = ok.to(torch.uint8).argmax(0, keepdim=True)    # the first try that fits (argmax: the first maximum)
    top, left, ch, cw = (x.gather(0, first)[0] for x in (i, j, h, w))
    # Samples with no valid try: torchvision's centre crop at the nearest allowed ratio.
    in_ratio = widths.to(torch.float64) / heights.to(torch.float64)
    narrow, wide = in_ratio < ratio[0], in_ratio > ratio[1]
    fw = torch.where(wide, torch.round(heights.to(torch.float64) * ratio[1]).long(), widths)
    fh = torch.where(narrow, torch.round(widths.to(torch.float64) / ratio[0]).long(), heights)
    top = torch.where(done, top, torch.div(heights - fh, 2, rounding_mode="floor"))
    left = torch.where(done, left, torch.div(widths - fw, 2, rounding_mode="floor"))
    return {"top": top, "left": left, "height": torch.where(done, ch, fh), "width": torch.where(done, cw, fw)}
