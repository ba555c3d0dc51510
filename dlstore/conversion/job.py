"""One conversion job: decode a sample, feed samples to a Writer, finish and describe the store."""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DecodeError
from ..formats.manifest import dumps, make_manifest
from ..sources.folder import Source
from ..transforms.static import StaticSpec, describe
from ..units import human_bytes
from .pool import _decoded

ON_ERROR = ("fail", "skip")


@dataclass
class ConvertResult:
    """What a conversion did; ``str()`` gives the summary the CLI prints."""

    path: Path
    store_format: str
    count: int
    classes: list[str]
    shape: tuple[int, int, int] | None
    static: StaticSpec
    nbytes: int
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
            f"wrote {self.path} ({self.store_format})",
            f"  samples  {self.count} in {len(self.classes) or 'no'} classes"
            + ("" if self.classes else " (unlabelled, label -1)"),
            f"  shape    {shape} uint8, static: {describe(self.static)}",
            f"  size     {human_bytes(self.nbytes)} ({self.nbytes / max(self.count, 1):,.0f} B/sample)",
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
