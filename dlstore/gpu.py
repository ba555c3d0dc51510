"""A dataset that lives in device memory, and a loader that serves batches from there.

For datasets that fit in GPU memory (CIFAR, ImageNet subsets, most fine-tuning
sets on a large card) the fastest loader has no workers at all: the whole
dataset sits on the device, converted once to fp16 (optionally normalised), and
every batch is an ``index_select`` plus batch augmentations on the device.

Preload pipeline (bounded host memory: at most two chunks on the host)::

    reader thread                    main thread (CUDA: a side stream)
    ─────────────                    ───────────────────────────────────
    store ─read─▶ host chunk k+1     host chunk k ─copy, non_blocking─▶ device uint8
    (pinned when the device is       ─to float32, /255, (x-mean)/std─▶ dtype
     CUDA)                           ─▶ data[start:stop] of one preallocated tensor

Before allocating anything the bytes needed are compared with what the device
has free (``torch.cuda.mem_get_info`` minus a headroom) or with ``max_memory``;
when the data does not fit, ``on_overflow`` decides: raise with the numbers,
keep uint8 on the device and convert per batch, or stream batches from the
store through pinned memory.

Every path runs unchanged with ``device="cpu"`` (no pinning, no streams), which
is how the tests cover it on machines without a GPU.
"""

from __future__ import annotations

import inspect
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from .dataset import StoreDataset, open_dataset
from .errors import DeviceMemoryError, StoreCorruptError, VariableShapeError
from .transforms import BatchCompose, BatchTransform
from .tuning import usable_cpus
from .units import human_bytes

ON_OVERFLOW = ("error", "uint8", "stream")
DEFAULT_CHUNK_BYTES = 64 << 20
# uint8 bytes converted to float32 at a time: bounds the float32 workspace and keeps it in cache.
CONVERT_BLOCK_BYTES = 8 << 20
# Served bytes per group of batches that the loader gathers and augments in one go.
GROUP_BYTES = 64 << 20
# Kept free on a CUDA device on top of the dataset: the model, activations and the
# allocator's own slack have to live somewhere.
MIN_HEADROOM = 1 << 30
HEADROOM_FRACTION = 0.05

BatchFn = Callable[..., torch.Tensor]



def _free_memory(device: torch.device, headroom: int | None) -> tuple[int | None, int]:
    """(bytes free for the dataset on ``device`` after the headroom, headroom), or None if unknown."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        keep = max(MIN_HEADROOM, int(total * HEADROOM_FRACTION)) if headroom is None else int(headroom)
        return max(0, free - keep), keep
    if device.type == "cpu":
        keep = MIN_HEADROOM if headroom is None else int(headroom)
        try:
            with open("/proc/meminfo", encoding="ascii") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return max(0, int(line.split()[1]) * 1024 - keep), keep
        except OSError:
            pass
        return None, keep
    return None, 0


def _resolve_distributed(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): the given values, else torch.distributed's, else (0, 1)."""
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    world_size, rank = int(world_size), int(rank)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return rank, world_size


class _Prefetcher:
    """Runs ``fn(job)`` for each job in a background thread, ``depth`` results ahead at most.

    Iterating yields the results in order. A result counts as in use until the
    consumer asks for the next one, so at most ``depth`` results (host buffers)
    exist at a time. An exception in the thread is re-raised in the consumer;
    ``close()`` (also called when iteration ends or is abandoned) stops the thread.
    """

    def __init__(self, jobs: Iterable[Any], fn: Callable[[Any], Any], depth: int = 2):
        self._jobs = iter(jobs)
        self._fn = fn
        self._slots = threading.Semaphore(max(1, depth))
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dlstore-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for job in self._jobs:
                while not self._slots.acquire(timeout=0.1):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                self._queue.put((True, self._fn(job)))
            self._queue.put((False, None))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._queue.put((False, exc))

    def __iter__(self) -> Iterator[Any]:
        try:
            first = True
            while True:
                if not first:
                    self._slots.release()  # the consumer is done with the previous result
                first = False
                more, item = self._queue.get()
                if not more:
                    if item is not None:
                        raise item
                    return
                yield item
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        self._slots.release()  # wake a producer waiting for a slot
        self._thread.join()


