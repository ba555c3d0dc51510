"""One conversion job: decode a sample, feed samples to a Writer, finish and describe the store."""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DecodeError, SourceError
from ..formats.fields import RecordFields
from ..formats.manifest import dumps, make_manifest
from ..formats.targets import TargetRows
from ..formats.targets import describe as describe_targets
from ..sources.origins import Origins
from ..transforms.static import StaticSpec, describe
from ..units import human_bytes
from .journal import Journal, printed_files
from .pool import CHUNK, CHUNK_IN_MEMORY, decode_in_order

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
    targets: tuple[int, str] | None = None   # (K, dtype) of a store of target vectors
    resumed: int = 0   # samples an interrupted run had written before ``resume`` continued it
    masks: str | None = None   # a segmentation store's mask dtype

    @property
    def rate(self) -> float:
        """Samples per second converted by this run (those of the interrupted run not counted)."""
        done = self.count - self.resumed
        return done / self.seconds if self.seconds > 0 else float("inf")

    def __str__(self) -> str:
        shape = "x".join(map(str, self.shape)) if self.shape else "variable"
        lines = [
            f"wrote {self.path} ({self.store_format})",
            f"  samples  {self.count} images with {self.masks} masks" if self.masks else
            f"  samples  {self.count} in {len(self.classes) or 'no'} classes"
            + ("" if self.classes else f" (target vectors: {self.targets[0]} x {self.targets[1]})" if self.targets
               else " (unlabelled, label -1)"),
            f"  shape    {shape} uint8, static: {describe(self.static)}",
            f"  size     {human_bytes(self.nbytes)} ({self.nbytes / max(self.count, 1):,.0f} B/sample)",
            f"  time     {self.seconds:.1f} s, {self.rate:,.0f} images/s with {self.workers} worker(s)"
            + (f" (resumed: {self.resumed} samples were written before)" if self.resumed else ""),
        ]
        if self.empty_classes:
            lines.append(f"  empty    {len(self.empty_classes)} class folder(s) without images: "
                         + ", ".join(self.empty_classes[:10]))
        if self.skipped:
            lines.append(f"  skipped  {len(self.skipped)} file(s):")
            lines += [f"    {_skipped_name(s)}: {s['reason']}" for s in self.skipped[:20]]
            if len(self.skipped) > 20:
                lines.append(f"    ... and {len(self.skipped) - 20} more (all listed in the manifest)")
        return "\n".join(lines)



def _skipped_name(entry: dict[str, Any]) -> str:
    return entry["path"] if "path" in entry else f"item {entry.get('index')}"


def disk_usage(path: Path) -> int:
    """Bytes of all files of a store (a file or a folder)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@dataclass
class Job:
    """Everything that determines a conversion's output (and so must match to resume)."""

    source: Any  # anything with the source interface (dlstore.sources)
    spec: StaticSpec
    shape: tuple[int, int, int] | None
    store_format: Any   # the formats.protocol.Format the store is written in
    decode: dict[str, Any]
    workers: int
    on_error: str
    options: dict[str, Any]
    codec: tuple[str, int] = ("raw", 0)
    # Largest label met and whether -1 was met: names the classes of a source without names.
    labels_seen: list[int] = field(default_factory=lambda: [-1, 0])
    # Target vectors of the samples written so far (a source with ``target_spec`` (K, dtype)), else None.
    targets: TargetRows | None = None
    # The prints of the files converted so far, for a resume to check (a file source), else None.
    journal: Journal | None = None
    # A segmentation source's: how a record holds the image and its mask (formats.fields), else None.
    fields: RecordFields | None = None

    def __post_init__(self) -> None:
        spec = getattr(self.source, "target_spec", None)
        if spec is not None and self.targets is None:
            self.targets = TargetRows(*spec)
        if self.source.origin_kind == "path" and self.journal is None:
            self.journal = Journal()

    @property
    def record_shape(self) -> tuple[int, int, int] | None:
        """Shape of the records the writer stores: encoded records vary in length; a segmentation
        store's hold the mask's planes after the image's channels."""
        if self.codec[0] != "raw":
            return None
        return self.shape if self.fields is None else self.fields.record_shape(self.shape)

    @functools.cached_property
    def _fingerprint(self) -> dict[str, Any]:
        # Computed once: it hashes the whole file listing, and every checkpoint records it.
        return {
            "format": self.store_format.name, "format_version": self.store_format.version,
            "static": self.spec, "decode": self.decode, "on_error": self.on_error, "codec": list(self.codec),
            "options": {k: v for k, v in sorted(self.options.items())},
            **self.source.fingerprint(),
            **({} if self.targets is None else {"targets": [self.targets.length, str(self.targets.dtype.name)]}),
            **({} if self.fields is None else {"fields": self.fields.describe()}),
        }

    def classes(self) -> list[str]:
        """Class names: the source's, or ``"0"``.. up to the largest label met (a source without names)."""
        if self.source.classes is not None:
            return list(self.source.classes)
        top, unlabelled = self.labels_seen
        if top >= 0 and unlabelled:
            raise SourceError(f"{self.source.root}: some items have a label and others none (-1); "
                              "label every item or none")
        return [str(k) for k in range(top + 1)]

    def fingerprint(self) -> dict[str, Any]:
        """What must match for ``--resume`` to continue this job (JSON-able)."""
        return self._fingerprint


