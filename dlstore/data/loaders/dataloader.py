"""The DataLoader back-end: a ``torch.utils.data.DataLoader`` that builds one ``get_batch`` per batch.

For pipelines whose batches have no fixed shape (a per-sample op that returns other sizes,
a ``target_transform`` returning objects) or for a caller's DataLoader options
(``worker_init_fn``, ``multiprocessing_context``, ...). The DataLoader's sampler yields the
pass's tasks, ``(k, indices, seed)``, and each batch is built from its own seed, as every
back-end builds it: in a worker, torch's global generator, numpy's and Python's ``random``
are seeded with it first (per-sample torchvision ops draw from them); in this process
(``num_workers=0``) under ``torch.random.fork_rng``, so the caller's generators are left as
they were. So the batches equal the other back-ends', and a resumed pass skips the batches
already handed out without building them.

A ``collate_fn`` runs in the workers, on the batch as samples, seeded per batch
(``collate.py``). In a worker the batch's buffer is shared memory (as ``default_collate``
allocates it), so handing it to the main process copies nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from ..intraop import one_thread
from .collate import run_collate
from .passes import PassPlan
from .seeds import COLLATE_STREAM


class _Tasks(Sampler):
    """The DataLoader's sampler: the tasks of the pass in progress (set by ``DataLoaderBackend.begin``)."""

    def __init__(self) -> None:
        self.run: PassPlan | None = None

    def __iter__(self) -> Iterator[tuple[int, Any, int, int]]:
        run = self.run        # (torch asks for a new iterator more than once per pass: each reads run.batches)
        if run is None:
            return iter(())
        return ((k, indices, run.seed(k), run.seed(k, COLLATE_STREAM)) for k, indices in run.batches)

    def __len__(self) -> int:
        return 0


class _Batches(Dataset):
    """A task in, its batch out: what the DataLoader maps over."""

    def __init__(self, dataset: Any, collate_fn: Callable[[Any], Any] | None):
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, task: tuple[int, Any, int, int]) -> Any:
        k, indices, seed, collate_seed = task
        generator = torch.Generator()
        generator.manual_seed(seed)
        if get_worker_info() is not None:     # a worker: torch runs one intra-op thread there
            _seed_globals(seed)
            shape = self.dataset.batch_shape(len(indices))
            batch = self.dataset.get_batch(indices, generator=generator, out=_shared(shape) if shape else None)
            if self.collate_fn is not None:
                batch = run_collate(self.collate_fn, batch, collate_seed)
            return batch
        # in the caller's thread (num_workers=0): its torch ops on that thread alone (see intraop),
        # its generators as they were
        with one_thread(), torch.random.fork_rng(devices=[]):
            _seed_globals(seed)
            return self.dataset.get_batch(indices, generator=generator)


def _seed_globals(seed: int) -> None:
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))


def _shared(shape: tuple[int, ...]) -> torch.Tensor:
    """A uint8 tensor in shared memory, allocated as torch's default_collate allocates a worker's batch."""
    elem = torch.empty(0, dtype=torch.uint8)
    storage = elem.untyped_storage()._new_shared(int(np.prod(shape)), device="cpu")
    return elem.new(storage).resize_(*shape)


def _as_is(batch: Any) -> Any:
    return batch


class DataLoaderBackend:
    """Builds a pass's batches with a torch DataLoader (in its worker processes when ``num_workers > 0``).

    Args:
        dataset: a StoreDataset.
        num_workers, pin_memory, persistent_workers, prefetch_factor, multiprocessing_context,
            worker_init_fn: as the DataLoader's.
        collate_fn: run in the workers (with workers; else the loader runs it), see ``collate.py``.
    """

    name = "dataloader"

    def __init__(self, dataset: Any, *, num_workers: int, pin_memory: bool = False, persistent_workers: bool = False,
                 prefetch_factor: int | None = None, multiprocessing_context: Any = None,
                 worker_init_fn: Callable[[int], None] | None = None,
                 collate_fn: Callable[[Any], Any] | None = None, timeout: float = 0):
        self.tasks = _Tasks()
        self.collates = num_workers > 0 and collate_fn is not None
        options: dict[str, Any] = {}
        if num_workers > 0:
            options.update(persistent_workers=persistent_workers, prefetch_factor=prefetch_factor,
                           multiprocessing_context=multiprocessing_context, timeout=timeout)
        batches = _Batches(dataset, collate_fn if self.collates else None)
        # its own generator: the base seed torch's iterator draws (for its workers' seeds, which the tasks'
        # seeds make moot) must not move torch's default generator, the pass generator with seed=None
        self.dataloader = DataLoader(batches, sampler=self.tasks, batch_size=None, collate_fn=_as_is,
                                     num_workers=num_workers, pin_memory=pin_memory, worker_init_fn=worker_init_fn,
                                     generator=torch.Generator(), **options)

    def begin(self, run: PassPlan) -> Iterator[Any]:
        """The pass's batches; the workers start here (``iter`` of the DataLoader)."""
        self.tasks.run = run
        return iter(self.dataloader)

    def close(self) -> None:
        """Nothing to stop: torch's iterator stops its workers (persistent ones with the loader)."""

    def describe(self) -> str:
        return f"torch DataLoader, num_workers={self.dataloader.num_workers}"
