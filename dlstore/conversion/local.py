"""Image folder -> store: parallel decode + static transforms, ordered write, progress.

Worker processes decode and transform chunks of files; the main process
receives the chunks in source order (a bounded window of chunks in flight, so
memory stays flat however slow the disk) and hands each sample to the
format's Writer. The payload is therefore byte-identical whatever the number of
workers. The Writer fills a staging path that is renamed into place only once
the store is complete.
"""

from __future__ import annotations

import glob
import inspect
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from .. import formats
from .._system import usable_cpus
from ..errors import ArgumentError, ArgumentTypeError, DecodeError, SourceError
from ..formats._common import (
    DestinationLock,
    check_destination,
    publish,
    remove_path,
    staging_path,
)
from ..formats.encoding import ENCODINGS
from ..sources.decode import DEFAULT_MAX_PIXELS
from ..sources.folder import Source, scan
from ..transforms.static import output_shape, parse_static
from .distributed import active_group, convert_distributed
from .job import ON_ERROR, ConvertResult, _feed, _finish, _Job, disk_usage

# --- the conversion ----------------------------------------------------------------------

PROGRESS_NAME = "progress.json"


def progress_path(staged: Path) -> Path:
    """Where a resumable conversion keeps its checkpoint: inside a staging folder (shards,
    LMDB), or beside a staging file (HDF5: ``.NAME.dlstore-tmp.progress.json``)."""
    return staged / PROGRESS_NAME if staged.is_dir() else staged.with_name(f"{staged.name}.{PROGRESS_NAME}")