def feed_writer(job: Job, writer: Any, start: int, skipped: list[dict[str, Any]], bar: Any,
                on_file_done: Callable[[int], None] | None = None,
                check: Callable[[], None] | None = None) -> None:
    """Load items ``start:`` of ``job.source`` in order, apply the static ops, add them to ``writer``.

    ``on_file_done(pos)`` runs when the writer completes a data file (checkpoints);
    ``check()`` runs every few hundred items and may raise to stop (distributed aborts).
    """
    source = job.source
    # One walk over the keys, shared by the decoder (which reads a bounded window ahead)
    # and the writer loop; tee buffers only that window.
    todo, ahead = itertools.tee(source.item_keys(start))
    chunk = CHUNK if source.origin_kind == "path" else CHUNK_IN_MEMORY
    results = decode_in_order(ahead, source.loader(job.decode), job.spec, job.codec, job.workers, chunk,
                              where=None if job.journal is None else printed_files(source), fields=job.fields)
    # Closed here, in this thread, when writing fails: left to the garbage collector, the pool's
    # shutdown can run in the pool's own manager thread, which cannot join itself.
    with contextlib.closing(results):
        _write_results(job, writer, start, zip(todo, results), skipped, bar, on_file_done, check)


def _write_results(job: Job, writer: Any, start: int, results: Iterable[Any], skipped: list[dict[str, Any]],
                   bar: Any, on_file_done: Callable[[int], None] | None,
                   check: Callable[[], None] | None) -> None:
    """The writer loop of :func:`feed_writer`: check each decoded item, add it or record it as skipped."""
    source = job.source
    n_classes = None if source.classes is None else len(source.classes)
    seen = job.labels_seen
    for pos, (key, (result, printed)) in enumerate(results, start=start):
        if job.journal is not None:
            job.journal.append(source.origin(key), printed)
        if not isinstance(result, str):
            record, label = result
            if job.record_shape is not None and tuple(record.shape) != job.record_shape:
                raise _shape_error(source, key, tuple(record.shape), job.record_shape)
            if job.targets is not None or isinstance(label, np.ndarray):
                label = _target_row(job, source.where(key), label)
                ok = True
            elif n_classes is None:
                ok = label >= -1
            else:
                ok = 0 <= label < n_classes if n_classes else label == -1
            if not ok:
                result = f"label {label} is not a class index (0..{(n_classes or 0) - 1})"
        if isinstance(result, str):
            if job.on_error == "fail":
                raise DecodeError(source.where(key), result + " (pass on_error=\"skip\" (--on-error skip) to leave such items out)")
            origin = source.origin(key)
            skipped.append({"path" if source.origin_kind == "path" else "index": origin, "reason": result})
        else:
            if isinstance(label, np.ndarray):   # a target vector: kept with the job, the writer gets -1
                job.targets.append(label)
                label = -1
            elif label > seen[0]:
                seen[0] = label
            elif label == -1:
                seen[1] = 1
            if writer.add(record, label) and on_file_done is not None:
                on_file_done(pos + 1)
        bar.update(1)
        if check is not None and pos % 256 == 255:
            check()


