"""Image folder -> store: parallel decode + static transforms, ordered write, progress.

Worker processes decode and transform chunks of files; the main process
receives the chunks in source order (a bounded window of chunks in flight, so
memory stays flat however slow the disk) and hands each sample to the
format's Writer. The payload is therefore byte-identical whatever the number of
workers. The Writer fills a staging path that is renamed into place only once
the store is complete.
"""

from __future__ import annotations

import collections
import functools
import glob
import hashlib
import json
import multiprocessing
import os
import signal
import time
import itertools
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from . import formats
from .distributed import active_group, convert_distributed
from .errors import ConversionInterrupted, DecodeError, SourceError
from .formats._common import DestinationLock, check_destination, publish, remove_path, staging_path
from .manifest import dumps, make_manifest
from .codecs import ENCODINGS, encode
from .source import DEFAULT_MAX_PIXELS, Source, pil_loader, scan
from .transforms import StaticSpec, apply_static, describe, output_shape, parse_static
from .tuning import usable_cpus
from .units import human_bytes

ON_ERROR = ("fail", "skip")
_CHUNK = 8  # files per task: amortises inter-process overhead, keeps ordering latency low


@dataclass
class ConvertResult:
    """What a conversion did; ``str()`` gives the summary the CLI prints."""

    path: Path
    format: str
    count: int
    classes: list[str]
    shape: tuple[int, int, int] | None
    static: StaticSpec
    bytes: int
    seconds: float
    workers: int
    skipped: list[dict[str, str]] = field(default_factory=list)
    empty_classes: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else float("inf")

    def __str__(self) -> str:
        shape = "x".join(map(str, self.shape)) if self.shape else "variable"
        lines = [
            f"wrote {self.path} ({self.format})",
            f"  samples  {self.count} in {len(self.classes) or 'no'} classes"
            + ("" if self.classes else " (unlabelled, label -1)"),
            f"  shape    {shape} uint8, static: {describe(self.static)}",
            f"  size     {human_bytes(self.bytes)} ({self.bytes / max(self.count, 1):,.0f} B/sample)",
            f"  time     {self.seconds:.1f} s, {self.rate:,.0f} images/s with {self.workers} worker(s)",
        ]
        if self.empty_classes:
            lines.append(f"  empty    {len(self.empty_classes)} class folder(s) without images: "
                         + ", ".join(self.empty_classes[:10]))
        if self.skipped:
            lines.append(f"  skipped  {len(self.skipped)} file(s):")
            lines += [f"    {s['path']}: {s['reason']}" for s in self.skipped[:20]]
            if len(self.skipped) > 20:
                lines.append(f"    ... and {len(self.skipped) - 20} more (all listed in the manifest)")
        return "\n".join(lines)