def remove_staging(staged: Path) -> None:
    """Remove a staging path and what a file-type writer keeps beside it (``NAME.*``)."""
    remove_path(staged)
    for sibling in staged.parent.glob(f"{glob.escape(staged.name)}.*"):
        remove_path(sibling)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_writer_options(module: Any, fmt: str, options: dict[str, Any]) -> None:
    """Refuse a keyword the format's Writer does not take (a typo would be ignored otherwise)."""
    params = inspect.signature(module.Writer.__init__).parameters
    valid = sorted(name for name, p in params.items()
                   if p.kind == p.KEYWORD_ONLY and not name.startswith("_") and name != "shape")
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ArgumentError(f"{', '.join(unknown)}: not an option of {fmt} stores; valid: "
                            f"{', '.join(valid) or 'none'}")


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    store_format: str | None = None,
    static: Any = None,
    workers: int | None = None,
    overwrite: bool = False,
    on_error: str = "fail",
    resume: bool = False,
    exif_transpose: bool = False,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    encoding: str = "raw",
    quality: int = 90,
    shard_size: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    distributed: bool | None = None,
    **format_options: Any,
) -> ConvertResult:
    """Convert an image folder (torchvision ImageFolder layout) into a store.

    Args:
        src: the image folder (``ROOT/CLASS/IMAGE``, or a flat folder: unlabelled).
        dst: the store to write; its suffix picks the format when ``store_format`` is None
            (``.shards``, ``.lmdb``, ``.h5``/``.hdf5``).
        store_format: ``"shards"``, ``"lmdb"`` or ``"hdf5"`` (``--format`` on the command line).
        static: static transforms run once per image: a spec string
            (``"resize=256,center_crop=224"``), a list of op dicts, torchvision
            transforms, or a hybrid transform (its static part).
        workers: decode processes; default: the CPUs this process may use.
        overwrite: replace an existing store at ``dst``.
        on_error: ``"fail"`` stops at the first undecodable file (naming it) and
            writes nothing; ``"skip"`` leaves it out and records it in the manifest.
        resume: continue an interrupted conversion to ``dst`` from its last
            completed unit (a shards data file, a committed LMDB transaction, a
            written HDF5 block) instead of starting over. The result is identical
            to an uninterrupted run (not for distributed conversions).
        exif_transpose: apply EXIF orientation when decoding (torchvision does not;
            off by default so pixels match your torchvision pipeline).
        max_pixels: refuse larger images (decompression-bomb guard; PIL's limit by default).
        encoding: ``"raw"`` (uint8 arrays, fastest to read), or ``"jpeg"`` / ``"png"``:
            each statically transformed sample stored encoded (5-15x smaller for
            JPEG) and decoded with PIL at read time.
        quality: JPEG quality (1-100; PIL advises at most 95) for ``encoding="jpeg"``.
        shard_size: target bytes per data file of a shards store, default 1 GiB (ignored by the
            other formats, which write one file).
        progress: show a tqdm progress bar.
        log: called with warnings (e.g. empty class folders); default: ignored.
        distributed: convert on every rank of the initialised ``torch.distributed``
            process group (each rank decodes a contiguous range with its own
            ``workers`` processes; rank 0 scans and assembles; see
            ``dlstore.distributed``). None (default): when a group of 2+ ranks is
            initialised; False: this process alone. Every rank must call ``convert``
            with the same arguments (calling it on one rank only would wait for the
            others until the group's timeout: pass ``distributed=False`` there); the
            destination must be on a filesystem all ranks share. ``workers`` defaults to the CPUs divided by the ranks on
            this node (``LOCAL_WORLD_SIZE``).
        **format_options: passed to the format's Writer (e.g. HDF5 ``compression``).

    Returns:
        ConvertResult with counts, sizes and timing.

    Raises:
        SourceError / DecodeError: the folder or a file is unusable (nothing is written).
        StoreExistsError: ``dst`` exists and ``overwrite`` is False.
        StoreBusyError: another conversion to ``dst`` is running.
        ConversionInterrupted: a worker died; KeyboardInterrupt: interrupted. A
            resumable partial conversion is kept next to ``dst`` (``.NAME.dlstore-tmp``).
    """
    if on_error not in ON_ERROR:
        raise ArgumentError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    if encoding not in ENCODINGS:
        raise ArgumentError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
    for name, path in (("src", src), ("dst", dst)):
        if not isinstance(path, (str, os.PathLike)):
            raise ArgumentTypeError(f"{name} must be a path (str or os.PathLike), got {type(path).__name__}")
    if max_pixels is not None and (not _is_int(max_pixels) or max_pixels < 1):
        raise ArgumentError(f"max_pixels must be None (no limit) or a positive int, got {max_pixels!r}")
    if not _is_int(quality) or not 1 <= quality <= 100:
        raise ArgumentError(f"quality must be an int within 1..100, got {quality!r}")
    if workers is not None and (not _is_int(workers) or workers < 0):
        raise ArgumentError(f"workers must be None (one per usable CPU), 0 (decode in this process) or a "
                            f"positive int, got {workers!r}")
    if shard_size is not None and (not _is_int(shard_size) or shard_size < 1):
        raise ArgumentError(f"shard_size must be a positive number of bytes, got {shard_size!r}")
    log = log or (lambda message: None)
    dst = Path(dst)
    fmt = store_format or formats.format_for_destination(dst)
    module = formats.get_format(fmt)
    spec = parse_static(static)
    shape = output_shape(spec)
    _check_writer_options(module, fmt, format_options)
    if shard_size is not None and fmt == "shards":   # the other formats have no data files to size
        format_options["shard_size"] = shard_size
    decode = {"exif_transpose": bool(exif_transpose), "max_pixels": max_pixels}
    codec = (encoding, int(quality))
    group = active_group(distributed)
    if group is not None:
        if workers is None:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or group.size()
            workers = max(1, usable_cpus() // local)
        part_workers = max(0, int(workers))

        def job_for(part: Source) -> _Job:
            return _Job(source=part, spec=spec, shape=shape, module=module, decode=decode, workers=part_workers,
                        on_error=on_error, options=format_options, codec=codec)

        return convert_distributed(group, src, dst, module=module, job_for=job_for, overwrite=overwrite,
                                   resume=resume, progress=progress, log=log)
    check_destination(dst, overwrite)
    source = scan(src)
    if source.empty_classes:
        log(f"warning: {len(source.empty_classes)} class folder(s) hold no image and keep their "
            f"label index: {', '.join(source.empty_classes)}")
    workers = usable_cpus() if workers is None else max(0, int(workers))
    job = _Job(source=source, spec=spec, shape=shape, module=module, decode=decode, workers=workers,
               on_error=on_error, options=format_options, codec=codec)

    lock = DestinationLock(dst)
    lock.acquire()
    try:
        staged = staging_path(dst)
        start = time.perf_counter()
        checkpoint = _load_checkpoint(staged, job, log) if resume else None
        if checkpoint is None:
            remove_staging(staged)  # left by a conversion that crashed, or not resumable
        try:
            count, skipped = _run(job, staged, checkpoint, progress, dst.name)
            publish(staged, dst, overwrite)
        except (DecodeError, SourceError):
            remove_staging(staged)  # bad input: nothing worth resuming
            raise
        except BaseException:
            if progress_path(staged).is_file():
                log(f"partial conversion kept in {staged}; run the same command with --resume to continue")
            else:
                remove_staging(staged)
            raise
        seconds = time.perf_counter() - start
    finally:
        lock.release()
    return ConvertResult(
        path=dst, store_format=fmt, count=count, classes=source.classes, shape=shape, static=spec,
        nbytes=disk_usage(dst), seconds=seconds, workers=workers, skipped=skipped,
        empty_classes=source.empty_classes,
    )


def _load_checkpoint(staged: Path, job: _Job, log: Callable[[str], None]) -> dict[str, Any] | None:
    """The checkpoint of an interrupted run with the same job, or None (start over)."""
    if not hasattr(job.module.Writer, "resume"):
        log(f"{job.module.FORMAT} conversions cannot resume; starting over")
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
    log(f"resuming after {checkpoint['source_pos']} of {len(job.source)} files")
    return checkpoint


def _save_checkpoint(staged: Path, job: _Job, writer: Any, source_pos: int, skipped: list) -> None:
    state = {"job": job.fingerprint(), "source_pos": source_pos, "skipped": skipped,
             "writer": writer.checkpoint()}
    path = progress_path(staged)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _run(job: _Job, staged: Path, checkpoint: dict[str, Any] | None, progress: bool,
         name: str) -> tuple[int, list[dict[str, str]]]:
    """Decode, write and finish into ``staged``; return (sample count, skipped files)."""
    source, module = job.source, job.module
    if checkpoint is None:
        writer = module.Writer(staged, shape=job.record_shape, **job.options)
        start, skipped = 0, []
    else:
        writer = module.Writer.resume(staged, checkpoint["writer"], shape=job.record_shape, **job.options)
        start, skipped = checkpoint["source_pos"], list(checkpoint["skipped"])
    resumable = hasattr(writer, "checkpoint")
    try:
        with tqdm(total=len(source), initial=start, unit="img", desc=f"convert {name}",
                  disable=not progress, dynamic_ncols=True) as bar:
            _feed(job, writer, start, skipped, bar,
                  (lambda pos: _save_checkpoint(staged, job, writer, pos, skipped)) if resumable else None)
        count = len(source) - len(skipped)
        if count == 0:
            raise SourceError(f"{source.root}: no file could be converted ({len(skipped)} skipped)")
        _finish(job, writer, count, skipped, files=len(source))
        if resumable:
            progress_path(staged).unlink(missing_ok=True)
    finally:
        writer.close()
    return count, skipped
