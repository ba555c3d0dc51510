"""random_resized_boxes: the 10 tries drawn and tested at once equal a loop over the tries."""

from __future__ import annotations

import math

import pytest
import torch

from dlstore.transforms.boxes import random_resized_boxes

BOX = ("top", "left", "height", "width")


def _loop_over_tries(heights, widths, scale, ratio, generator):
    """The draw written as a loop over the tries (the first that fits wins), as get_params reads."""
    b = len(heights)
    area = (heights * widths).to(torch.float64)
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    top, left, ch, cw = (torch.zeros(b, dtype=torch.long) for _ in range(4))
    done = torch.zeros(b, dtype=torch.bool)
    for _ in range(10):
        u = torch.rand(4, b, generator=generator, dtype=torch.float64)
        target = area * (scale[0] + u[0] * (scale[1] - scale[0]))
        aspect = torch.exp(log_ratio[0] + u[1] * (log_ratio[1] - log_ratio[0]))
        w = torch.round(torch.sqrt(target * aspect)).long()
        h = torch.round(torch.sqrt(target / aspect)).long()
        ok = (w > 0) & (w <= widths) & (h > 0) & (h <= heights) & ~done
        top = torch.where(ok, (u[2] * (heights - h + 1).clamp_min(1)).long(), top)
        left = torch.where(ok, (u[3] * (widths - w + 1).clamp_min(1)).long(), left)
        ch, cw = torch.where(ok, h, ch), torch.where(ok, w, cw)
        done |= ok
    in_ratio = widths.to(torch.float64) / heights.to(torch.float64)
    fw = torch.where(in_ratio > ratio[1], torch.round(heights.to(torch.float64) * ratio[1]).long(), widths)
    fh = torch.where(in_ratio < ratio[0], torch.round(widths.to(torch.float64) / ratio[0]).long(), heights)
    return {"top": torch.where(done, top, (heights - fh) // 2), "left": torch.where(done, left, (widths - fw) // 2),
            "height": torch.where(done, ch, fh), "width": torch.where(done, cw, fw)}


@pytest.mark.parametrize("scale, ratio", [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.9, 1.0), (0.1, 10.0)),
                                          ((0.5, 3.0), (2.0, 3.0)), ((0.01, 0.02), (1.0, 1.0))])
@pytest.mark.parametrize("b", [0, 1, 7, 32, 33])
def test_boxes_equal_a_loop_over_the_tries_and_leave_the_generator_where_it_does(scale, ratio, b):
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        heights = torch.randint(1, (4, 40, 600)[seed % 3], (b,), generator=g)
        widths = torch.randint(1, (4, 40, 600)[(seed // 3) % 3], (b,), generator=g)
        got_g, want_g = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        got = random_resized_boxes(heights, widths, scale, ratio, generator=got_g)
        want = _loop_over_tries(heights, widths, scale, ratio, want_g)
        for k in BOX:
            assert got[k].dtype == torch.int64 and torch.equal(got[k], want[k]), (k, seed)
        assert torch.equal(got_g.get_state(), want_g.get_state())      # the draws that follow stay the same
