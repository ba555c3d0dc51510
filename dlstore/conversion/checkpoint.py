"""What an interrupted single-process conversion keeps for ``--resume``, and how it is checked.

Inside a staging folder (shards, LMDB), or beside a staging file (HDF5:
``.NAME.dlstore-tmp.progress.json`` and so on)::

    progress.json            the checkpoint: the job's fingerprint, the source position, the skipped
                             items, the writer's state; saved at every unit of the writer
    progress.json.sources    the prints of the source files converted (``journal``)
    progress.json<partial>   the target vectors of the samples written (a source of target vectors)

A resume continues only the same job (same settings and listing) whose converted files are
unchanged, from a writer that can be reopened; otherwise it starts over or refuses, saying why.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import SourceError, WriterKilledError
from ..formats.targets import PARTIAL_SUFFIX
from .destination import remove_path
from .job import Job
from .journal import SUFFIX as JOURNAL_SUFFIX
from .journal import changed_files, printed_files, refuse

PROGRESS_NAME = "progress.json"


def progress_path(staged: Path) -> Path:
    """Where a resumable conversion keeps its checkpoint: inside a staging folder (shards,
    LMDB), or beside a staging file (HDF5: ``.NAME.dlstore-tmp.progress.json``)."""
    return staged / PROGRESS_NAME if staged.is_dir() else staged.with_name(f"{staged.name}.{PROGRESS_NAME}")


def journal_path(staged: Path) -> Path:
    """Where a resumable conversion of files keeps the prints of the files converted (see ``journal``)."""
    path = progress_path(staged)
    return path.with_name(path.name + JOURNAL_SUFFIX)


def targets_path(staged: Path) -> Path:
    """Where a resumable conversion of target vectors keeps the rows of the written samples."""
    path = progress_path(staged)
    return path.with_name(path.name + PARTIAL_SUFFIX)


def remove_staging(staged: Path) -> None:
    """Remove a staging path and what a file-type writer keeps beside it (``NAME.*``)."""
    remove_path(staged)
    for sibling in staged.parent.glob(f"{glob.escape(staged.name)}.*"):
        remove_path(sibling)


def load_checkpoint(staged: Path, job: Job, log: Callable[[str], None]) -> dict[str, Any] | None:
    """The checkpoint of an interrupted run with the same job, or None (start over)."""
    if not hasattr(job.store_format.Writer, "resume"):
        log(f"{job.store_format.name} conversions cannot resume; starting over")
        return None
    path = progress_path(staged)
    if not path.is_file():
        log("nothing to resume (no interrupted conversion found); starting over")
        return None
    try:
        checkpoint = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        log(f"{path} is unreadable; starting over")
        return None
    if checkpoint.get("job") != json.loads(json.dumps(job.fingerprint())):
        raise SourceError(
            f"{staged}: the interrupted conversion used other settings or another source listing; "
            "rerun without --resume to start over (or with the original settings)")
    return checkpoint


def _converted_files_unchanged(staged: Path, job: Job, checkpoint: dict[str, Any],
                               log: Callable[[str], None]) -> bool:
    """True if the files the interrupted run converted are the ones it converted (their prints,
    in the journal, match); False (start over) where it cannot be checked; SourceChangedError
    listing the files that changed."""
    rows = checkpoint.get("source_pos")
    entries = (job.journal.restore(journal_path(staged), rows)
               if isinstance(rows, int) and checkpoint.get("journal_rows") == rows else None)
    if entries is None:
        log(f"{journal_path(staged)}: missing or incomplete, so the files already converted cannot be "
            "checked; starting over")
        return False
    paths = (printed_files(job.source)(key) for key in job.source.item_keys())
    changed = changed_files(entries, paths, threads=max(job.workers, 4))
    if changed:
        raise refuse(staged, changed, rows)
    return True


def save_checkpoint(staged: Path, job: Job, writer: Any, source_pos: int, skipped: list) -> None:
    state = {"job": job.fingerprint(), "source_pos": source_pos, "skipped": skipped, "labels_seen": job.labels_seen,
             "writer": writer.checkpoint()}
    if job.journal is not None:   # the prints of the files converted so far, appended beside the checkpoint
        job.journal.save(journal_path(staged), source_pos)
        state["journal_rows"] = source_pos
    if job.targets is not None:   # the rows of the samples written so far, appended beside the checkpoint
        state["target_rows"] = len(job.targets)
        job.targets.save(targets_path(staged), len(job.targets))
    path = progress_path(staged)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # (a full disk): the previous checkpoint stays valid
        raise
    os.replace(tmp, path)


def resume_writer(job: Job, staged: Path, checkpoint: dict[str, Any], log: Callable[[str], None]) -> Any:
    """The interrupted conversion's writer, reopened, with the job's state restored; None where
    its file can never be reopened (an HDF5 file whose writer was killed: HDF5 refuses to open it
    for writing again), the staging then removed: the conversion starts over. Any other failure
    to reopen (the file locked by a reader, no permission) is raised, the staging kept."""
    try:
        writer = job.store_format.Writer.resume(staged, checkpoint["writer"], shape=job.record_shape, **job.options)
    except WriterKilledError as exc:
        log(f"the interrupted conversion cannot be resumed ({exc}); starting over")
        remove_staging(staged)
        return None
    try:
        unchanged = job.journal is None or _converted_files_unchanged(staged, job, checkpoint, log)
    except BaseException:
        writer.close()
        raise
    if not unchanged:
        writer.close()
        remove_staging(staged)
        return None
    job.labels_seen[:] = checkpoint.get("labels_seen", job.labels_seen)
    if job.targets is not None:
        job.targets.restore(targets_path(staged), int(checkpoint["target_rows"]))
    unit = "files" if job.source.origin_kind == "path" else "items"
    log(f"resuming after {checkpoint['source_pos']} of {len(job.source)} {unit}")
    return writer
