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


STATE_VERSION = 1


class PassState:
    """Where a loader stands in its epoch, for ``state_dict()`` / ``load_state_dict()``.

    A pass is reproducible from two things: the state of the loader's generator (or
    torch's default one) when the pass began, which draws the pass's base seed and the
    shuffle, and the epoch. So the saved state is that generator state, the epoch and
    the number of batches handed out; a pass resumed from it restores the generator,
    skips those batches without building them, and hands out the rest with the same
    indices and augmentations as the uninterrupted pass (batch k's draws depend only
    on (base, epoch, k)). Between passes the state is the generator's as it is, so the
    next epoch resumes too.
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None   # loaded, applied when the next pass begins
        self._began: Any = None                       # generator state at the start of the pass in progress
        self._epoch = 0
        self.served = 0                               # batches of that pass handed out

    def begin(self, generator: Any, epoch: int) -> int:
        """Called as a pass starts, before it draws anything: the batches to skip."""
        import torch

        g = generator if generator is not None else torch.default_generator
        skip = 0
        if self._pending is not None:
            g.set_state(self._pending["generator"])
            skip = self._pending["batches"]
            self._pending = None
        self._began, self._epoch, self.served = g.get_state(), epoch, skip
        return skip

    def end(self) -> None:
        """Called when a pass has handed out its last batch."""
        self._began, self.served = None, 0

    def skip_next(self, generator: Any, batches: int, epoch: int) -> None:
        """Have the next pass skip ``batches`` from the generator's state as it is now (a loader
        that wraps this one restored the state and drew from it already)."""
        import torch

        g = generator if generator is not None else torch.default_generator
        self._pending = {"version": STATE_VERSION, "epoch": epoch, "batches": batches, "generator": g.get_state()}

    def state_dict(self, generator: Any, epoch: int) -> dict[str, Any]:
        import torch

        if self._pending is not None:    # loaded and not started yet: still that state
            return dict(self._pending)
        if self._began is not None:
            return {"version": STATE_VERSION, "epoch": self._epoch, "batches": self.served,
                    "generator": self._began.clone()}
        g = generator if generator is not None else torch.default_generator
        return {"version": STATE_VERSION, "epoch": epoch, "batches": 0, "generator": g.get_state()}

    def load_state_dict(self, state: dict[str, Any], batches: int) -> int:
        """Keep ``state`` for the next pass; its epoch. ``batches``: the length of an epoch."""
        import torch

        from ..errors import ArgumentError

        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ArgumentError(f"load_state_dict takes what state_dict() returned (version {STATE_VERSION}), "
                                f"got {type(state).__name__} {state.get('version') if isinstance(state, dict) else ''}")
        served, epoch, rng = state.get("batches"), state.get("epoch"), state.get("generator")
        if not isinstance(served, int) or not 0 <= served <= batches or not isinstance(epoch, int) \
                or not isinstance(rng, torch.Tensor):
            raise ArgumentError(f"load_state_dict: a damaged state (batches={served!r} of an epoch of {batches}, "
                                f"epoch={epoch!r}, generator {type(rng).__name__})")
        self._pending = {"version": STATE_VERSION, "epoch": epoch, "batches": served, "generator": rng.clone()}
        return epoch
