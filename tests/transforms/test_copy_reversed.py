"""``copy_reversed`` (the flip of the fused crop+flip gather) against numpy's own reversed copy.

The kernel reads rows as byte-swapped 8-byte words in reverse order, with one more
overlapping word where a row is not a whole number of words: widths around the word
size, odd offsets (unaligned words) and windows of larger arrays (non-contiguous rows)
are where it could go wrong.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dlstore.transforms.functional import copy_reversed


@settings(max_examples=300, deadline=None)
@given(c=st.integers(1, 3), h=st.integers(1, 5), w=st.integers(0, 70), margin=st.tuples(*[st.integers(0, 9)] * 4),
       seed=st.integers(0, 2**32 - 1))
def test_copy_reversed_equals_numpy_flip(c, h, w, margin, seed):
    rng = np.random.default_rng(seed)
    top, left, dtop, dleft = margin
    big = rng.integers(0, 256, (c, h + top + 3, w + left + 5), dtype=np.uint8)
    src = big[:, top:top + h, left:left + w]                 # a window: rows not contiguous, any offset
    canvas = rng.integers(0, 256, (c, h + dtop + 2, w + dleft + 7), dtype=np.uint8)
    before = canvas.copy()
    dst = canvas[:, dtop:dtop + h, dleft:dleft + w]
    copy_reversed(dst, src)
    np.testing.assert_array_equal(dst, np.flip(src, axis=-1))
    outside = np.ones(canvas.shape, bool)
    outside[:, dtop:dtop + h, dleft:dleft + w] = False
    np.testing.assert_array_equal(canvas[outside], before[outside])   # nothing written beside the window


def test_copy_reversed_of_a_non_byte_array_falls_back_to_numpy():
    src = np.arange(2 * 3 * 11, dtype=np.float32).reshape(2, 3, 11)
    dst = np.empty_like(src)
    copy_reversed(dst, src)
    np.testing.assert_array_equal(dst, src[..., ::-1])
