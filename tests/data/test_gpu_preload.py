"""The preload's ring of host buffers: order, bounded read-ahead, errors, buffer reuse after the event."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlstore.data.gpu.preload import ChunkRing


class Event:
    """A copy finishing later: synchronize() waits until set (threading, as a CUDA event would)."""

    def __init__(self):
        self._done = threading.Event()

    def synchronize(self):
        assert self._done.wait(5)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(chunks=st.integers(0, 12), ring=st.integers(1, 5), readers=st.integers(1, 4))
def test_chunks_come_in_order_with_at_most_ring_outstanding(chunks, ring, readers):
    bounds = [(k, k + 1) for k in range(chunks)]
    lock = threading.Lock()
    busy: dict[int, int] = {}       # slot -> chunk being read or in use
    worst = [0]

    def read(b, slot):
        with lock:
            assert slot not in busy, f"slot {slot} refilled while chunk {busy.get(slot)} uses it"
            busy[slot] = b[0]
            worst[0] = max(worst[0], len(busy))
        time.sleep(0.001)
        return b[0], slot

    r = ChunkRing(bounds, read, ring=ring, readers=readers)
    try:
        got = []
        for _ in bounds:
            k, slot = r.get()
            assert slot == k % ring
            got.append(k)
            with lock:
                del busy[slot]
            r.done()
    finally:
        r.close()
    assert got == list(range(chunks)) and worst[0] <= ring


def test_a_buffer_is_refilled_only_after_its_event():
    order = []
    events = []

    def read(b, slot):
        order.append(("read", b[0]))
        return b[0]

    r = ChunkRing([(k, k + 1) for k in range(3)], read, ring=1, readers=1)
    try:
        assert r.get() == 0
        e = Event()
        events.append(e)
        r.done(e)                   # chunk 1 must wait for chunk 0's copy
        time.sleep(0.05)
        assert ("read", 1) not in order
        order.append(("copied", 0))
        e._done.set()
        assert r.get() == 1 and order.index(("copied", 0)) < order.index(("read", 1))
        r.done()
        assert r.get() == 2
    finally:
        r.close()


def test_an_error_in_a_reader_reaches_the_consumer_and_no_thread_survives():
    def read(b, slot):
        if b[0] == 2:
            raise OSError("disk gone")
        return b[0]

    r = ChunkRing([(k, k + 1) for k in range(6)], read, ring=3, readers=2)
    with pytest.raises(OSError, match="disk gone"):
        try:
            for _ in range(6):
                r.get()
                r.done()
        finally:
            r.close()
    assert not any(t.name.startswith("dlstore-prefetch") for t in threading.enumerate())
