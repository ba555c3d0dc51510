"""``if rank == 0: dlstore.convert(...)`` inside a real 2-process gloo group converts alone.

The Python API converts in one process unless ``distributed=True`` is passed:
rank 0 must not join a collective (``new_group``, a broadcast) that rank 1 never
enters, which would wait until the group's timeout.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from dlstore.sources.demo import make_image_folder


def _rank(rank: int, src: str, dst: str, init: str) -> None:
    import dlstore

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        if rank == 0:
            started = time.monotonic()
            result = dlstore.convert(src, dst, workers=0, progress=False)  # distributed=None: alone
            assert result.count == 6 and time.monotonic() - started < 50
        dist.barrier()  # both ranks meet here only if rank 0 did not wait in a collective
        if rank == 1:
            assert len(dlstore.open_dataset(dst)) == 6
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_rank_zero_alone_converts_without_joining_a_collective(tmp_path):
    src = make_image_folder(tmp_path / "images", classes=2, per_class=3, size=(16, 16))
    dst = tmp_path / "s.shards"
    init = f"file://{tmp_path / 'rendezvous'}"
    ctx = mp.start_processes(_rank, args=(str(src), str(dst), init), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    os.kill(p.pid, 9)
            pytest.fail("the rank-0-only conversion did not finish: it waited in a collective")
    assert dst.is_dir()
