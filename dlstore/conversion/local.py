"""Image folder -> store: parallel decode + static transforms, ordered write, progress.

Worker processes decode and transform chunks of files; the main process
receives the chunks in source order (a bounded window of chunks in flight, so
memory stays flat however slow the disk) and hands each sample to the
format's Writer. The payload is therefore byte-identical whatever the number of
workers. The Writer fills a staging path that is renamed into place only once
the store is complete.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from .. import formats
from .._system import usable_cpus
from ..errors import (
    ArgumentError,
    ArgumentTypeError,
    DecodeError,
    SourceChangedError,
    SourceError,
)
from ..formats.encoding import ENCODINGS
from ..formats.fields import MASK_DTYPES, RecordFields
from ..formats.space import write_error
from ..sources import check_class_order, open_source
from ..sources.decode import DEFAULT_MAX_PIXELS
from ..transforms.static import output_shape, parse_static
from ..units import parse_size
from .assemble import remove_old_parts
from .destination import (
    check_apart,
    check_destination,
    publish,
    staging_path,
)
from .distributed import active_group, convert_distributed
from .checkpoint import (
    journal_path,
    load_checkpoint,
    progress_path,
    remove_staging,
    resume_writer,
    save_checkpoint,
    targets_path,
)
from .job import ON_ERROR, ConvertResult, Job, disk_usage, feed_writer, finish_writer
from .lock import DestinationLock
from .pool import apply_static_any, usable_workers

# --- the conversion ----------------------------------------------------------------------

def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_writer_options(fmt: Any, options: dict[str, Any]) -> None:
    """Refuse a keyword the format's Writer does not take (a typo would be ignored otherwise)."""
    params = inspect.signature(fmt.Writer.__init__).parameters
    valid = sorted(name for name, p in params.items()
                   if p.kind == p.KEYWORD_ONLY and not name.startswith("_") and name != "shape")
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ArgumentError(f"{', '.join(unknown)}: not an option of {fmt.name} stores; valid: "
                            f"{', '.join(valid) or 'none'}")


def _checked_arguments(dst: Any, *, overwrite: Any, on_error: Any, encoding: Any, max_pixels: Any, quality: Any,
                       workers: Any, shard_size: Any) -> int | None:
    """ArgumentError (ArgumentTypeError) naming the first unusable argument; the shard size in bytes."""
    if not (isinstance(overwrite, bool) or overwrite == "damaged"):
        raise ArgumentError(f'overwrite must be False, True (replace a dlstore store) or "damaged" (also one that '
                            f"differs from its seal), got {overwrite!r}")
    if on_error not in ON_ERROR:
        raise ArgumentError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    if encoding not in ENCODINGS:
        raise ArgumentError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
    if not isinstance(dst, (str, os.PathLike)):
        raise ArgumentTypeError(f"dst must be a path (str or os.PathLike), got {type(dst).__name__}")
    if max_pixels is not None and (not _is_int(max_pixels) or max_pixels < 1):
        raise ArgumentError(f"max_pixels must be None (no limit) or a positive int, got {max_pixels!r}")
    if not _is_int(quality) or not 1 <= quality <= 100:
        raise ArgumentError(f"quality must be an int within 1..100, got {quality!r}")
    if workers is not None and (not _is_int(workers) or workers < 0):
        raise ArgumentError(f"workers must be None (one per usable CPU), 0 (decode in this process) or a "
                            f"positive int, got {workers!r}")
    if isinstance(shard_size, str):   # "8MiB", as the command line's --shard-size
        try:
            shard_size = parse_size(shard_size)
        except ValueError as exc:
            raise ArgumentError(f"shard_size={shard_size!r} (--shard-size {shard_size}): {exc}") from None
    if shard_size is not None and (not _is_int(shard_size) or shard_size < 1):
        raise ArgumentError(f"shard_size must be a positive number of bytes or a size like \"8MiB\", "
                            f"got {shard_size!r}")
    return shard_size


