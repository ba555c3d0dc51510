"""The torch DataLoader back-end of ``dlstore.loader``: one ``get_batch`` per batch, in worker
processes or in this one, resumable mid-epoch.

It is a ``torch.utils.data.DataLoader`` (an index list per batch in, the batch out, no
collate), with ``state_dict()`` / ``load_state_dict()``. Its workers draw per-sample
randomness from torch's generator, seeded per worker from the loader's generator: a
batch's draws depend on every batch its worker built before it. So a resumed pass
restores the generator and builds the batches already handed out again, unseen, before
handing out the rest: the same batches as the uninterrupted pass, at the cost of
rebuilding the skipped ones (the threads and the shared-memory ring skip them unbuilt).

With ``num_workers=0`` a batch is built in the caller's thread, its torch ops on that
thread alone (``intraop.one_thread``), so a busy machine does not stall them; pinning
(``pin_memory=True``) is torch's, on its own thread.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from ..dataset import StoreDataset
from ..intraop import one_thread
from ..passes import LoaderIterator, PassState


class _Batches(Dataset):
    """Index lists in, ``StoreDataset.get_batch`` out: what ``loader`` iterates over.

    In the main process (``num_workers=0``) the random parameters come from the
    loader's generator; in a worker from torch's default generator, which the
    DataLoader seeds per worker from that same generator.
    """

    def __init__(self, dataset: StoreDataset, generator: torch.Generator | None):
        self.dataset = dataset
        self.generator = generator

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: Sequence[int]) -> tuple[torch.Tensor, Any]:
        if get_worker_info() is not None:     # a worker: torch runs one intra-op thread there
            return self.dataset.get_batch(indices)
        # in the caller's thread (num_workers=0): the batch's torch ops on that thread alone,
        # whatever torch's setting, which stays the caller's for its own code (see intraop)
        with one_thread():
            return self.dataset.get_batch(indices, generator=self.generator)

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "generator": None}   # workers use their seeded default


def _as_is(batch: Any) -> Any:
    return batch


class StoreDataLoader(DataLoader):
    """A DataLoader over a StoreDataset's batches (``batch_sampler`` yields index lists), resumable."""

    def __init__(self, dataset: Any, batch_sampler: Any, *, generator: torch.Generator | None = None,
                 **options: Any):
        super().__init__(_Batches(dataset, generator), sampler=batch_sampler, batch_size=None, collate_fn=_as_is,
                         generator=generator, **options)
        self._state = PassState()

    def _epoch(self) -> int:
        return int(getattr(self.sampler, "epoch", 0))

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the batch sampler (the distributed shuffle)."""
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands in its epoch (see ``ThreadLoader.state_dict``)."""
        return self._state.state_dict(self.generator, self._epoch())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next pass rebuilds the batches already handed out, unseen."""
        self.set_epoch(self._state.load_state_dict(state, len(self)))

    def __iter__(self) -> Iterator[Any]:
        skip = self._state.begin(self.generator, self._epoch())
        return LoaderIterator(self._pass(super().__iter__(), skip))

    def _pass(self, batches: Iterator[Any], skip: int) -> Generator[Any, None, None]:
        for _ in range(skip):
            next(batches)
        for batch in batches:
            self._state.served += 1
            yield batch
        self._state.end()
