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
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from . import formats
from .errors import ConversionInterrupted, DecodeError, SourceError
from .formats._common import DestinationLock, check_destination, publish, remove_path, staging_path
from .manifest import dumps, make_manifest
from .source import Source, pil_loader, scan
from .transforms import StaticSpec, apply_static, describe, output_shape, parse_static
from .tuning import usable_cpus

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
            f"  size     {_human_bytes(self.bytes)} ({self.bytes / max(self.count, 1):,.0f} B/sample)",
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


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def disk_usage(path: Path) -> int:
    """Bytes of all files of a store (a file or a folder)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --- decoding, in worker processes -------------------------------------------------------

def _init_worker() -> None:
    # Ctrl-C goes to the whole process group; the parent handles it and stops the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def decode_sample(path: str, spec: StaticSpec) -> np.ndarray:
    """Decode one file and apply the static spec: the stored uint8 CHW array."""
    img = pil_loader(path)
    try:
        return apply_static(img, spec)
    except (OSError, ValueError) as exc:
        raise DecodeError(path, f"static transform failed ({type(exc).__name__}: {exc})") from exc


def _decode_chunk(paths: list[str], spec: StaticSpec) -> list[np.ndarray | str]:
    """Decoded arrays, or the error text for files that failed (the parent decides what to do)."""
    out: list[np.ndarray | str] = []
    for path in paths:
        try:
            out.append(decode_sample(path, spec))
        except DecodeError as exc:
            out.append(exc.reason)
    return out


def _mp_context() -> multiprocessing.context.BaseContext:
    # fork starts workers in milliseconds and shares the imported torchvision; spawn elsewhere.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def _decoded(paths: list[str], spec: StaticSpec, workers: int) -> Iterator[np.ndarray | str]:
    """Yield decode results in the order of ``paths``."""
    chunks = [paths[i:i + _CHUNK] for i in range(0, len(paths), _CHUNK)]
    if workers <= 1:
        for chunk in chunks:
            yield from _decode_chunk(chunk, spec)
        return
    window = 4 * workers
    with ProcessPoolExecutor(workers, mp_context=_mp_context(), initializer=_init_worker) as pool:
        pending: collections.deque = collections.deque()
        todo = iter(chunks)
        try:
            for chunk in todo:
                pending.append(pool.submit(_decode_chunk, chunk, spec))
                if len(pending) >= window:
                    break
            while pending:
                results = pending.popleft().result()
                next_chunk = next(todo, None)
                if next_chunk is not None:
                    pending.append(pool.submit(_decode_chunk, next_chunk, spec))
                yield from results
        except BrokenProcessPool as exc:
            raise ConversionInterrupted(
                "a decode worker process died (killed, or out of memory); nothing was written to the "
                "destination") from exc
        finally:
            for fut in pending:
                fut.cancel()


# --- the conversion ----------------------------------------------------------------------

def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    format: str | None = None,
    static: Any = None,
    workers: int | None = None,
    overwrite: bool = False,
    on_error: str = "fail",
    shard_size: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
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
        shard_size: target bytes per data file (shards format), default 1 GiB.
        progress: show a tqdm progress bar.
        log: called with warnings (e.g. empty class folders); default: ignored.
        **format_options: passed to the format's Writer (e.g. HDF5 ``compression``).

    Returns:
        ConvertResult with counts, sizes and timing.

    Raises:
        SourceError / DecodeError: the folder or a file is unusable (nothing is written).
        StoreExistsError: ``dst`` exists and ``overwrite`` is False.
        StoreBusyError: another conversion to ``dst`` is running.
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    dst = Path(dst)
    fmt = format or formats.format_for_destination(dst)
    module = formats.get_format(fmt)
    spec = parse_static(static)
    shape = output_shape(spec)
    check_destination(dst, overwrite)
    source = scan(src)
    if source.empty_classes and log is not None:
        log(f"warning: {len(source.empty_classes)} class folder(s) hold no image and keep their "
            f"label index: {', '.join(source.empty_classes)}")
    workers = usable_cpus() if workers is None else max(0, int(workers))
    if shard_size is not None:
        format_options["shard_size"] = shard_size

    lock = DestinationLock(dst)
    lock.acquire()
    try:
        staged = staging_path(dst)
        remove_path(staged)  # left by a conversion that crashed
        start = time.perf_counter()
        try:
            count, skipped = _write(source, spec, shape, module, staged, workers, on_error,
                                    progress, dst, format_options)
        except BaseException:
            remove_path(staged)
            raise
        publish(staged, dst, overwrite)
        seconds = time.perf_counter() - start
    finally:
        lock.release()
    return ConvertResult(
        path=dst, format=fmt, count=count, classes=source.classes, shape=shape, static=spec,
        bytes=disk_usage(dst), seconds=seconds, workers=workers, skipped=skipped,
        empty_classes=source.empty_classes,
    )


def _write(source: Source, spec: StaticSpec, shape, module, staged: Path, workers: int,
           on_error: str, progress: bool, dst: Path, format_options: dict) -> tuple[int, list]:
    writer = module.Writer(staged, shape=shape, **format_options)
    skipped: list[dict[str, str]] = []
    paths = [p for p, _ in source.samples]
    try:
        with tqdm(total=len(paths), unit="img", desc=f"convert {dst.name}", disable=not progress,
                  dynamic_ncols=True) as bar:
            for (path, label), result in zip(source.samples, _decoded(paths, spec, workers)):
                if isinstance(result, str):
                    if on_error == "fail":
                        raise DecodeError(path, result + " (use --on-error skip to leave such files out)")
                    skipped.append({"path": os.path.relpath(path, source.root), "reason": result})
                elif shape is not None and tuple(result.shape) != shape:
                    raise DecodeError(path, f"static spec produced shape {tuple(result.shape)}, "
                                            f"expected {shape}")
                else:
                    writer.add(result, label)
                bar.update(1)
        count = len(paths) - len(skipped)
        if count == 0:
            raise SourceError(f"{source.root}: no file could be converted ({len(skipped)} skipped)")
        layout = writer.finish()
        manifest = make_manifest(
            format=module.FORMAT, format_version=module.FORMAT_VERSION, count=count, shape=shape,
            classes=source.classes, static=spec,
            source={"root": os.path.abspath(source.root), "files": len(paths), "skipped": skipped,
                    "empty_classes": source.empty_classes},
            checksums=writer.checksums, layout=layout,
        )
        writer.write_manifest(dumps(manifest))
    finally:
        writer.close()
    return count, skipped
