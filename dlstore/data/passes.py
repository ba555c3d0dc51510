"""One pass of a loader over its batches, closed when dropped or at exit."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator
from typing import Any


class LoaderIterator:
    """One pass's iterator: a generator, closed when the iterator is dropped or, at the latest, at exit.

    Closing runs the generator's ``finally`` (threads joined, workers stopped, buffers
    released). An iterator still alive when the interpreter exits would otherwise be
    closed while modules are being torn down, their globals already None (a thread
    pool's shutdown then fails on ``queue.Empty`` and Python prints "Exception
    ignored in: <generator ...>"); ``weakref.finalize`` callbacks run at exit, before
    that. ``before_close`` runs first, with the generator not yet closed.
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
