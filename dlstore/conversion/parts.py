"""One rank's part of a distributed conversion, and what an interrupted conversion keeps for ``--resume``.

Each rank converts its range of the source into a part store, checkpointing at every unit of
its writer (a data file, a committed transaction, a written block) in
``.DST.dlstore-dist/rank-RRRRR.json``, which also records a finished part; ``plan.json``
records the number of ranks and the job's fingerprint, which a ``--resume`` must match.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any

from ..errors import ArgumentError, DistributedError, SourceChangedError, SourceError, StoreCorruptError
from ..formats.synced import write_synced
from .assemble import remove_with_siblings
from .destination import staging_path
from .journal import SUFFIX as JOURNAL_SUFFIX
from .journal import changed_files, printed_files, refuse
from .ranks import RankStatus, failed_ranks, listdir

PLAN = "plan.json"  # the ranks and the job's fingerprint: what a --resume must match


def convert_part(job: Any, part_path: Path, first: int, total: int, work: Path, rank: int, world: int,
                  progress: bool, name: str, feed: Any, finish: Any, *, resume: bool = False,
                  log: Any = lambda message: None) -> tuple[int, list[dict[str, str]], int]:
    """Convert ``job.source`` (this rank's range) into the part store ``part_path``.

    The rank's checkpoint ``work/rank-RRRRR.json`` is saved at every unit of the writer (as a
    single-process conversion saves progress.json) and at the end (``done``): ``resume``
    continues from it, or returns the finished part's counts at once. Returns the part's sample
    count, its skipped items, and how many of its samples an interrupted run had written.
    """
    from tqdm.auto import tqdm

    def check() -> None:
        failed = failed_ranks(work)
        if failed:
            raise DistributedError(f"rank {failed[0]} failed; rank {rank} stopped converting")

    state_path = work / f"rank-{rank:05d}.json"
    rows_path = work / f"rank-{rank:05d}.targets"   # target vectors of the samples written (see targets)
    journal_path = work / f"rank-{rank:05d}{JOURNAL_SUFFIX}"   # prints of the files converted (see journal)
    fingerprint = json.loads(json.dumps(job.fingerprint()))
    state = _read_state(state_path, fingerprint, rank) if resume else None
    if state is not None and not _converted_files_unchanged(job, state, journal_path, rank, log):
        state = None
    if state is not None and "done" in state:
        job.labels_seen[:] = state["labels_seen"]
        return state["done"], state["skipped"], state["done"]
    fmt, writer, pos, skipped, resumed = job.store_format, None, 0, [], 0
    if state is not None and hasattr(fmt.Writer, "resume"):
        try:
            writer = fmt.Writer.resume(part_path, state["writer"], shape=job.record_shape, **job.options)
        except StoreCorruptError as exc:  # e.g. an HDF5 file whose writer was killed: the part starts over
            log(f"rank {rank}: its part cannot be resumed ({exc}); converting it again")
        else:
            pos, skipped = state["source_pos"], list(state["skipped"])
            resumed = pos - len(skipped)
            job.labels_seen[:] = state["labels_seen"]
            if job.targets is not None:
                job.targets.restore(rows_path, int(state["target_rows"]))
            unit = "files" if job.source.origin_kind == "path" else "items"
            log(f"rank {rank}: resuming after {pos} of the {len(job.source)} {unit} of its part")
    if writer is None:
        state_path.unlink(missing_ok=True)
        rows_path.unlink(missing_ok=True)
        journal_path.unlink(missing_ok=True)
        if job.journal is not None:
            job.journal.reset()
        remove_with_siblings(part_path)  # (a part written before the first checkpoint)
        writer = fmt.Writer(part_path, shape=job.record_shape, **job.options)

    def save(source_pos: int) -> None:
        state = {"job": fingerprint, "source_pos": source_pos, "skipped": skipped, "labels_seen": job.labels_seen,
                 "writer": writer.checkpoint()}
        if job.journal is not None:
            job.journal.save(journal_path, source_pos)
            state["journal_rows"] = source_pos
        if job.targets is not None:
            state["target_rows"] = len(job.targets)
            job.targets.save(rows_path, len(job.targets))
        write_json(state_path, state)

    try:
        with tqdm(total=len(job.source), initial=pos, unit="img", dynamic_ncols=True,
                  disable=not progress or rank != 0,
                  desc=f"convert {name} [rank {rank}/{world}: files {first}..{first + len(job.source)} "
                       f"of {total}]") as bar:
            feed(job, writer, pos, skipped, bar, save if hasattr(writer, "checkpoint") else None, check=check)
        count = len(job.source) - len(skipped)
        finish(job, writer, count, skipped, files=len(job.source))
    finally:
        writer.close()
    done = {"job": fingerprint, "done": count, "skipped": skipped, "labels_seen": job.labels_seen}
    if job.journal is not None:
        job.journal.save(journal_path, len(job.source))
        done["journal_rows"] = len(job.source)
    write_json(state_path, done)
    check()
    return count, skipped, resumed


def _converted_files_unchanged(job: Any, state: dict[str, Any], journal_path: Path, rank: int, log: Any) -> bool:
    """True if the files of this rank's part that the interrupted run converted are unchanged (or the
    source has no files); False (the part starts over) where the journal cannot tell; SourceChangedError
    listing the files that changed."""
    if job.journal is None:
        return True
    rows = len(job.source) if "done" in state else state.get("source_pos")
    entries = job.journal.restore(journal_path, rows) if state.get("journal_rows") == rows else None
    if entries is None:
        log(f"rank {rank}: {journal_path} is missing or incomplete, so the files its part already converted "
            "cannot be checked; converting the part again")
        return False
    changed = changed_files(entries, (printed_files(job.source)(key) for key in job.source.item_keys()),
                            threads=max(job.workers, 4))
    if changed:
        raise refuse(journal_path.parent, changed, rows)
    return True


def keep_for_resume(work: Path, stage: str, fmt: Any, exc: BaseException, statuses: list[RankStatus]) -> bool:
    """Whether the work folder holds something ``--resume`` can continue after ``exc``."""
    if (isinstance(exc, SourceError) and not isinstance(exc, SourceChangedError)) or any(s.bad_input for s in statuses):
        return False  # bad input: nothing worth resuming (changed files: the originals may be put back)
    if stage != "convert" and not (stage == "assemble" and fmt.merges_parts):  # else the parts were moved
        return False
    return any(name.startswith("rank-") for name in listdir(work))


def resumable(work: Path, plan: dict[str, Any], dst: Path, log: Any) -> bool:
    """True if ``work`` holds an interrupted run of ``plan``; raise, naming it, if it ran otherwise."""
    try:
        old = json.loads((work / PLAN).read_text())
    except (OSError, ValueError):
        single = staging_path(dst)
        if any(single.parent.glob(glob.escape(single.name) + "*")):
            raise ArgumentError(f"{single}: the interrupted conversion ran in one process; resume it in one process "
                                "(without torchrun, distributed=False), or rerun without --resume") from None
        log("nothing to resume (no interrupted distributed conversion found); starting over")
        return False
    if old.get("ranks") != plan["ranks"]:
        raise ArgumentError(f"{work}: the interrupted conversion ran on {old.get('ranks')} ranks, this one on "
                            f"{plan['ranks']}; resume it on {old.get('ranks')} ranks (torchrun --nproc-per-node "
                            f"{old.get('ranks')}), or rerun without --resume to start over")
    if old.get("job") != plan["job"]:
        raise SourceError(f"{work}: the interrupted conversion used other settings or another source listing "
                          f"({_changes(old.get('job') or {}, plan['job'])}); rerun with the original settings, "
                          "or without --resume to start over")
    log(f"resuming the distributed conversion kept in {work}")
    return True


def _read_state(path: Path, fingerprint: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """A rank's checkpoint, or None (no unit written yet: the part starts over)."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if state.get("job") != fingerprint:
        raise SourceError(f"{path}: rank {rank}'s part of the interrupted conversion used other settings "
                          f"({_changes(state.get('job') or {}, fingerprint)}); rerun without --resume")
    return state


def _changes(old: dict[str, Any], new: dict[str, Any]) -> str:
    """``key: old -> new`` for every setting that differs."""
    def short(value: Any) -> str:
        text = json.dumps(value)
        return text if len(text) <= 60 else text[:57] + "..."

    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return "; ".join(f"{k}: {short(old.get(k))} -> {short(new.get(k))}" for k in keys)


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write_synced(tmp, json.dumps(obj).encode("utf-8"))
    os.replace(tmp, path)  # a checkpoint is whole or the previous one
