"""One bench run's settings, parsed and checked once, before anything is written: :class:`BenchSettings`.

``check_source`` is the check of SRC that ``dlstore bench`` and ``run_bench`` share: an image
folder, not a file and not a dlstore store (bench converts images; it does not read a store).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ArgumentError, DlstoreError, SourceError
from .options import (
    CACHE_STATES,
    DEFAULT_SAMPLES,
    DEFAULT_STATIC,
    ORDERS,
    Variant,
    default_formats,
    parse_choices,
    parse_variants,
    parse_workers,
)
from .probes import DEFAULT_DISK_TEST_BYTES, can_drop_caches

# dlstore.loader's back-ends that read a store (``resident`` serves a GPUDataset)
BACKENDS = ("auto", "threads", "ring", "dataloader")


@dataclass(frozen=True)
class BenchSettings:
    """What one bench run measures, each value checked (``BenchSettings.parse`` builds it).

    Attributes:
        src: the image folder to copy images from; None: the built-in demo images.
        workdir: the folder on the disk under test (a ``dlstore-bench-*`` folder is made in it).
        variants: what is read: the image folder and store formats with their sample encodings.
        spec: the static transforms (op dicts) of every store and of the image folder's reads.
        workers: the ``num_workers`` values measured.
        batch_size: samples per batch.
        caches: page-cache states (``cold``, ``warm``).
        orders: sample orders (``random``, ``sequential``).
        samples: images used (0: all of ``src``).
        repeats: timed rounds; every cell runs once per round.
        quality: JPEG quality of ``+jpeg`` variants.
        convert_workers: decode processes of the conversions (None: usable CPUs).
        disk_test_bytes: size of the raw sequential bandwidth test file.
        drop_caches: also write ``/proc/sys/vm/drop_caches`` before cold runs (root only).
        keep: keep the images and stores written.
        backend: ``dlstore.loader``'s back-end for the stores' reads.
    """

    src: Path | None
    workdir: Path
    variants: list[Variant]
    spec: list[dict[str, Any]]
    workers: list[int]
    batch_size: int
    caches: list[str]
    orders: list[str]
    samples: int
    repeats: int
    quality: int
    convert_workers: int | None
    disk_test_bytes: int
    drop_caches: bool
    keep: bool
    backend: str

    @classmethod
    def parse(cls, src: str | os.PathLike | None = None, *, workdir: str | os.PathLike | None = None,
              formats: str | Iterable[str] | None = None, static: Any = DEFAULT_STATIC,
              workers: str | int | Iterable[int] = (0, 2), batch_size: int = 64,
              cache: str | Iterable[str] = CACHE_STATES, orders: str | Iterable[str] = ORDERS,
              samples: int = DEFAULT_SAMPLES, repeats: int = 3, quality: int = 90, convert_workers: int | None = None,
              disk_test_bytes: int = DEFAULT_DISK_TEST_BYTES, drop_caches: bool = False, keep: bool = False,
              backend: str = "auto") -> BenchSettings:
        """The settings of a run from the options of ``run_bench`` (one keyword each, as the CLI has one
        flag each: hence more than ten).

        Args:
            src: an image folder (ImageFolder layout); ``samples`` of its images, spread over the
                classes, are copied into the work folder. None: the built-in demo folder
                (synthetic 500x375 JPEGs) is written there.
            workdir: the folder on the disk under test (default: the system temp folder).
            formats: names such as ``"imagefolder,shards,lmdb,hdf5,shards+jpeg"``; ``imagefolder``
                is the baseline (torchvision ``ImageFolder``, decode and static transforms per
                sample). Default: :func:`default_formats`.
            static: static transforms (spec string, op dicts or torchvision transforms); must fix
                the sample size (end with a crop) so samples can be batched.
            workers: ``num_workers`` values to measure (``"0,2"`` or ints).
            batch_size: samples per batch.
            cache: ``"cold"`` and/or ``"warm"`` page cache.
            orders: ``"random"`` and/or ``"sequential"`` sample order.
            samples: images to use (0: all of ``src``).
            repeats: timed rounds; every cell runs once per round.
            quality: JPEG quality of ``+jpeg`` variants.
            convert_workers: decode processes of the conversions (default: usable CPUs).
            disk_test_bytes: size of the raw sequential bandwidth test file.
            drop_caches: also write ``/proc/sys/vm/drop_caches`` before cold runs (root only).
            keep: keep the images and stores (default: removed at the end).
            backend: ``dlstore.loader``'s back-end for the stores: ``"auto"``, ``"threads"``
                (with ``workers=0`` only), ``"ring"`` (workers >= 1 only) or ``"dataloader"``.

        Raises:
            ArgumentError: an invalid setting (unknown format, spec without a fixed size, a store
                as ``src``, a back-end the worker counts cannot use, ...).
            SourceError: ``src`` does not exist.
            PermissionError: ``drop_caches`` without root.
        """
        from ...transforms.static import describe, output_shape, parse_static

        variants = parse_variants(default_formats() if formats is None else formats)
        worker_values = parse_workers(workers)
        caches = parse_choices(cache, CACHE_STATES, "cache state")
        order_values = parse_choices(orders, ORDERS, "order")
        spec = parse_static(static)
        if output_shape(spec) is None:
            raise ArgumentError(f"static {describe(spec)!r} leaves the sample size to the image; batching needs one "
                                f"size: end it with a crop, e.g. {DEFAULT_STATIC!r}")
        for name, value in (("batch_size", batch_size), ("repeats", repeats)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ArgumentError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(samples, int) or samples < 0 or (src is None and samples == 0):
            raise ArgumentError(f"samples must be positive (0 means all of SRC), got {samples!r}")
        check_backend(backend, worker_values)
        if src is not None:
            check_source(src, batch_size)
        if drop_caches and not can_drop_caches():
            raise PermissionError("drop_caches needs root (writing /proc/sys/vm/drop_caches); without it the "
                                  "bench evicts with posix_fadvise, which needs no privileges")
        return cls(src=None if src is None else Path(src),
                   workdir=Path(workdir) if workdir is not None else Path(tempfile.gettempdir()),
                   variants=variants, spec=spec, workers=worker_values, batch_size=batch_size, caches=caches,
                   orders=order_values, samples=samples, repeats=repeats, quality=quality,
                   convert_workers=convert_workers, disk_test_bytes=disk_test_bytes, drop_caches=drop_caches,
                   keep=keep, backend=backend)

    @property
    def cells(self) -> list[tuple[Variant, str, int, str]]:
        """Every (variant, order, workers, cache) measured, cache state by cache state."""
        return [(v, o, w, c) for c in self.caches for v in self.variants for o in self.orders for w in self.workers]

    def to_json(self, work: Path) -> dict[str, Any]:
        """The report's ``settings`` (``work``: the run's own folder under ``workdir``)."""
        from ...transforms.static import describe

        return {
            "formats": [v.name for v in self.variants], "static": describe(self.spec), "static_spec": self.spec,
            "workers": self.workers, "batch_size": self.batch_size, "cache": self.caches, "orders": self.orders,
            "samples": self.samples, "repeats": self.repeats, "quality": self.quality,
            "convert_workers": self.convert_workers, "disk_test_bytes": self.disk_test_bytes,
            "drop_caches": self.drop_caches,
            "eviction": "posix_fadvise+drop_caches" if self.drop_caches else "posix_fadvise",
            "workdir": str(work), "kept": self.keep, "torch_threads": 1, "backend": self.backend,
            "reader": {"stores": f"dlstore.open_dataset + dlstore.loader(backend={self.backend!r}) (one get_batch "
                                 "per batch)",
                       "imagefolder": "torchvision ImageFolder + static transforms + PILToTensor, DataLoader"},
            "timing": "fresh loader per run; clock starts when every worker is up (start-up in startup_s)",
        }


def check_backend(backend: Any, workers: list[int]) -> None:
    """ArgumentError unless ``backend`` is one of BACKENDS that every ``workers`` value can use."""
    if backend not in BACKENDS:
        raise ArgumentError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    listed = ",".join(map(str, workers))
    if backend == "threads" and any(workers):
        raise ArgumentError(f"backend='threads' (--backend threads) builds batches in threads of this process, "
                            f"without worker processes; measure it with workers=0 (--num-workers 0), got {listed}")
    if backend == "ring" and 0 in workers:
        others = ",".join(str(w) for w in workers if w) or "2"
        raise ArgumentError(f"backend='ring' (--backend ring) reads through worker processes, so num_workers 0 "
                            f"cannot use it; measure workers={others} (--num-workers {others}), got {listed}")


def check_source(src: str | os.PathLike, batch_size: int) -> None:
    """ArgumentError unless SRC is a folder and not a store: bench converts images, it does not read a store."""
    from ... import formats

    takes = "bench takes an image folder (it converts it to each format and times reading each) or none " \
        "(built-in demo images)"
    if not os.path.exists(src):
        raise SourceError(f"{src}: no such folder; {takes}")
    try:
        fmt = formats.detect_format(src)
    except DlstoreError:
        fmt = None
    if fmt is None:
        if not os.path.isdir(src):
            raise ArgumentError(f"{src}: a file, not a folder; {takes}")
        return
    try:
        root = formats.get_format(fmt).read_manifest(Path(src))["source"].get("root")
    except (DlstoreError, OSError, ValueError, KeyError, TypeError):
        root = None
    origin = f" ({root})" if root else ""
    raise ArgumentError(f"{src} is a dlstore {fmt} store; {takes}: pass the folder it was converted from{origin}, "
                        f"or time reading this store with dlstore profile {src} -b {batch_size}")
