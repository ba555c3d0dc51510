"""``collate_fn`` with DataLoader's meaning, on batches that dlstore builds whole.

DataLoader calls ``collate_fn(samples)`` with the list of ``(image, target)`` samples of a
batch. dlstore builds the batch whole (a gather, batch transforms), so ``run_collate``
gives the function that list, made of views of the batch (``images.unbind(0)``, the
targets as ``ds[i]`` gives them: ints, or (K,) tensors): ``default_collate`` of it is
the batch itself, and ``lambda b: mixup_cutmix(*default_collate(b))`` (torchvision's
reference script) runs unchanged. ``default_collate`` itself is skipped (it would only
stack the batch again). A collate that draws (MixUp, CutMix draw from torch's global
generator) draws reproducibly: the generators are seeded with the batch's collate seed
for the call and restored after (``fork_rng``).

Where it runs: in the DataLoader back-end's worker processes, else in the thread that
iterates the loader, after the device stage (``device=``), as DataLoader's collate sees
the batch after the transform. Not in loader threads: torch's global generator is one per
process, and seeding it from a builder thread would race with the training loop's draws.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from ...transforms.wrappers import GLOBAL_GENERATORS


def is_default(collate_fn: Any) -> bool:
    """Whether ``collate_fn`` is DataLoader's default (dlstore's batches are already collated)."""
    return collate_fn is None or collate_fn is default_collate


def as_samples(batch: Any) -> list[tuple[Any, Any]]:
    """A built ``(images, targets)`` batch as DataLoader would hand it to ``collate_fn``: one
    ``(image, target)`` per sample, targets as ``ds[i]`` gives them."""
    images, targets = batch
    rows = images.unbind(0) if isinstance(images, torch.Tensor) else list(images)
    if isinstance(targets, torch.Tensor):
        targets = targets.tolist() if targets.ndim == 1 else list(targets.unbind(0))
    return list(zip(rows, targets))


def run_collate(collate_fn: Callable[[Any], Any], batch: Any, seed: int) -> Any:
    """``collate_fn`` of ``batch``'s samples, torch's, numpy's and Python's generators seeded with ``seed``
    for the call (restored after)."""
    samples = as_samples(batch)
    devices = [d.index if d.index is not None else torch.cuda.current_device()
               for d in {batch[0].device} if d.type == "cuda"] if isinstance(batch[0], torch.Tensor) else []
    with GLOBAL_GENERATORS:     # loader threads seed them for per-sample ops at the same time
        return _seeded_call(collate_fn, samples, seed, devices)


def _seeded_call(collate_fn: Callable[[Any], Any], samples: list[Any], seed: int, devices: list[int]) -> Any:
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices):
            torch.default_generator.manual_seed(seed)
            for d in devices:
                torch.cuda.default_generators[d].manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed % (1 << 32))
            return collate_fn(samples)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
