"""A dataset that lives in device memory, served a batch at a time by its loader (``loader.py``).

For datasets that fit in GPU memory (CIFAR, ImageNet subsets, most fine-tuning
sets on a large card) the fastest loader has no workers at all: the whole
dataset sits on the device, converted once to fp16 (optionally normalised), and
every batch is an ``index_select`` plus batch augmentations on the device.

The preload reads the store in chunks on threads, ahead of the copies to the
device, with bounded host memory (``preload.py``).

Before allocating anything the bytes needed are compared with what the device
has free (``torch.cuda.mem_get_info`` minus a headroom) or with ``max_memory``;
when the data does not fit, ``on_overflow`` decides: raise with the numbers,
keep uint8 on the device and convert per batch, or stream batches from the
store through pinned memory.

Every path runs unchanged with ``device="cpu"`` (no pinning, no streams), which
is how the tests cover it on machines without a GPU.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ...errors import (
    ArgumentError,
    ArgumentTypeError,
    DeviceMemoryError,
    SampleIndexError,
    VariableShapeError,
)
from ...transforms.batch import as_fill, as_padding
from ...units import human_bytes
from ..dataset import StoreDataset
from ..stores import open_dataset
from .budget import free_memory, overflow_message
from .checks import check_device, check_options
from .convert import Conversion
from .joint import JointDeviceStep, check_joint_options
from .padding import fill_vector, interior
from .partition import SubsetSource, rank_share, resolve_distributed
from .preload import preload
from .steps import against_store, plan_steps

DEFAULT_CHUNK_BYTES = 64 << 20
# uint8 bytes converted to float32 at a time: bounds the float32 workspace and keeps it in cache.
CONVERT_BLOCK_BYTES = 8 << 20


class GPUDataset(Dataset):
    """A fixed-shape store preloaded into device memory, served a batch at a time.

    ``GPUDataset(path)`` reads the store in chunks, converts each chunk on the
    device to ``dtype`` and writes it into one preallocated ``(N, C, H, W)``
    tensor; labels become a device int64 tensor. Float dtypes hold
    ``ToDtype(float32, scale=True)`` values (``[0, 1]``), normalised with
    ``(x - mean) / std`` when ``normalize`` is given, then cast once to ``dtype``:
    the same numbers as torchvision's ``ToDtype(scale=True)`` + ``Normalize``.

    Each rank of a distributed job holds the whole dataset and its loader reads a
    disjoint share of each epoch's permutation; with ``shard=True`` each rank
    holds only its share of a fixed random partition (``dlstore.data.gpu.partition``).

    Attributes:
        data: the ``(N, C, H, W)`` device tensor (``dtype``, or uint8 when
            ``mode == "uint8"``); None when ``mode == "stream"``.
        labels: device tensor of the N labels (int64), or of the (N, K) target vectors.
        targets: the labels as StoreDataset gives them (a list of ints, or an (N, K) array).
        classes: class names in label order.
        mode: ``"preload"`` (``data`` holds ``dtype``), ``"uint8"`` (uint8 on the
            device, converted per batch) or ``"stream"`` (batches read from the store).
        shape: (C, H, W) of a sample.
        needed_bytes: device bytes the full-``dtype`` preload needs (data + labels).
        nbytes: device bytes this dataset holds (data + labels).
        load_seconds: wall time of the preload (reading, uploading, converting).
        padding: (left, top, right, bottom) held around each sample in ``data``
            (``padding=``), with ``padding_mode`` and ``padding_fill``.
        sharded: True when this rank holds only its share (``shard=True``).
        store_indices: the store index of each held sample (int64 array; ``arange(N)``
            unless sharded): where sample ``i`` of this dataset came from.
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
        hold: str = "dtype",
        padding: int | Sequence[int] = 0,
        padding_mode: str = "constant",
        padding_fill: float | Sequence[float] = 0,
        shard: bool = False,
        partition_seed: int = 0,
        transform: Any = None,
        static_mismatch: str = "error",
    ):
        """Preload ``source`` onto ``device``.

        Many options, each a placement choice users set by name (memory, padding, sharding); the body
        runs them as named steps: open the source, take the share, choose the mode, preload.

        Args:
            source: a store path (anything ``open_dataset`` opens) or a dlstore
                dataset with a fixed sample shape (its ``transform`` is this dataset's
                when ``transform`` is not given).
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
            rank: with ``shard=True``, the share to hold; default torch.distributed's rank, else 0.
            world_size: with ``shard=True``, the number of shares; default torch.distributed's, else 1.
            hold: what the device holds: ``"dtype"`` (converted once at preload) or
                ``"uint8"`` (the stored bytes, half of fp16; the loader converts each
                batch, inside its fused gather where that applies: see docs/gpu.md).
            padding: pad every sample once at preload, as ``v2.Pad`` / ``RandomCrop(padding=)``
                would: an int, [left/right, top/bottom] or [left, top, right, bottom].
                A loader whose first op is a crop with this padding (and mode and fill)
                reads the padded copy instead of padding each batch: the same pixels.
                ``data`` then holds the padded samples; ``ds[i]`` still gives the sample.
            padding_mode: ``"constant"``, ``"edge"``, ``"reflect"`` or ``"symmetric"``.
            padding_fill: pixel value (0-255) of constant padding, or one per channel.
            shard: hold only this rank's share of the samples (for datasets that fit the
                cluster's devices together but not one): rank ``r`` of ``W`` holds a fixed
                random ``1/W`` of the store (see ``dlstore.data.gpu.partition`` for the
                shuffle this gives); its loader permutes that share every epoch.
            partition_seed: seed of the partition; the same on every rank.
            transform: the read-time pipeline, run per batch on the device by the loader: what
                ``open_dataset`` takes (a torchvision pipeline, a HybridTransform, dlstore batch
                transforms) or any callable on the converted batch (``gpu/steps.py``).
            static_mismatch: as ``open_dataset``'s: ``"allow"`` runs a leading deterministic op that
                differs from the store's static stage instead of refusing it.

        Raises:
            VariableShapeError: the store's samples have different shapes.
            DeviceMemoryError: the data does not fit and ``on_overflow`` does not
                allow a fallback (or the fallback does not fit either).
            ValueError: an invalid option.
            TypeError: ``source`` is neither a path nor a dlstore dataset.
        """
        check_options(dtype=dtype, hold=hold, padding_mode=padding_mode, on_overflow=on_overflow,
                       normalize=normalize, chunk_size=chunk_size, max_memory=max_memory, headroom=headroom,
                       shard=shard, rank=rank, world_size=world_size)
        self.padding: tuple[int, int, int, int] = as_padding(padding)
        self.padding_mode = padding_mode
        self.padding_fill = as_fill(padding_fill, "GPUDataset padding_fill")
        self.device = check_device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype
        self.normalize = normalize
        self.static_mismatch = static_mismatch
        transform = self._open_source(source, transform)
        if self.fields is not None:
            check_joint_options(self._name, padding=self.padding, shard=shard)
        self._take_share(rank, world_size, shard, partition_seed)
        self.pin = self.device.type == "cuda"
        self._sample_bytes = int(np.prod(self.record_shape))
        left, top, right, bottom = self.padding
        c, h, w = self.record_shape
        self._resident_shape = (c, h + top + bottom, w + left + right)
        n = len(self.source)
        self.chunk_size = min(int(chunk_size or max(1, DEFAULT_CHUNK_BYTES // self._sample_bytes)), max(1, n))
        self.conversion = Conversion(dtype, normalize, self.shape[0], self.device)
        labels = np.asarray(self.source.targets)   # (N,) int labels, or (N, K) target vectors in their dtype
        self._host_labels = labels if labels.ndim == 2 else labels.astype(np.int64, copy=False)
        self.mode = self._choose_mode(hold=hold, max_memory=max_memory, headroom=headroom, on_overflow=on_overflow)
        self._preload()
        self.transform = transform

    # --- construction steps ---------------------------------------------------------------

    def _open_source(self, source: Any, transform: Any) -> Any:
        """Open ``source`` (a path or a dataset), check it holds one shape; the transform to plan."""
        self.source = open_dataset(source) if isinstance(source, (str, os.PathLike)) else source
        if transform is None:
            transform = getattr(self.source, "transform", None)
        elif getattr(self.source, "transform", None) is not None:
            raise ArgumentError("GPUDataset: transform= given, and the source dataset has a transform of its own; "
                                "pass one of them")
        if not hasattr(self.source, "shape") or not hasattr(self.source, "read_batch"):
            raise ArgumentTypeError(f"GPUDataset takes a store path or a dlstore dataset (open_dataset(path)), "
                                    f"got {type(source).__name__}")
        if self.source.shape is None:
            raise VariableShapeError(
                f"{self._name}: samples have different shapes (a variable-shape store); GPUDataset "
                f"stacks every sample into one tensor, so it needs one shape. Convert again with "
                f"a size-fixing static op, e.g. dlstore convert SRC DST --static "
                f"'resize=256,center_crop=224'.")
        self.shape: tuple[int, int, int] = tuple(int(d) for d in self.source.shape)
        # a segmentation store's samples are held as its records: the image, then the mask's planes
        self.fields = getattr(self.source, "fields", None)
        self.record_shape = self.shape if self.fields is None else self.fields.record_shape(self.shape)
        self.classes: list[str] = list(getattr(self.source, "classes", []))
        return transform

    @property
    def _name(self) -> Any:
        return getattr(self.source, "path", type(self.source).__name__)

    def _take_share(self, rank: int | None, world_size: int | None, shard: bool, partition_seed: int) -> None:
        """With ``shard``, keep only this rank's share of the source (``partition.py``)."""
        self.rank, self.world_size = resolve_distributed(rank, world_size)
        self.sharded = shard
        total = len(self.source)
        if shard:
            self.store_indices = rank_share(total, self.rank, self.world_size, seed=int(partition_seed))
            self.source = SubsetSource(self.source, self.store_indices)
        else:
            self.store_indices = np.arange(total, dtype=np.int64)
        self.total_samples = total

    def _choose_mode(self, *, hold: str, max_memory: int | None, headroom: int | None, on_overflow: str) -> str:
        """What the device holds (``mode``), from the bytes needed against what is free; sets the budget's
        numbers (``needed_bytes``, ``available_bytes``). DeviceMemoryError when nothing allowed fits."""
        n, resident = len(self.source), int(np.prod(self._resident_shape))
        # (a segmentation store's records are held as stored: the image converted per batch)
        held_uint8 = hold == "uint8" or self.dtype == torch.uint8 or self.fields is not None
        itemsize = 1 if held_uint8 else torch.empty((), dtype=self.dtype).element_size()
        label_bytes = n * 8
        self.needed_bytes = n * resident * itemsize + label_bytes
        uint8_bytes = n * resident + label_bytes
        padded = self.padding != (0, 0, 0, 0)

        def pad_work(size: int) -> int:  # the chunk re-gathered with its border (two index_selects)
            return 2 * self.chunk_size * resident * size if padded and self.padding_mode != "constant" else 0

        # Preload buffers for float storage: on CUDA the uploaded uint8 chunk and the float32
        # block it is converted through; on CPU the two host chunks and that block. uint8
        # storage needs none: chunks go straight into place (CUDA: from pinned host memory).
        self._block = max(1, min(self.chunk_size, CONVERT_BLOCK_BYTES // self._sample_bytes))
        chunks = (2 if self.device.type == "cpu" else 1) * self.chunk_size * self._sample_bytes
        float_work = chunks + self._block * self._sample_bytes * 4
        work = (0 if held_uint8 else float_work) + pad_work(itemsize)
        free, keep = free_memory(self.device, headroom)
        limit = free if max_memory is None else (int(max_memory) if free is None else min(int(max_memory), free))
        self.available_bytes = limit

        def fits(nbytes: int, buffers: int) -> bool:
            return limit is None or nbytes + buffers <= limit

        if fits(self.needed_bytes, work):
            return "uint8" if held_uint8 and self.dtype != torch.uint8 else "preload"
        if on_overflow == "uint8" and fits(uint8_bytes, pad_work(1)):
            return "uint8"
        if on_overflow == "stream":
            return "stream"
        raise DeviceMemoryError(overflow_message(
            self._name, n, self.shape, self.dtype, self.device, self.needed_bytes, uint8_bytes, work, limit,
            max_memory, keep, on_overflow))

    def _preload(self) -> None:
        """The labels, and the samples unless streamed, onto the device (``preload.py``); on any failure
        every device tensor is let go before the error propagates."""
        n, c = len(self.source), self.shape[0]
        self.data: torch.Tensor | None = None
        self.held_fill: torch.Tensor | None = None
        self.labels: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.load_seconds = 0.0
        start = time.perf_counter()
        try:
            self.labels = torch.from_numpy(self._host_labels).to(self.device)
            if self.mode != "stream":
                storage = self.dtype if self.mode == "preload" else torch.uint8
                pixel = fill_vector(self.padding_fill, c, torch.uint8, self.device)
                # the fill as held: converted like every pixel where the data are held converted
                self.held_fill = self.conversion(pixel.view(1, c, 1, 1)).view(c) if storage != torch.uint8 else pixel
                self.data = torch.empty((n, *self._resident_shape), dtype=storage, device=self.device)
                preload(self, chunk_size=self.chunk_size, block=self._block)
        except torch.cuda.OutOfMemoryError as exc:
            self._release(exc)
            raise DeviceMemoryError(
                f"{self._name}: out of device memory while preloading {n:,} samples onto {self.device} "
                f"({exc}); pass max_memory=..., on_overflow='uint8' or on_overflow='stream'") from exc
        except BaseException as exc:
            self._release(exc)
            raise
        self.load_seconds = time.perf_counter() - start

    @property
    def transform(self) -> Any:
        return self._transform

    @transform.setter
    def transform(self, transform: Any) -> None:
        """Plan ``transform`` on the resident data (``gpu/steps.py``) for every loader made after."""
        if self.fields is not None:   # the image and its mask, together: gpu/joint.py
            self.joint = JointDeviceStep(self, transform)
            self.steps, self.already_applied = [], []
            self._transform = transform
            return
        planned = against_store(transform, self, static_mismatch=self.static_mismatch)
        self.steps = plan_steps(planned.steps(), self)
        self.already_applied = planned.already_applied
        self._transform = transform

    @property
    def fingerprint(self) -> str:
        """What identifies the samples held: the store's fingerprint and, for a share, which one."""
        base = getattr(self.source, "fingerprint", None) or str(getattr(self.source, "path", "source"))
        return f"{base}:rank{self.rank}of{self.world_size}" if self.sharded else base

    def _release(self, exc: BaseException) -> None:
        """Drop every device tensor this dataset holds, before ``exc`` propagates.

        The traceback of ``exc`` keeps the frames it passed through, and their locals
        (the chunk being written, a view of ``data``; the conversion workspace; in the
        reader thread's frames a view of ``data`` on CPU), alive as long as the caller
        keeps the exception (``pytest.raises``, a logged error, ``sys.exc_info``).
        Clearing those frames frees them now, whatever the caller does.
        """
        seen: set[int] = set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            traceback.clear_frames(exc.__traceback__)  # skips frames still running (ours)
            exc = exc.__cause__ or exc.__context__
        self.data = None
        self.labels = torch.empty(0, dtype=torch.int64)
        self.held_fill = None
        self.conversion.mean = self.conversion.std = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def read_into(self, indices: np.ndarray, out: torch.Tensor) -> torch.Tensor:
        """Samples ``indices`` of the source, uint8, gathered into the host tensor ``out`` (B, C, H, W)."""
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

    def read(self, indices: np.ndarray) -> torch.Tensor:
        """Samples ``indices`` of the source (records), uint8, in a new host tensor (pinned when on CUDA)."""
        out = torch.empty((len(indices), *self.record_shape), dtype=torch.uint8, pin_memory=self.pin)
        return self.read_into(indices, out)

    def held_samples(self) -> torch.Tensor | None:
        """The resident samples as held (a view inside any padding; a segmentation store's records);
        None in stream mode."""
        return None if self.data is None else interior(self.data, self.padding, self.record_shape)

    # --- the dataset interface ------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._host_labels)

    @property
    def targets(self) -> list[int] | np.ndarray:
        """The labels as ``StoreDataset.targets`` gives them: a list of ints, or the (N, K) target vectors."""
        return self._host_labels.tolist() if self._host_labels.ndim == 1 else self._host_labels

    @property
    def nbytes(self) -> int:
        """Device bytes held: data (if resident) and labels."""
        data = self.data.numel() * self.data.element_size() if self.data is not None else 0
        return data + self.labels.numel() * self.labels.element_size()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        """Sample ``i`` as served (``dtype``, on the device) and its int label."""
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise SampleIndexError(f"index {i} out of range for a dataset of {n} samples")
        if self.fields is not None:   # (image as served, mask)
            record = self.held_samples()[i:i + 1] if self.mode != "stream" else \
                self.read(np.array([i], dtype=np.int64)).to(self.device, non_blocking=self.pin)
            images, masks = self.fields.split(record)
            return self.conversion(images)[0], masks[0]
        label = int(self._host_labels[i]) if self._host_labels.ndim == 1 else self.labels[i]
        if self.mode == "preload":
            return self.held_samples()[i], label
        if self.mode == "uint8":
            return self.conversion(self.held_samples()[i:i + 1])[0], label
        host = self.read(np.array([i], dtype=np.int64))
        return self.conversion(host.to(self.device, non_blocking=self.pin))[0], label

    def __repr__(self) -> str:
        c, h, w = self.shape
        pad = f", padding={list(self.padding)} {self.padding_mode}" if any(self.padding) else ""
        share = f" (rank {self.rank}'s share of {self.total_samples})" if self.sharded else ""
        return (f"GPUDataset({len(self)} samples{share} of {c}x{h}x{w}{pad}, mode={self.mode}, "
                f"dtype={str(self.dtype).removeprefix('torch.')}, device={self.device}, "
                f"nbytes={human_bytes(self.nbytes)})")