def disk_usage(path: Path) -> int:
    """Bytes of all files of a store (a file or a folder)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --- decoding, in worker processes -------------------------------------------------------

def _init_worker() -> None:
    # Ctrl-C goes to the whole process group; the parent handles it and stops the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forked worker inherits the parent's Python SIGTERM handler (the CLI's); the pool stops
    # broken workers with SIGTERM, which must kill them, not raise inside them.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def decode_sample(path: str, spec: StaticSpec, decode: dict[str, Any] | None = None,
                  codec: tuple[str, int] = ("raw", 0)) -> np.ndarray:
    """Decode one file and apply the static spec: the stored uint8 CHW array.

    ``decode`` holds ``pil_loader`` options (``exif_transpose``, ``max_pixels``);
    ``codec`` is (encoding, quality): for "jpeg"/"png" the result is the encoded
    record (see dlstore.codecs).
    """
    img = pil_loader(path, **(decode or {}))
    try:
        sample = apply_static(img, spec)
    except (OSError, ValueError) as exc:
        raise DecodeError(path, f"static transform failed ({type(exc).__name__}: {exc})") from exc
    encoding, quality = codec
    return sample if encoding == "raw" else encode(sample, encoding, quality=quality)


def _decode_chunk(paths: list[str], spec: StaticSpec, decode: dict[str, Any],
                  codec: tuple[str, int]) -> list[np.ndarray | str]:
    """Decoded arrays, or the error text for files that failed (the parent decides what to do)."""
    out: list[np.ndarray | str] = []
    for path in paths:
        try:
            out.append(decode_sample(path, spec, decode, codec))
        except DecodeError as exc:
            out.append(exc.reason)
    return out


def _mp_context() -> multiprocessing.context.BaseContext:
    # fork starts workers in milliseconds and shares the imported torchvision; spawn elsewhere.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def _decoded(paths: Iterable[str], spec: StaticSpec, decode: dict[str, Any], codec: tuple[str, int],
             workers: int) -> Iterator[np.ndarray | str]:
    """Yield decode results in the order of ``paths`` (consumed lazily: no list of all chunks)."""
    source = iter(paths)
    chunks = iter(lambda: list(itertools.islice(source, _CHUNK)), [])
    # Import the decode-side torchvision kernels once here: forked workers share them instead
    # of each paying the import (seconds) on its first file.
    import torchvision.transforms.v2.functional  # noqa: F401
    if workers <= 1:
        for chunk in chunks:
            yield from _decode_chunk(chunk, spec, decode, codec)
        return
    window = 4 * workers
    pool = ProcessPoolExecutor(workers, mp_context=_mp_context(), initializer=_init_worker)
    pending: collections.deque = collections.deque()
    broken = False
    try:
        todo = iter(chunks)
        for chunk in todo:
            pending.append(pool.submit(_decode_chunk, chunk, spec, decode, codec))
            if len(pending) >= window:
                break
        while pending:
            results = _result(pending.popleft(), pool)
            next_chunk = next(todo, None)
            if next_chunk is not None:
                pending.append(pool.submit(_decode_chunk, next_chunk, spec, decode, codec))
            yield from results
    except BrokenProcessPool as exc:
        broken = True
        raise ConversionInterrupted(
            "a decode worker process died (killed, or out of memory); nothing was written to the "
            "destination") from exc
    finally:
        for fut in pending:
            fut.cancel()
        if broken:
            _abandon(pool)
        else:
            pool.shutdown(wait=True, cancel_futures=True)


def _result(future: Any, pool: ProcessPoolExecutor) -> list[np.ndarray | str]:
    """``future.result()``, but a dead worker is noticed even when the pool does not notice.

    CPython's pool can block for ever when a worker is killed in the middle of sending a
    result (its manager thread waits for the rest of the message); so wait in slices and
    check the workers' exit codes in between.
    """
    while True:
        try:
            return future.result(timeout=2.0)
        except FuturesTimeout:
            workers = list(getattr(pool, "_processes", {}).values())
            if any(p.exitcode is not None for p in workers):
                raise BrokenProcessPool("a worker process exited while its task was pending") from None


def _abandon(pool: ProcessPoolExecutor) -> None:
    """Stop a broken pool without waiting on anything a dead worker left half-done."""
    for process in list(getattr(pool, "_processes", {}).values()):
        process.kill()
    # With every worker gone, closing our copy of the result pipe's write end gives a manager
    # thread stuck on a half-sent result EOF, so it can finish and be joined.
    writer = getattr(getattr(pool, "_result_queue", None), "_writer", None)
    if writer is not None:
        writer.close()
    pool.shutdown(wait=True, cancel_futures=True)


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


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    format: str | None = None,
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
        dst: the store to write; its suffix picks the format when ``format`` is None
            (``.shards``, ``.lmdb``, ``.h5``/``.hdf5``).
        format: ``"shards"``, ``"lmdb"`` or ``"hdf5"``.
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
        shard_size: target bytes per data file (shards format), default 1 GiB.
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
        raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
    if not 1 <= int(quality) <= 100:
        raise ValueError(f"quality must be within 1..100, got {quality}")
    log = log or (lambda message: None)
    dst = Path(dst)
    fmt = format or formats.format_for_destination(dst)
    module = formats.get_format(fmt)
    spec = parse_static(static)
    shape = output_shape(spec)
    if shard_size is not None:
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
        path=dst, format=fmt, count=count, classes=source.classes, shape=shape, static=spec,
        bytes=disk_usage(dst), seconds=seconds, workers=workers, skipped=skipped,
        empty_classes=source.empty_classes,
    )


@dataclass
class _Job:
    """Everything that determines a conversion's output (and so must match to resume)."""

    source: Source
    spec: StaticSpec
    shape: tuple[int, int, int] | None
    module: Any
    decode: dict[str, Any]
    workers: int
    on_error: str
    options: dict[str, Any]
    codec: tuple[str, int] = ("raw", 0)

    @property
    def record_shape(self) -> tuple[int, int, int] | None:
        """Shape of the records the writer stores: encoded records vary in length."""
        return self.shape if self.codec[0] == "raw" else None

    @functools.cached_property
    def _fingerprint(self) -> dict[str, Any]:
        # Computed once: it hashes the whole file listing, and every checkpoint records it.
        listing = hashlib.sha256()
        for path, label in self.source.samples:
            listing.update(f"{os.path.relpath(path, self.source.root)}\0{label}\n".encode("utf-8", "surrogateescape"))
        return {
            "format": self.module.FORMAT, "format_version": self.module.FORMAT_VERSION,
            "static": self.spec, "decode": self.decode, "on_error": self.on_error, "codec": list(self.codec),
            "options": {k: v for k, v in sorted(self.options.items())},
            "source_root": os.path.abspath(self.source.root), "source_files": len(self.source),
            "source_listing": listing.hexdigest(),
        }

    def fingerprint(self) -> dict[str, Any]:
        """What must match for ``--resume`` to continue this job (JSON-able)."""
        return self._fingerprint


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


