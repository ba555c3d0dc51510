"""Rank coordination of a distributed conversion: the status exchange over the gloo group, and the
failure markers in the shared work folder.

Every phase ends with an ``all_gather_object`` of each rank's :class:`RankStatus`, so every rank
learns whether every other rank succeeded (:func:`raise_if_failed`). A rank that fails also drops
a marker file (:func:`mark_failed`) that the others check every 256 files (:func:`failed_ranks`),
so that nobody converts for hours in vain.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DistributedError


@dataclass
class RankStatus:
    rank: int
    error: str | None = None  # "ExcType: message" of a failure
    aborted: bool = False  # stopped because another rank failed
    count: int = 0
    resumed: int = 0  # samples of ``count`` written before a --resume
    skipped: list[dict[str, Any]] | None = None
    labels_seen: list[int] | None = None  # [largest label, any -1]: names the classes of an unnamed source
    bad_input: bool = False  # failed on the source (DecodeError, SourceError): nothing worth resuming


class Exchange:
    """Collectives over the conversion's gloo group, with failures turned into DistributedError."""

    def __init__(self, group: Any):
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, group=self.group, **kwargs)
        except RuntimeError as exc:  # gloo: timeout, or a peer that died
            raise DistributedError(
                f"rank {self.rank}: lost contact with the other ranks of the conversion ({exc}); a rank "
                "crashed or hung: see its log") from exc

    def gather(self, status: RankStatus) -> list[RankStatus]:
        out: list[Any] = [None] * self.world
        self._call(self.dist.all_gather_object, out, status)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._call(self.dist.broadcast_object_list, box, src=self._global(0))
        return box[0]

    def scatter(self, objs: list[Any] | None) -> Any:
        box: list[Any] = [None]
        self._call(self.dist.scatter_object_list, box, objs, src=self._global(0))
        return box[0]

    def _global(self, group_rank: int) -> int:
        if self.group is None or self.group is self.dist.group.WORLD:
            return group_rank
        return self.dist.get_global_rank(self.group, group_rank)


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def raise_if_failed(statuses: list[RankStatus], rank: int, own: BaseException | None) -> None:
    """Raise on every rank if any rank failed: a rank's own error, or DistributedError for the others."""
    failed = [s for s in statuses if s.error is not None and not s.aborted]
    if not failed and not any(s.error for s in statuses):
        return
    if own is not None and not isinstance(own, DistributedError):
        raise own
    if not failed:  # only aborts (cannot happen without a first failure, but say something useful)
        failed = [s for s in statuses if s.error is not None]
    first = failed[0]
    others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
    raise DistributedError(f"rank {first.rank} of the distributed conversion failed{others}: {first.error}; "
                           f"rank {rank} stopped too and nothing was written") from own


def mark_failed(work: Path, rank: int) -> None:
    try:
        (work / f"FAILED-rank-{rank:05d}").touch()
    except OSError:
        pass  # the status exchange still reports the failure; the marker only stops others early


def failed_ranks(work: Path) -> list[int]:
    return sorted(int(n[len("FAILED-rank-"):]) for n in listdir(work) if n.startswith("FAILED-rank-"))


def listdir(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []
