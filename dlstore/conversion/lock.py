"""The destination lock: one conversion to a destination at a time, released with its holder.

``.NAME.dlstore-lock`` next to the destination, locked with ``flock`` (exclusive,
non-blocking), holds a JSON record of its holder::

    {"pid": 4242, "host": "node17", "since": "2024-06-01T12:00:00+00:00"}

The kernel releases a ``flock`` when the last descriptor of the open file goes, so the
lock dies with the process that took it, however it ends, provided no other process
shares the descriptor. A process forked from the holder does share it (a decode worker
of the conversion, a DataLoader worker in the same script), so the descriptor is closed in
every child multiprocessing forks (``multiprocessing.util.register_after_fork``), and it is
close-on-exec for the rest. A conversion that finds the file still there with a record in
it, and locks it, takes it over: its holder ended without releasing it (killed, or its
machine rebooted); it says so, naming that holder. One that cannot lock it names the holder
and, on this machine, the processes holding it open.

Releasing unlinks the file while still locked. A converter that opened the old file just
before the unlink and locks it just after would hold a lock nobody else can find, so a lock
counts only if the path still names the inode locked.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import multiprocessing.util
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import StoreBusyError, StoreWriteError


def lock_path(dst: Path) -> Path:
    return dst.with_name(f".{dst.name}.dlstore-lock")


class DestinationLock:
    """Exclusive, non-blocking lock on a destination; released on ``release`` or the holder's death.

    Args:
        dst: the destination (the store path); the lock file lies next to it.
        log: told when a lock left by a dead holder is taken over.
    """

    def __init__(self, dst: Path, log: Callable[[str], None] | None = None):
        self.dst = Path(dst)
        self.path = lock_path(self.dst)
        self.log = log or (lambda message: None)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock; StoreBusyError naming the holder if another process has it, StoreWriteError
        if the destination's folder cannot be written."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise unwritable(self.dst, exc) from exc
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise unwritable(self.dst, exc) from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_record(fd)
                os.close(fd)
                raise StoreBusyError(self._busy(holder)) from None
            held = os.fstat(fd)
            try:
                named = os.stat(self.path)
            except FileNotFoundError:
                named = None
            if named is not None and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
                break
            os.close(fd)   # released (and unlinked) between our open and our flock: try the new file
        previous = _read_record(fd)
        if previous:
            self.log(f"{self.dst}: taking over the lock {self.path.name} of a conversion that ended without "
                     f"releasing it ({_describe(previous)})")
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(_own_record()).encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise unwritable(self.dst, exc) from exc
        self._fd = fd
        multiprocessing.util.register_after_fork(self, DestinationLock._forget)

    def release(self) -> None:
        if self._fd is not None:
            try:
                self.path.unlink(missing_ok=True)  # while still locked: see the module doc
            finally:
                os.close(self._fd)
                self._fd = None

    def _forget(self) -> None:
        """In a forked child: close its copy of the descriptor, so the lock stays the parent's alone."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _busy(self, holder: dict[str, Any]) -> str:
        who = f" ({_describe(holder)})" if holder else ""
        generic = (f"{self.dst}: another conversion to this destination is running{who}; lock {self.path}; "
                   "wait for it or stop it")
        local = holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int)
        if holder and not (local and not _alive(holder["pid"])):
            return generic
        pids = _processes_holding(self.path)   # no record (an older dlstore), or its holder is gone
        if not pids:
            return generic
        ended = f"the conversion that locked it ({_describe(holder)}) has ended, but " if holder else ""
        return (f"{self.dst}: {ended}process(es) {', '.join(map(str, pids))} hold the lock {self.path}: a "
                f"conversion's leftover workers? Stop them (kill {' '.join(map(str, pids))}) and run the "
                "conversion again")


def unwritable(dst: Path, exc: OSError) -> StoreWriteError:
    """The error for a destination whose folder refuses the conversion's files (read-only, no permission)."""
    folder = dst.parent if str(dst.parent) else Path(".")
    return StoreWriteError(f"{dst}: cannot write in {folder} ({exc.strerror or exc}): a conversion writes the store "
                           "and its staging and lock files there; choose a destination on a writable filesystem "
                           "(or make the folder writable)")


def _own_record() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _read_record(fd: int) -> dict[str, Any]:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _describe(record: dict[str, Any]) -> str:
    parts = [f"pid {record.get('pid')}", f"on {record.get('host')}"]
    if record.get("since"):
        parts.append(f"since {record['since']}")
    return " ".join(parts)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _processes_holding(path: Path) -> list[int]:
    """The pids of this machine's processes that have ``path`` open (Linux's /proc; [] elsewhere)."""
    target = os.path.realpath(path)
    found = []
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    found.append(pid)
                    break
            except OSError:
                continue
    return sorted(found)