class _ShardRanges:
    """Contiguous sample ranges of a fixed-shape shards store, read straight into a buffer.

    The preload reads samples in order, so it can skip the gather of
    ``Reader.get_batch`` (``np.take`` from the memory map, ~5 GB/s on one core)
    and ``preadv`` each shard file's byte range into the (pinned) chunk, 8 MiB
    pieces in up to 8 threads instead (~17 GB/s from the page cache per thread, GIL released).
    The layout it relies on is the documented one of ``dlstore.formats.shards``:
    ``shard-NNNNN.npy`` files of uint8 ``(count, C, H, W)`` in sample order.
    """

    PIECE = 8 << 20

    def __init__(self, files: list[Any], counts: list[int], shape: tuple[int, ...], sample_bytes: int):
        self.files = files
        self.counts = counts
        self.shape = shape
        self.sample_bytes = sample_bytes
        self.firsts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._fds: dict[int, tuple[int, int]] = {}  # file number -> (fd, data offset)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=min(8, usable_cpus()), thread_name_prefix="dlstore-read")

    @classmethod
    def for_source(cls, source: Any, sample_bytes: int) -> _ShardRanges | None:
        """The fast path for a plain fixed-shape shards store, else None (use ``read_batch``)."""
        reader = getattr(source, "reader", None)
        if getattr(reader, "format", None) != "shards" or getattr(reader, "kind", None) != "fixed":
            return None
        try:
            counts = [int(entry["count"]) for entry in reader.manifest["layout"]["shards"]]
        except (KeyError, TypeError, ValueError):
            return None
        files = list(reader.files)
        if len(files) != len(counts) or sum(counts) != len(source):
            return None
        return cls(files, counts, tuple(reader.shape), sample_bytes)

    def _open(self, k: int) -> tuple[int, int]:
        with self._lock:
            if k in self._fds:
                return self._fds[k]
            path = self.files[k]
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise StoreCorruptError(f"{path}: missing data file named in the manifest") from None
            try:
                with open(path, "rb") as f:
                    version = np.lib.format.read_magic(f)
                    header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                              else np.lib.format.read_array_header_2_0)
                    shape, fortran, dtype = header(f)
                    offset = f.tell()
                size = os.fstat(fd).st_size
            except (ValueError, OSError) as exc:
                os.close(fd)
                raise StoreCorruptError(f"{path}: unreadable .npy file ({exc})") from exc
            want = (self.counts[k], *self.shape)
            if dtype != np.uint8 or fortran or tuple(shape) != want or size < offset + self.counts[k] * self.sample_bytes:
                os.close(fd)
                raise StoreCorruptError(
                    f"{path}: holds {dtype} {tuple(shape)} in {size:,} bytes, manifest expects uint8 {want} "
                    f"({offset + self.counts[k] * self.sample_bytes:,} bytes); the file is damaged or truncated")
            self._fds[k] = (fd, offset)
            return fd, offset

    def _read_piece(self, k: int, file_offset: int, view: memoryview) -> None:
        fd, offset = self._open(k)
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + file_offset + done)
            if got <= 0:
                raise StoreCorruptError(f"{self.files[k]}: ended early (truncated while reading?)")
            done += got

    def read(self, start: int, stop: int, out: np.ndarray) -> None:
        """Samples ``[start, stop)`` into the C-contiguous uint8 array ``out``."""
        flat = memoryview(out.reshape(-1))
        jobs = []
        i = start
        while i < stop:
            k = int(np.searchsorted(self.firsts, i, side="right")) - 1
            j = min(stop, int(self.firsts[k + 1]))
            first_byte = (i - start) * self.sample_bytes
            nbytes = (j - i) * self.sample_bytes
            local = (i - int(self.firsts[k])) * self.sample_bytes
            for p in range(0, nbytes, self.PIECE):
                q = min(nbytes, p + self.PIECE)
                jobs.append(self._pool.submit(self._read_piece, k, local + p,
                                              flat[first_byte + p:first_byte + q]))
            i = j
        for job in jobs:
            job.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()