def _feed(job: _Job, writer: Any, start: int, skipped: list[dict[str, str]], bar: Any,
          on_file_done: Callable[[int], None] | None = None,
          check: Callable[[], None] | None = None) -> None:
    """Decode ``job.source.samples[start:]`` in order and add them to ``writer``.

    ``on_file_done(pos)`` runs when the writer completes a data file (checkpoints);
    ``check()`` runs every few hundred files and may raise to stop (distributed aborts).
    """
    source = job.source
    # One walk over the listing, shared by the decoder (which reads a bounded window ahead)
    # and the writer loop; tee buffers only that window.
    todo, ahead = itertools.tee(itertools.islice(source.samples, start, None))
    results = _decoded((p for p, _ in ahead), job.spec, job.decode, job.codec, job.workers)
    for pos, ((path, label), result) in enumerate(zip(todo, results), start=start):
        if isinstance(result, str):
            if job.on_error == "fail":
                raise DecodeError(path, result + " (use --on-error skip to leave such files out)")
            skipped.append({"path": os.path.relpath(path, source.root), "reason": result})
        elif job.record_shape is not None and tuple(result.shape) != job.record_shape:
            raise DecodeError(path, f"static spec produced shape {tuple(result.shape)}, "
                                    f"expected {job.shape}")
        elif writer.add(result, label) and on_file_done is not None:
            on_file_done(pos + 1)
        bar.update(1)
        if check is not None and pos % 256 == 255:
            check()


def _finish(job: _Job, writer: Any, count: int, skipped: list[dict[str, str]], *, files: int) -> dict[str, Any]:
    """Complete ``writer`` and write its manifest; return the manifest."""
    layout = writer.finish()
    manifest = manifest_for(job, count=count, skipped=skipped, files=files, checksums=writer.checksums,
                            layout=layout)
    writer.write_manifest(dumps(manifest))
    return manifest


def manifest_for(job: _Job, *, count: int, skipped: list[dict[str, str]], files: int,
                 checksums: dict[str, str], layout: dict[str, Any]) -> dict[str, Any]:
    """The manifest of a store that ``job`` produced (one writer, or assembled from parts)."""
    source, module = job.source, job.module
    return make_manifest(
        format=module.FORMAT, format_version=module.FORMAT_VERSION, count=count, shape=job.record_shape,
        classes=source.classes, static=job.spec, encoding=job.codec[0], decoded_shape=job.shape,
        quality=job.codec[1] if job.codec[0] == "jpeg" else None,
        source={"root": os.path.abspath(source.root), "files": files, "skipped": skipped,
                "empty_classes": source.empty_classes, "decode": job.decode},
        checksums=checksums, layout=layout,
    )
