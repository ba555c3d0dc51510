"""Readers' handles: opened lazily, once per process, under one lock; dropped on pickling."""

from __future__ import annotations

import os
import threading
from typing import Any

# Held while a reader opens its handles. Threads that use a reader for the first time at
# once would otherwise all open it: one sees the handles another has just reset to None,
# and LMDB refuses a second open of the environment ("already open"). An RLock: an open
# may open another reader. A fork while some thread holds it would copy it held, so the
# child starts with a fresh one.
_OPEN_LOCK = threading.RLock()


def _fresh_open_lock() -> None:
    global _OPEN_LOCK
    _OPEN_LOCK = threading.RLock()


os.register_at_fork(after_in_child=_fresh_open_lock)


def open_lock() -> threading.RLock:
    """The lock every lazy open of a reader's handles holds (this process's)."""
    return _OPEN_LOCK


class ForkSafe:
    """Mixin for readers: handles opened lazily, once per process, dropped on pickling.

    Subclasses keep every open handle in attributes listed in ``_handles`` and
    call ``self._ensure_open()`` before use; it reopens after a fork. The first
    use may come from several threads at once: one opens, the others wait for it.
    """

    _handles: tuple[str, ...] = ()

    def ensure_open(self) -> None:
        """Open the handles in this process now, if they are not (a loader calls it before its threads
        start, so that an error about the store comes from the caller's thread)."""
        self._ensure_open()

    def _ensure_open(self) -> None:
        if getattr(self, "_pid", None) == os.getpid():
            return          # open in this process; _pid is set only once every handle is
        with open_lock():
            if getattr(self, "_pid", None) != os.getpid():
                for name in self._handles:
                    setattr(self, name, None)
                self._open()
                self._pid = os.getpid()

    def _open(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in self._handles:
            state[name] = None
        state["_pid"] = None
        return state