class GPUDataset:
    """A fixed-shape store preloaded into device memory, served a batch at a time.

    ``GPUDataset(path)`` reads the store in chunks, converts each chunk on the
    device to ``dtype`` and writes it into one preallocated ``(N, C, H, W)``
    tensor; labels become a device int64 tensor. Float dtypes hold
    ``ToDtype(float32, scale=True)`` values (``[0, 1]``), normalised with
    ``(x - mean) / std`` when ``normalize`` is given, then cast once to ``dtype``:
    the same numbers as torchvision's ``ToDtype(scale=True)`` + ``Normalize``.

    Each rank of a distributed job holds the whole dataset; its loader reads a
    disjoint share of each epoch's permutation.

    Attributes:
        data: the ``(N, C, H, W)`` device tensor (``dtype``, or uint8 when
            ``mode == "uint8"``); None when ``mode == "stream"``.
        targets: device int64 tensor of the N labels.
        classes: class names in label order.
        mode: ``"preload"`` (``data`` holds ``dtype``), ``"uint8"`` (uint8 on the
            device, converted per batch) or ``"stream"`` (batches read from the store).
        shape: (C, H, W) of a sample.
        needed_bytes: device bytes the full-``dtype`` preload needs (data + labels).
        nbytes: device bytes this dataset holds (data + labels).
        load_seconds: wall time of the preload (reading, uploading, converting).
    """

    def __init__(
        self,
        source: str | os.PathLike | StoreDataset,
        device: str | torch.device = "cuda",
        dtype: torch.dtype = torch.float16,
        *,
        normalize: tuple[Sequence[float], Sequence[float]] | None = None,
        chunk_size: int | None = None,
        max_memory: int | None = None,
        on_overflow: str = "error",
        headroom: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        """Preload ``source`` onto ``device``.

        Args:
            source: a store path (anything ``open_dataset`` opens) or a dlstore
                dataset with a fixed sample shape. Its per-sample ``transform`` is
                not applied: pass batch transforms to :meth:`loader`.
            device: where the data lives (``"cuda"``, ``"cuda:1"``, ``"cpu"``).
            dtype: dtype of the served images: a float dtype (scaled to ``[0, 1]``,
                then normalised if asked) or ``torch.uint8`` (as stored).
            normalize: ``(mean, std)``, one value per channel, applied after scaling.
            chunk_size: samples per preload chunk; default: about 64 MiB of uint8.
            max_memory: most device bytes the dataset may take (data + labels +
                preload buffers); also applies to ``device="cpu"``. Default: what
                the device has free minus ``headroom``.
            on_overflow: when the data in ``dtype`` does not fit: ``"error"``
                raises :class:`DeviceMemoryError`; ``"uint8"`` keeps uint8 on the
                device (half of fp16) and converts each batch; ``"stream"`` serves
                batches read from the store through pinned host memory.
            headroom: device bytes left free besides the dataset; default on CUDA
                the larger of 1 GiB and 5 % of the card, on CPU 1 GiB of RAM.
            rank: this process's rank; default torch.distributed's, else 0.
            world_size: number of ranks; default torch.distributed's, else 1.

        Raises:
            VariableShapeError: the store's samples have different shapes.
            DeviceMemoryError: the data does not fit and ``on_overflow`` does not
                allow a fallback (or the fallback does not fit either).
            ValueError: an invalid option.
            TypeError: ``source`` is neither a path nor a dlstore dataset.
        """
        if on_overflow not in ON_OVERFLOW:
            raise ValueError(f"on_overflow must be one of {', '.join(map(repr, ON_OVERFLOW))}, "
                             f"got {on_overflow!r}")
        if not (dtype.is_floating_point or dtype == torch.uint8):
            raise ValueError(f"dtype must be a floating dtype or torch.uint8, got {dtype}")
        if normalize is not None and dtype == torch.uint8:
            raise ValueError("normalize needs a floating dtype (e.g. torch.float16), not torch.uint8")
        self.source = open_dataset(source) if isinstance(source, (str, os.PathLike)) else source
        name = getattr(self.source, "path", type(self.source).__name__)
        if not hasattr(self.source, "shape") or not hasattr(self.source, "read_batch"):
            raise TypeError(f"GPUDataset takes a store path or a dlstore dataset (open_dataset(path)), "
                            f"got {type(source).__name__}")
        shape = self.source.shape
        if shape is None:
            raise VariableShapeError(
                f"{name}: samples have different shapes (a variable-shape store); GPUDataset "
                f"stacks every sample into one tensor, so it needs one shape. Convert again with "
                f"a size-fixing static op, e.g. dlstore convert SRC DST --static "
                f"'resize=256,center_crop=224'.")
        self.shape: tuple[int, int, int] = tuple(int(d) for d in shape)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype
        self.classes: list[str] = list(getattr(self.source, "classes", []))
        self.rank, self.world_size = _resolve_distributed(rank, world_size)
        self._pin = self.device.type == "cuda"
        self._sample_bytes = int(np.prod(self.shape))
        n = len(self.source)
        if chunk_size is None:
            chunk_size = max(1, DEFAULT_CHUNK_BYTES // self._sample_bytes)
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = min(int(chunk_size), max(1, n))
        if normalize is not None:
            mean, std = normalize
            mean_t = torch.as_tensor(mean, dtype=torch.float32).reshape(-1)
            std_t = torch.as_tensor(std, dtype=torch.float32).reshape(-1)
            c = self.shape[0]
            if mean_t.numel() not in (1, c) or std_t.numel() not in (1, c):
                raise ValueError(f"normalize needs 1 or {c} values for mean and std, got "
                                 f"{mean_t.numel()} and {std_t.numel()}")
            if (std_t == 0).any():
                raise ValueError(f"normalize: std must not be zero, got {std_t.tolist()}")
            self._mean = mean_t.view(1, -1, 1, 1).to(self.device)
            self._std = std_t.view(1, -1, 1, 1).to(self.device)
        else:
            self._mean = self._std = None
        self.normalize = normalize

        labels = getattr(self.source, "_labels", None)
        if labels is None:
            labels = np.asarray(self.source.targets, dtype=np.int64)
        self._host_labels = np.asarray(labels, dtype=np.int64)

        itemsize = torch.empty((), dtype=dtype).element_size()
        label_bytes = n * 8
        self.needed_bytes = n * self._sample_bytes * itemsize + label_bytes
        uint8_bytes = n * self._sample_bytes + label_bytes
        # Preload buffers for float storage: on CUDA the uploaded uint8 chunk and the float32
        # block it is converted through; on CPU the two host chunks and that block. uint8
        # storage needs none: chunks go straight into place (CUDA: from pinned host memory).
        self._block = max(1, min(self.chunk_size, CONVERT_BLOCK_BYTES // self._sample_bytes))
        chunks = (2 if self.device.type == "cpu" else 1) * self.chunk_size * self._sample_bytes
        float_work = chunks + self._block * self._sample_bytes * 4
        work = float_work if dtype != torch.uint8 else 0
        free, keep = _free_memory(self.device, headroom)
        limit = free if max_memory is None else (int(max_memory) if free is None else min(int(max_memory), free))
        self.available_bytes = limit

        def fits(nbytes: int, buffers: int) -> bool:
            return limit is None or nbytes + buffers <= limit

        if fits(self.needed_bytes, work):
            self.mode = "preload"
        elif on_overflow == "uint8" and fits(uint8_bytes, 0):
            self.mode = "uint8"
        elif on_overflow == "stream":
            self.mode = "stream"
        else:
            raise DeviceMemoryError(self._overflow_message(
                name, n, uint8_bytes, work, limit, max_memory, keep, on_overflow))

        self.data: torch.Tensor | None = None
        self.targets: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self._ranges: _ShardRanges | None = None
        self.load_seconds = 0.0
        start = time.perf_counter()
        try:
            self.targets = torch.from_numpy(self._host_labels).to(self.device)
            if self.mode != "stream":
                storage = dtype if self.mode == "preload" else torch.uint8
                self.data = torch.empty((n, *self.shape), dtype=storage, device=self.device)
                self._preload()
        except torch.cuda.OutOfMemoryError as exc:
            self._release()
            raise DeviceMemoryError(
                f"{name}: out of device memory while preloading {n:,} samples onto {self.device} "
                f"({exc}); pass max_memory=..., on_overflow='uint8' or on_overflow='stream'") from exc
        except BaseException:
            self._release()
            raise
        self.load_seconds = time.perf_counter() - start

    # --- construction helpers -------------------------------------------------------------

    def _overflow_message(self, name: Any, n: int, uint8_bytes: int, work: int,
                          limit: int, max_memory: int | None, keep: int, on_overflow: str) -> str:
        c, h, w = self.shape
        dtype_name = str(self.dtype).removeprefix("torch.")
        where = (f"max_memory={human_bytes(limit)}" if max_memory is not None and limit == max_memory
                 else f"{human_bytes(limit)} free on {self.device} after keeping {human_bytes(keep)} headroom")
        lines = [
            f"{name}: {n:,} samples of {c}x{h}x{w} {dtype_name} need {human_bytes(self.needed_bytes)}"
            + (f" (+ {human_bytes(work)} of preload buffers)" if work else "")
            + f" on {self.device}, but only {where}.",
        ]
        if on_overflow == "uint8":
            lines.append(f"Even uint8 (on_overflow='uint8') needs {human_bytes(uint8_bytes)}.")
        lines.append("Options:")
        if on_overflow != "uint8" and self.dtype != torch.uint8:
            fit = "fits" if uint8_bytes <= limit else "does not fit either"
            lines.append(f"  on_overflow='uint8'   keep uint8 on the device, convert per batch "
                         f"({human_bytes(uint8_bytes)}: {fit})")
        lines.append("  on_overflow='stream'  read batches from the store through pinned memory")
        lines.append("  max_memory=BYTES / headroom=BYTES  change the budget; a smaller chunk_size "
                     "shrinks the preload buffers")
        return "\n".join(lines)

    def _release(self) -> None:
        """Drop every device tensor this dataset holds (used on error paths)."""
        self.data = None
        self.targets = torch.empty(0, dtype=torch.int64)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _read_into(self, indices: np.ndarray, out: torch.Tensor) -> torch.Tensor:
        """Samples ``indices`` of the source, uint8, gathered into ``out`` (B, C, H, W)."""
        reader = getattr(self.source, "reader", None)
        get_batch = getattr(reader, "get_batch", None)
        if get_batch is not None:  # every dlstore reader fills a given out= (fixed-shape stores)
            get_batch(indices, out=out.numpy())
            return out
        images, _ = self.source.read_batch(indices.tolist())
        if isinstance(images, list):
            images = torch.stack(images)
        if tuple(images.shape[1:]) != self.shape:
            raise VariableShapeError(f"source returned samples of shape {tuple(images.shape[1:])}, "
                                     f"expected {self.shape}")
        out.copy_(images)
        return out

    def _host_buffer(self, count: int) -> torch.Tensor:
        return torch.empty((count, *self.shape), dtype=torch.uint8, pin_memory=self._pin)

    def _read_chunk(self, bounds: tuple[int, int]) -> tuple[int, int, torch.Tensor]:
        start, stop = bounds
        if self.device.type == "cpu" and self.data.dtype == torch.uint8:
            buf = self.data[start:stop]  # nothing to convert or upload: read straight into place
        else:
            buf = self._host_buffer(stop - start)
        if self._ranges is not None:
            self._ranges.read(start, stop, buf.numpy())
            return start, stop, buf
        return start, stop, self._read_into(np.arange(start, stop, dtype=np.int64), buf)

    def _preload(self) -> None:
        n = len(self._host_labels)
        bounds = [(s, min(s + self.chunk_size, n)) for s in range(0, n, self.chunk_size)]
        self._ranges = _ShardRanges.for_source(self.source, self._sample_bytes)
        try:
            self._upload(bounds)
        finally:
            if self._ranges is not None:
                self._ranges.close()
            self._ranges = None

    def _upload(self, bounds: list[tuple[int, int]]) -> None:
        side = None
        if self.device.type == "cuda":
            side = torch.cuda.Stream(self.device)
            # The side stream must see what the default stream did first (the data tensor,
            # mean and std uploaded from pageable memory).
            side.wait_stream(torch.cuda.current_stream(self.device))
        workspace = None
        if self.data.dtype != torch.uint8:
            with torch.cuda.stream(side) if side is not None else nullcontext():
                workspace = torch.empty((self._block, *self.shape), dtype=torch.float32, device=self.device)
        prefetcher = _Prefetcher(bounds, self._read_chunk, depth=2)
        try:
            for start, stop, host in prefetcher:
                target = self.data[start:stop]
                if side is None:
                    if host.data_ptr() != target.data_ptr():
                        self._convert_into(host, target, workspace)
                    continue
                with torch.cuda.stream(side):
                    if workspace is None:
                        target.copy_(host, non_blocking=True)
                    else:
                        self._convert_into(host.to(self.device, non_blocking=True), target, workspace)
                # The host chunk goes back to the reader once its copy is done; meanwhile the
                # reader thread has been filling the next one.
                side.synchronize()
        finally:
            prefetcher.close()
            if side is not None:  # also on error: nothing may still write into freed memory
                side.synchronize()
        if side is not None:
            torch.cuda.current_stream(self.device).wait_stream(side)

    def _convert_into(self, images: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor | None) -> None:
        """Write uint8 ``images`` (on the device, or a host chunk on CPU) into ``out``.

        Float output goes through ``workspace`` (float32) a block at a time, with the
        same operations as :meth:`_to_float32`, so both give identical numbers.
        """
        if workspace is None:
            out.copy_(images)
            return
        for b in range(0, len(images), len(workspace)):
            e = min(len(images), b + len(workspace))
            x = workspace[:e - b]
            x.copy_(images[b:e])
            x.mul_(1.0 / 255.0)
            if self._mean is not None:
                x.sub_(self._mean).div_(self._std)
            out[b:e].copy_(x)

    def _to_float32(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(torch.float32).mul_(1.0 / 255.0)
        if self._mean is not None:
            x.sub_(self._mean).div_(self._std)
        return x

    def _finish(self, images: torch.Tensor) -> torch.Tensor:
        """A uint8 batch on the device -> what ``dtype`` promises."""
        if self.dtype == torch.uint8:
            return images
        return self._to_float32(images).to(self.dtype)

    # --- the dataset interface ------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._host_labels)

    @property
    def nbytes(self) -> int:
        """Device bytes held: data (if resident) and labels."""
        data = self.data.numel() * self.data.element_size() if self.data is not None else 0
        return data + self.targets.numel() * self.targets.element_size()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        """Sample ``i`` as served (``dtype``, on the device) and its int label."""
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for a dataset of {n} samples")
        label = int(self._host_labels[i])
        if self.mode == "preload":
            return self.data[i], label
        if self.mode == "uint8":
            return self._finish(self.data[i:i + 1])[0], label
        host = self._read_into(np.array([i], dtype=np.int64), self._host_buffer(1))
        return self._finish(host.to(self.device, non_blocking=self._pin))[0], label

    def loader(
        self,
        batch_size: int,
        shuffle: bool = True,
        *,
        drop_last: bool = False,
        transform: BatchFn | None = None,
        seed: int | None = None,
        channels_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        prefetch: int = 2,
    ) -> GPULoader:
        """Batches ``(images, labels)`` on the device; see :class:`GPULoader`."""
        return GPULoader(self, batch_size, shuffle, drop_last=drop_last, transform=transform,
                         seed=seed, channels_last=channels_last,
                         rank=self.rank if rank is None else rank,
                         world_size=self.world_size if world_size is None else world_size,
                         prefetch=prefetch)

    def __repr__(self) -> str:
        c, h, w = self.shape
        return (f"GPUDataset({len(self)} samples of {c}x{h}x{w}, mode={self.mode}, "
                f"dtype={str(self.dtype).removeprefix('torch.')}, device={self.device}, "
                f"nbytes={human_bytes(self.nbytes)})")


def _per_sample(transform: Any) -> bool:
    """Whether ``transform`` draws independent randomness per sample (dlstore batch transforms do),
    so that running it on several batches at once changes nothing but the random stream."""
    if isinstance(transform, BatchCompose):
        return all(_per_sample(t) for t in transform.transforms)
    return isinstance(transform, BatchTransform)


def _accepts_generator(transform: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(transform).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return "generator" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class GPULoader:
    """Iterates a :class:`GPUDataset` in batches of device tensors, one epoch per ``iter``.

    Each epoch draws a permutation with ``torch.randperm`` on the device from a
    generator seeded with ``seed + epoch``, so the same seed gives the same order
    and each epoch a new one. The epoch advances by one after each iteration;
    ``set_epoch(e)`` sets it, as with ``DistributedSampler``.

    With ``world_size > 1`` the permutation is padded by wrapping to a multiple
    of ``world_size`` and rank ``r`` takes every ``world_size``-th index from
    ``r``: shares are disjoint (up to the < ``world_size`` padded repeats),
    together complete, and equal in length, so every rank runs the same number
    of batches. Every rank must use the same seed (default 0 when distributed).

    Batches: ``index_select`` on the device, conversion when the data is held
    as uint8, then ``transform(images, generator=g)`` (a batch transform from
    ``dlstore.transforms``; a callable without a ``generator`` parameter is
    called with the images alone), then optionally channels_last. When the
    transform is made only of ``dlstore.transforms`` batch transforms (whose
    randomness is per sample) or is None, these steps run on groups of
    ``group_batches`` batches (about 64 MiB of output) and the batches are
    slices of the result: the same distribution of outputs with far fewer
    kernel launches. Any other callable sees one batch at a time.
    """

    def __init__(
        self,
        dataset: GPUDataset,
        batch_size: int,
        shuffle: bool = True,
        *,
        drop_last: bool = False,
        transform: BatchFn | None = None,
        seed: int | None = None,
        channels_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        prefetch: int = 2,
    ):
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.transform = transform
        self._transform_takes_generator = transform is not None and _accepts_generator(transform)
        self.channels_last = channels_last
        self.rank, self.world_size = _resolve_distributed(rank, world_size)
        if seed is None:
            # Every rank must draw the same permutation: a fixed default, like DistributedSampler.
            seed = 0 if self.world_size > 1 else int(torch.randint(0, 2**62, ()).item())
        self.seed = int(seed)
        self.prefetch = max(1, int(prefetch))
        self.epoch = 0
        self.group_batches = self._group_size()
        device = dataset.device
        self._perm_gen = torch.Generator(device=device)
        self._aug_gen = torch.Generator(device=device)

    def _group_size(self) -> int:
        """Batches gathered and augmented together: 1 unless the transform is per-sample."""
        ds = self.dataset
        if ds.mode == "stream" or (self.transform is not None and not _per_sample(self.transform)):
            return 1
        itemsize = torch.empty((), dtype=ds.dtype).element_size()
        sample = int(np.prod(ds.shape)) * itemsize
        return max(1, GROUP_BYTES // (sample * self.batch_size))

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s permutation for the next iteration (and count on from there)."""
        self.epoch = int(epoch)

    @property
    def num_samples(self) -> int:
        """Samples this rank sees per epoch (including the wrap-around padding)."""
        return math.ceil(len(self.dataset) / self.world_size)

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    def indices(self, epoch: int | None = None) -> torch.Tensor:
        """This rank's sample order for ``epoch`` (default: the next one), on the device."""
        epoch = self.epoch if epoch is None else int(epoch)
        n = len(self.dataset)
        device = self.dataset.device
        if self.shuffle:
            self._perm_gen.manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=self._perm_gen, device=device)
        else:
            order = torch.arange(n, device=device)
        if self.world_size > 1:
            total = self.num_samples * self.world_size
            if total > n:
                order = order.repeat(math.ceil(total / n))[:total]
            order = order[self.rank:total:self.world_size]
        return order

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch = self.epoch
        self.epoch += 1
        order = self.indices(epoch)
        # Augmentation randomness differs per epoch and per rank, yet is reproducible.
        self._aug_gen.manual_seed((self.seed * 1_000_003 + epoch * 7_919 + self.rank) % (2**63))
        count = len(self) * self.batch_size if self.drop_last else len(order)
        batches = [(s, min(s + self.batch_size, count)) for s in range(0, count, self.batch_size)]
        ds = self.dataset
        if ds.mode == "stream":
            yield from self._stream(order, batches)
            return
        # Gather, convert and augment a group of batches at once, then hand out slices:
        # the per-batch cost becomes two views instead of a few dozen kernel launches.
        step = self.group_batches * self.batch_size
        for g0 in range(0, count, step):
            idx = order[g0:min(count, g0 + step)]
            images = ds.data.index_select(0, idx)
            if ds.mode == "uint8":
                images = ds._finish(images)
            images = self._augment(images)
            labels = ds.targets.index_select(0, idx)
            for s in range(0, len(idx), self.batch_size):
                yield images[s:s + self.batch_size], labels[s:s + self.batch_size]

    def _augment(self, images: torch.Tensor) -> torch.Tensor:
        if self.transform is not None:
            if self._transform_takes_generator:
                images = self.transform(images, generator=self._aug_gen)
            else:
                images = self.transform(images)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images

    def _stream(self, order: torch.Tensor, batches: list[tuple[int, int]]
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        ds = self.dataset
        host_order = order.cpu().numpy()

        def read(bounds: tuple[int, int]) -> torch.Tensor:
            start, stop = bounds
            return ds._read_into(host_order[start:stop], ds._host_buffer(stop - start))

        prefetcher = _Prefetcher(batches, read, depth=self.prefetch)
        try:
            for (start, stop), host in zip(batches, prefetcher):
                images = ds._finish(host.to(ds.device, non_blocking=ds._pin))
                labels = ds.targets.index_select(0, order[start:stop])
                yield self._augment(images), labels
        finally:
            prefetcher.close()