def _shape_error(source: Any, key: Any, got: tuple[int, ...], expected: tuple[int, int, int]) -> DecodeError:
    """The error for a record of another shape than the store's: the fix for channels is a mode,
    for sizes a resize + crop."""
    where = source.where(key)
    if got[0] != expected[0]:
        mode = getattr(source, "mode", None)
        return DecodeError(where, f"has {got[0]} channel(s), the store {expected[0]} (source mode {mode}); pass "
                                  "mode=\"RGB\" (--mode RGB) to convert every image to RGB, or mode=\"L\" "
                                  "(--mode L) to grayscale")
    return DecodeError(where, f"static spec produced shape {got}, expected {expected} (every item must have "
                              "one shape: add a resize + center_crop to the static ops)")


def _target_row(job: Job, where: str, label: Any) -> np.ndarray:
    """``label``, the target vector of the item at ``where``, checked against the first item's kind."""
    spec = job.targets
    if spec is None:
        raise SourceError(f"{where}: yields a target vector of {len(label)} {label.dtype} values, but the first "
                          "item's target is an int label (or none); give every item one kind of target")
    if not isinstance(label, np.ndarray) or label.shape != (spec.length,) or label.dtype != spec.dtype:
        got = (f"{label.shape[0]} {label.dtype} values" if isinstance(label, np.ndarray)
               else f"the int label {label}")
        raise SourceError(f"{where}: yields a target of {got}, but the first item's is a vector of {spec.length} "
                          f"{spec.dtype.name} values; every target must have that length and kind (ints or bools: "
                          "int64; floats: float32)")
    return label


def origins_for(source: Any, skipped: list[dict[str, Any]]) -> Origins:
    """Provenance of the samples a conversion of ``source`` wrote: every item's origin but the skipped ones."""
    kind = source.origin_kind
    dropped = {entry["path" if kind == "path" else "index"] for entry in skipped}
    origins = (source.origin(key) for key in source.item_keys())
    return Origins.build(kind, (o for o in origins if o not in dropped) if dropped else origins)


def finish_writer(job: Job, writer: Any, count: int, skipped: list[dict[str, Any]], *, files: int,
                  origins: Origins | None = None) -> dict[str, Any]:
    """Complete ``writer`` and write its manifest; return the manifest.

    ``origins``: the samples' provenance (default: from the job's source, less ``skipped``).
    """
    if origins is None:
        origins = origins_for(job.source, skipped)
    if len(origins) != count:
        raise SourceError(f"{job.source.root}: provenance of {len(origins)} samples for {count} written "
                          "(the source changed during the conversion?)")
    writer.set_provenance(origins)
    if job.targets is not None:
        if len(job.targets) != count:
            raise SourceError(f"{job.source.root}: {len(job.targets)} target vectors for {count} samples written")
        writer.set_targets(job.targets.array())
    layout = writer.finish()
    manifest = manifest_for(job, count=count, skipped=skipped, files=files, checksums=writer.checksums,
                            layout=layout)
    writer.write_manifest(dumps(manifest))
    return manifest


def manifest_for(job: Job, *, count: int, skipped: list[dict[str, Any]], files: int,
                 checksums: dict[str, str], layout: dict[str, Any]) -> dict[str, Any]:
    """The manifest of a store that ``job`` produced (one writer, or assembled from parts)."""
    source, fmt = job.source, job.store_format
    return make_manifest(
        format=fmt.name, format_version=fmt.version, count=count, shape=job.record_shape,
        classes=job.classes(), static=job.spec, encoding=job.codec[0], decoded_shape=job.shape,
        quality=job.codec[1] if job.codec[0] == "jpeg" else None,
        source={**source.describe(), "files": files, "skipped": [*getattr(source, "skipped", []), *skipped],
                "decode": job.decode},
        checksums=checksums, layout=layout,
        targets=None if job.targets is None else describe_targets(np.empty((0, job.targets.length),
                                                                           job.targets.dtype.name)),
        class_order=getattr(source, "class_order", None),
        fields=None if job.fields is None else job.fields.describe(),
    )
