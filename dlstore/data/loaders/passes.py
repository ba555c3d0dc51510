"""One pass of a loader: what its back-end is asked to build, and the iterator the user holds."""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

from .seeds import batch_seed


@dataclass
class PassPlan:
    """One pass (an epoch, or its rest after ``load_state_dict``), as a loader hands it to its back-end.

    Attributes:
        epoch: the pass's epoch.
        base: the pass's base seed (drawn from the pass generator).
        rank: this process's rank (mixed into the seeds).
        first: the first batch to build (the batches before it were handed out before a resume).
        order: ``(k, indices)`` of every batch of the epoch, in order, from 0.
    """

    epoch: int
    base: int
    rank: int
    first: int
    order: Iterator[tuple[int, Any]]

    @functools.cached_property
    def batches(self) -> Iterator[tuple[int, Any]]:
        """``(k, indices)`` of each batch to build, from ``first`` on (the ones before are not built)."""
        return itertools.islice(self.order, self.first, None)

    def seed(self, k: int, stream: int = 0) -> int:
        """The seed of batch ``k``'s draws (``stream``: which stage draws, see ``seeds``)."""
        return batch_seed(self.base, self.epoch, k, self.rank, stream)


class LoaderIterator:
    """One pass's iterator: a generator, closed when the iterator is dropped or, at the latest, at exit.

    Closing runs the generator's ``finally`` (threads joined, workers stopped). An iterator
    still alive when the interpreter exits would otherwise be closed while modules are being
    torn down, their globals already None (a thread pool's shutdown then fails on
    ``queue.Empty`` and Python prints "Exception ignored in: <generator ...>");
    ``weakref.finalize`` callbacks run at exit, before that. ``before_close`` runs first,
    with the generator not yet closed (a generator never advanced does not run its
    ``finally``: what it started outside itself is stopped there).
    """

    def __init__(self, batches: Generator[Any, None, None], before_close: Callable[[], None] | None = None):
        self._batches = batches
        # the callback holds the generator, never this object (or it would never be collected)
        self._finish = weakref.finalize(self, _finish, batches, before_close)

    def __iter__(self) -> LoaderIterator:
        return self

    def __next__(self) -> Any:
        return next(self._batches)

    def close(self) -> None:
        """Stop the pass now (as ``generator.close()``); a finalizer runs at most once."""
        self._finish()


def _finish(batches: Generator[Any, None, None], before_close: Callable[[], None] | None) -> None:
    if before_close is not None:
        before_close()
    batches.close()