def sample_shape(spec: list[dict[str, Any]], source: Any) -> tuple[int, int, int] | None:
    """(C, H, W) of every stored sample, or None when it varies (a variable-shape store)."""
    if source.sample_shape is not None:  # every image has one shape: run the spec on a blank one
        import torch

        return tuple(apply_static_any(torch.zeros(source.sample_shape, dtype=torch.uint8), spec).shape)
    shape = output_shape(spec)
    if shape is None or any(op["op"] == "grayscale" for op in spec):
        return shape
    return (source.channels, shape[1], shape[2])


def convert(
    src: Any,
    dst: str | os.PathLike,
    *,
    store_format: str | None = None,
    static: Any = None,
    workers: int | None = None,
    overwrite: bool | str = False,
    on_error: str = "fail",
    resume: bool = False,
    exif_transpose: bool = False,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    encoding: str = "raw",
    quality: int = 90,
    shard_size: int | str | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    distributed: bool | None = None,
    root: str | os.PathLike | None = None,
    image_key: str | int | None = None,
    label_key: str | int | None = None,
    mode: str | None = None,
    class_order: str = "imagefolder",
    masks: str | os.PathLike | None = None,
    mask_key: str | int | None = None,
    mask_dtype: str = "uint8",
    **format_options: Any,
) -> ConvertResult:
    """Convert a source of images into a store.

    Its keyword arguments are the options of ``dlstore convert``, one for one, hence their number;
    the steps below (``_resolve``, ``_convert_here``, ``_convert_on_ranks``) share a ``Conversion``.

    Sample ``i`` of the store is item ``i`` of the source after the static ops
    (torchvision's kernels, on what the source yields), whatever ``workers`` is.

    Args:
        src: what to convert (see ``dlstore.sources``):

            * an image folder (``ROOT/CLASS/IMAGE``, or a flat folder: unlabelled),
              in ``ImageFolder``'s order, with its ``classes``;
            * a CSV or JSON-lines file of ``path,label`` rows, paths relative to ``root``;
            * a map-style dataset yielding ``(image, target)`` (torchvision ``CIFAR10``,
              ``MNIST``, ``FakeData``, any ``Dataset``) or dicts (Hugging Face; ``image_key``,
              ``label_key``), the image a PIL image or a uint8 ndarray/tensor;
            * arrays ``(images, labels)``: uint8 (N, H, W, C), (N, C, H, W) or (N, H, W);
            * a source object from ``dlstore.sources`` (e.g. ``DatasetSource(ds, fixed_shape=True)``).
        dst: the store to write; its suffix picks the format when ``store_format`` is None
            (``.shards``, ``.lmdb``, ``.h5``/``.hdf5``).
        store_format: ``"shards"``, ``"lmdb"`` or ``"hdf5"`` (``--format`` on the command line).
        static: static transforms run once per image: a spec string
            (``"resize=256,center_crop=224"``), a list of op dicts, torchvision
            transforms, or a hybrid transform (its static part).
        workers: decode processes; default: the CPUs this process may use.
        overwrite: True: replace an existing store at ``dst``, provided it is a store dlstore wrote
            and still holds exactly what dlstore wrote there (its seal and checksums match: a dataset,
            attribute, key or file a user added is never replaced, it is named); ``"damaged"``
            (``--overwrite-damaged``): also replace a store of ours that differs from its seal
            with nothing added that dlstore can name. An empty folder at ``dst`` is replaced
            without ``overwrite``.
        on_error: ``"fail"`` stops at the first undecodable file (naming it) and
            writes nothing; ``"skip"`` leaves it out and records it in the manifest.
        resume: continue an interrupted conversion to ``dst`` from its last
            completed unit (a shards data file, a committed LMDB transaction, a
            written HDF5 block) instead of starting over. The result is identical
            to an uninterrupted run (distributed too, resumed on as many ranks).
        exif_transpose: apply EXIF orientation when decoding (torchvision does not;
            off by default so pixels match your torchvision pipeline).
        max_pixels: refuse larger images (decompression-bomb guard; PIL's limit by default).
        encoding: ``"raw"`` (uint8 arrays, fastest to read), or ``"jpeg"`` / ``"png"``:
            each statically transformed sample stored encoded (5-15x smaller for
            JPEG) and decoded with PIL at read time.
        quality: JPEG quality (1-100; PIL advises at most 95) for ``encoding="jpeg"``.
        shard_size: target bytes per data file of a shards store, an int or a size such as
            ``"256MiB"`` (as ``--shard-size``), default 1 GiB (ignored by the other formats, which
            write one file).
        progress: show a tqdm progress bar.
        log: called with warnings (e.g. empty class folders); default: ignored.
        distributed: convert on every rank of the initialised ``torch.distributed``
            process group (each rank decodes a contiguous range with its own
            ``workers`` processes; rank 0 scans and assembles; see
            ``dlstore.distributed``) when True: every rank must then call ``convert``
            with the same arguments, and the destination must be on a filesystem all
            ranks share. None (default) or False: this process alone, also inside an
            initialised group (``if rank == 0: dlstore.convert(...)`` is safe). The
            command line converts collectively under torchrun. ``workers`` defaults to the CPUs divided by the ranks on
            this node (``LOCAL_WORLD_SIZE``).
        root: the folder the paths of a list file are relative to (default: the list's folder).
        image_key, label_key: where a dataset's dict items (or tuple positions) hold the image
            and the label (default ``"image"`` / ``"label"``, or ``(image, target)`` pairs).
        mode: ``"RGB"`` or ``"L"``: every image converted to it (PIL ``img.convert(mode)``;
            ``--mode``). None (default): a folder is RGB, as torchvision's loader makes it; a list,
            a dataset or arrays keep their images' one mode (MNIST stays one channel) and become
            RGB when grayscale and colour images mix. The manifest records ``source.mode`` and
            ``source.mode_given``.
        class_order: how an image folder's classes are ordered, which fixes every label:
            ``"imagefolder"`` (default: sorted names, as torchvision's ``ImageFolder``: ``c1, c10, c2``)
            or ``"natural"`` (as timm's folder reader: ``c1, c2, c10``, case ignored); recorded in
            the manifest (``class_order``). Other sources keep their own order (only the default).
        masks: a folder of masks paired with the image folder ``src`` by relative path and stem
            (``images/a/x.jpg`` <-> ``masks/a/x.png``, ``--masks``): a segmentation store, each sample
            an image and its mask, both through the static ops as torchvision v2 runs them on
            ``(tv_tensors.Image, tv_tensors.Mask)``; see docs/segmentation.md. A list of
            ``image,mask`` rows, or a dataset of (image, mask) pairs, is one without ``masks``.
        mask_key: where a dataset's items hold the mask (a dict key or tuple position).
        mask_dtype: ``"uint8"`` (default) or ``"uint16"`` (masks with classes above 255,
            ``--mask-dtype``).
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
    conversion = _resolve(src, dst, store_format=store_format, static=static, workers=workers, overwrite=overwrite,
                          on_error=on_error, resume=resume, exif_transpose=exif_transpose, max_pixels=max_pixels,
                          encoding=encoding, quality=quality, shard_size=shard_size, progress=progress, log=log,
                          root=root, image_key=image_key, label_key=label_key, mode=mode,
                          class_order=class_order, masks=masks, mask_key=mask_key, mask_dtype=mask_dtype,
                          format_options=format_options)
    group = active_group(distributed)
    if group is not None:
        return _convert_on_ranks(conversion, group, workers)
    return _convert_here(conversion, workers)


@dataclass
class Conversion:
    """What ``convert`` was asked, checked and resolved: what its steps share."""

    dst: Path
    store_format: Any   # the formats.protocol.Format to write
    spec: list[dict[str, Any]]
    decode: dict[str, Any]
    codec: tuple[str, int]
    options: dict[str, Any]   # the Writer's keyword options
    on_error: str
    overwrite: bool | str
    resume: bool
    progress: bool
    log: Callable[[str], None]
    open_src: Callable[[], Any]
    mask_dtype: str = "uint8"

    def job(self, source: Any, workers: int) -> Job:
        """The job converting ``source`` (a whole source or a rank's part) with up to ``workers`` processes."""
        workers = usable_workers(source.loader(self.decode), workers, self.log)
        fields = None
        if tuple(getattr(source, "fields", ("image", "target"))) == ("image", "mask"):
            if self.codec[0] != "raw":
                raise ArgumentError(f"encoding={self.codec[0]!r}: a segmentation store keeps its masks in the "
                                    "records, which are stored raw; convert without encoding (--encoding raw)")
            fields = RecordFields.for_mask(source.channels, self.mask_dtype)
        return Job(source=source, spec=self.spec, shape=sample_shape(self.spec, source),
                   store_format=self.store_format, decode=self.decode, workers=workers, on_error=self.on_error,
                   options=self.options, codec=self.codec, fields=fields)


def _resolve(src: Any, dst: Any, *, store_format: Any, static: Any, workers: Any, overwrite: Any, on_error: Any,
             resume: bool, exif_transpose: bool, max_pixels: Any, encoding: Any, quality: Any, shard_size: Any,
             progress: bool, log: Callable[[str], None] | None, root: Any, image_key: Any, label_key: Any,
             mode: Any, class_order: Any, masks: Any, mask_key: Any, mask_dtype: Any,
             format_options: dict[str, Any]) -> Conversion:
    """``convert``'s arguments checked (the first unusable one raises, naming it) and resolved."""
    shard_size = _checked_arguments(dst, overwrite=overwrite, on_error=on_error, encoding=encoding,
                                    max_pixels=max_pixels, quality=quality, workers=workers, shard_size=shard_size)
    dst = Path(dst)
    if store_format is not None and not isinstance(store_format, str):
        raise ArgumentTypeError(f"store_format must be None (from dst's suffix) or one of "
                                f"{', '.join(formats.names())}, got {store_format!r}")
    fmt = formats.get_format(formats.format_for_destination(dst) if store_format is None else store_format)
    spec = parse_static(static)
    check_class_order(class_order)
    _check_writer_options(fmt, format_options)
    if shard_size is not None and fmt.sized_data_files:   # the other formats have no data files to size
        format_options["shard_size"] = shard_size
    if root is not None and not isinstance(root, (str, os.PathLike)):
        raise ArgumentTypeError(f"root must be a path (str or os.PathLike), got {type(root).__name__}")
    if isinstance(src, (str, os.PathLike)):   # (a dataset or arrays have no path to protect)
        check_apart(dst, Path(src), scanned=Path(src).is_dir())
        if root is not None:
            check_apart(dst, Path(root), scanned=False)

    if mask_dtype not in MASK_DTYPES:
        raise ArgumentError(f"mask_dtype must be one of {', '.join(MASK_DTYPES)}, got {mask_dtype!r}")
    if masks is not None and isinstance(masks, (str, os.PathLike)):
        check_apart(dst, Path(masks), scanned=True)

    def open_src() -> Any:
        return open_source(src, root=root, image_key=image_key, label_key=label_key, mode=mode,
                           class_order=class_order, masks=masks, mask_key=mask_key,
                           on_error="skip" if masks is not None and on_error == "skip" else "fail")

    return Conversion(dst=dst, store_format=fmt, spec=spec,
                      decode={"exif_transpose": bool(exif_transpose), "max_pixels": max_pixels},
                      codec=(encoding, int(quality)), options=format_options, on_error=on_error,
                      overwrite=overwrite, resume=resume, progress=progress, log=log or (lambda message: None),
                      open_src=open_src, mask_dtype=mask_dtype)


def _convert_on_ranks(conversion: Conversion, group: Any, workers: int | None) -> ConvertResult:
    """Every rank of ``group`` converts a part; rank 0 assembles them (``convert_distributed``)."""
    if workers is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or group.size()
        workers = max(1, usable_cpus() // local)
    part_workers = max(0, int(workers))
    return convert_distributed(group, conversion.open_src, conversion.dst, store_format=conversion.store_format,
                               job_for=lambda part: conversion.job(part, part_workers),
                               overwrite=conversion.overwrite, resume=conversion.resume,
                               progress=conversion.progress, log=conversion.log)


def _convert_here(conversion: Conversion, workers: int | None) -> ConvertResult:
    """This process converts the whole source, under the destination's lock."""
    dst, log = conversion.dst, conversion.log
    seen = check_destination(dst, conversion.overwrite, log)
    source = conversion.open_src()
    if source.empty_classes:
        log(f"warning: {len(source.empty_classes)} class folder(s) hold no image and keep their "
            f"label index: {', '.join(source.empty_classes)}")
    job = conversion.job(source, usable_cpus() if workers is None else max(0, int(workers)))
    lock = DestinationLock(dst, log)
    lock.acquire()
    try:
        start = time.perf_counter()
        count, skipped, resumed = _convert_staged(conversion, job, seen)
        seconds = time.perf_counter() - start
    finally:
        lock.release()
    return ConvertResult(
        path=dst, store_format=job.store_format.name, count=count, classes=job.classes(), shape=job.shape,
        static=conversion.spec, nbytes=disk_usage(dst), seconds=seconds, workers=job.workers,
        skipped=[*getattr(source, "skipped", []), *skipped],
        empty_classes=source.empty_classes,
        targets=None if job.targets is None else (job.targets.length, job.targets.dtype.name), resumed=resumed,
        masks=None if job.fields is None else job.fields.mask_dtype,
    )


def _convert_staged(conversion: Conversion, job: Job, seen: Any) -> tuple[int, list[dict[str, str]], int]:
    """Convert into the staging path (resuming where asked and possible) and publish it at the
    destination; keep what ``--resume`` can continue after a failure, remove the rest."""
    dst, log = conversion.dst, conversion.log
    staged = staging_path(dst)
    checkpoint = load_checkpoint(staged, job, log) if conversion.resume else None
    if checkpoint is None:
        remove_staging(staged)  # left by a conversion that crashed, or not resumable
    try:
        count, skipped, resumed = _run(job, staged, checkpoint, conversion.progress, dst.name, log)
        replaced = dst.exists()
        publish(staged, dst, conversion.overwrite, seen=seen)
        if replaced and job.store_format.keeps_parts:   # a distributed store replaced by this one: its parts
            remove_old_parts(dst)
    except SourceChangedError:
        raise   # the interrupted run's work stays: the original files may be put back
    except (DecodeError, SourceError):
        remove_staging(staged)  # bad input: nothing worth resuming
        raise
    except BaseException as exc:
        if progress_path(staged).is_file() and staged.exists():
            log(f"partial conversion kept in {staged}; run the same command with --resume to continue")
        else:
            remove_staging(staged)  # (an HDF5 writer removes a file it could not close intact)
        mapped = write_error(staged, exc) if isinstance(exc, Exception) else None
        if mapped is not None and mapped is not exc:
            raise mapped from exc  # a full disk, EFBIG, EIO: named, not a traceback
        raise
    return count, skipped, resumed


def _run(job: Job, staged: Path, checkpoint: dict[str, Any] | None, progress: bool,
         name: str, log: Callable[[str], None]) -> tuple[int, list[dict[str, str]], int]:
    """Decode, write and finish into ``staged``; return (sample count, skipped files, samples of
    them an interrupted run had written)."""
    source, fmt = job.source, job.store_format
    writer = None if checkpoint is None else resume_writer(job, staged, checkpoint, log)
    if writer is None:
        writer = fmt.Writer(staged, shape=job.record_shape, **job.options)
        start, skipped = 0, []
    else:
        start, skipped = checkpoint["source_pos"], list(checkpoint["skipped"])
    resumed = start - len(skipped)
    resumable = hasattr(writer, "checkpoint")
    if not resumable:
        job.journal = None   # (nothing would save it)
    try:
        with tqdm(total=len(source), initial=start, unit="img", desc=f"convert {name}",
                  disable=not progress, dynamic_ncols=True) as bar:
            feed_writer(job, writer, start, skipped, bar,
                  (lambda pos: save_checkpoint(staged, job, writer, pos, skipped)) if resumable else None)
        count = len(source) - len(skipped)
        if count == 0:
            raise SourceError(f"{source.root}: no file could be converted ({len(skipped)} skipped)")
        finish_writer(job, writer, count, skipped, files=len(source))
        if resumable:
            progress_path(staged).unlink(missing_ok=True)
            targets_path(staged).unlink(missing_ok=True)
            journal_path(staged).unlink(missing_ok=True)
    finally:
        writer.close()
    return count, skipped, resumed
