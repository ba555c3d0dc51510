"""In-memory arrays as a source: ``(images, labels)`` with images (N, H, W, C), (N, C, H, W) or (N, H, W).

``labels``: N int class indices, or an (N, K) array of target vectors (ints or bools:
stored int64; floats: stored float32; no classes).

uint8 numpy arrays or tensors. The arrays are referenced, never copied (worker
processes share them by ``fork``). Image ``i`` is handed to the static ops as the
uint8 (C, H, W) tensor ``v2.ToImage`` makes of ``images[i]``, so the stored pixels
equal ``v2.Compose([v2.ToImage(), *static])(images[i])``; with no static ops they
are ``images[i]`` itself, in CHW order. Provenance is the index ``i``.

Layout: (N, C, H, W) when only axis 1 holds 1 or 3 channels, else (N, H, W, C).

Mode: the arrays' own (one channel: ``L``, three: ``RGB``); ``mode=`` of other
channels converts each image as ``sources.items.to_image`` does.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from ..errors import ArgumentError, ArgumentTypeError
from .decode import channels_of, check_mode, mode_fingerprint
from .items import target_dtype, to_image

_CHANNELS = (1, 3)


class ArrayLoader:
    """``i -> (uint8 CHW tensor, label)`` (runs in worker processes)."""

    def __init__(self, images: Any, labels: Any, channels_first: bool, mode: str | None = None):
        self.images, self.labels, self.channels_first = images, labels, channels_first
        self.mode = mode  # None: as the arrays hold them

    def __call__(self, i: int) -> tuple[Any, int | np.ndarray]:
        import torch

        image = self.images[i]
        tensor = image if isinstance(image, torch.Tensor) else torch.from_numpy(np.asarray(image))
        if tensor.ndim == 2:
            tensor = tensor.unsqueeze(0)
        elif not self.channels_first:
            tensor = tensor.permute(2, 0, 1)
        if self.mode is not None:
            tensor = to_image(tensor, f"images[{i}]", self.mode)
        if self.labels is None:
            return tensor.contiguous(), -1
        return tensor.contiguous(), self.labels[i] if self.labels.ndim == 2 else int(self.labels[i])


class ArraySource:
    """Images ``start..stop-1`` of an array; see the module doc."""

    kind = "arrays"
    origin_kind = "index"

    def __init__(self, images: Any, labels: Any = None, *, classes: list[str] | None = None,
                 mode: str | None = None, start: int = 0, stop: int | None = None):
        import torch

        if isinstance(images, torch.Tensor):
            dtype_ok = images.dtype == torch.uint8
        elif isinstance(images, np.ndarray):
            dtype_ok = images.dtype == np.uint8
        else:
            raise ArgumentTypeError(f"images must be a uint8 numpy array or tensor, got {type(images).__name__}")
        shape = tuple(int(d) for d in images.shape)
        if not dtype_ok or len(shape) not in (3, 4):
            raise ArgumentError(f"images must be uint8 (N, H, W, C), (N, C, H, W) or (N, H, W), got "
                                f"{images.dtype} {shape}")
        self.channels_first = len(shape) == 4 and shape[1] in _CHANNELS and shape[3] not in _CHANNELS
        if len(shape) == 3:
            chw = (1, shape[1], shape[2])
        else:
            chw = (shape[1], shape[2], shape[3]) if self.channels_first else (shape[3], shape[1], shape[2])
            if chw[0] not in _CHANNELS:
                raise ArgumentError(f"images of shape {shape}: no axis of 1 or 3 channels")
        if labels is not None:
            labels = labels.numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
            if labels.ndim == 2 and labels.shape[0] == shape[0] and labels.shape[1] > 0 \
                    and target_dtype(labels.dtype) is not None:   # target vectors: int64 or float32 (N, K)
                labels, classes = np.ascontiguousarray(labels, dtype=target_dtype(labels.dtype)), []
            elif labels.shape != (shape[0],) or not np.issubdtype(labels.dtype, np.integer):
                raise ArgumentError(f"labels must be {shape[0]} integers (one per image) or an ({shape[0]}, K) "
                                    f"array of target vectors, got {labels.dtype} {labels.shape}")
        self.images, self.labels = images, labels
        # (K, dtype) of target vectors, None for int labels (see conversion.job)
        self.target_spec = None if labels is None or labels.ndim == 1 else (labels.shape[1], str(labels.dtype))
        self.mode_given = check_mode(mode) is not None
        self.mode = mode if self.mode_given else "L" if chw[0] == 1 else "RGB"
        self.channels = channels_of(self.mode)
        self.sample_shape = (self.channels, chw[1], chw[2])
        self.start, self.stop = start, shape[0] if stop is None else stop
        self.root = "<arrays>"
        if classes is None and labels is not None and len(labels):
            classes = [str(k) for k in range(int(labels.max()) + 1)] if labels.min() >= 0 else None
        self.classes = None if classes is None else list(classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes or [])}
        self.empty_classes: list[str] = []

    def __len__(self) -> int:
        return self.stop - self.start

    def item_keys(self, start: int = 0) -> range:
        return range(self.start + start, self.stop)

    def loader(self, decode: dict[str, Any] | None = None) -> ArrayLoader:
        return ArrayLoader(self.images, self.labels, self.channels_first, self.mode if self.mode_given else None)

    def origin(self, key: int) -> int:
        return key

    def where(self, key: int) -> str:
        return f"images[{key}]"

    def part(self, start: int, stop: int) -> ArraySource:
        return ArraySource(self.images, self.labels, classes=self.classes, mode=self.mode if self.mode_given else None,
                           start=self.start + start, stop=self.start + stop)

    def fingerprint(self) -> dict[str, Any]:
        # Shape, labels and 64 sampled images: cheap, and catches another array given on resume.
        h = hashlib.sha256(repr((tuple(self.images.shape), str(self.images.dtype), self.start, self.stop)).encode())
        if self.labels is not None:
            h.update(np.ascontiguousarray(self.labels).tobytes())
        n = int(self.images.shape[0])
        for i in sorted({int(k) for k in np.linspace(0, n - 1, num=min(n, 64))}):
            h.update(np.ascontiguousarray(np.asarray(self.images[i])).tobytes())
        return {"source_kind": self.kind, "source_files": len(self), "source_listing": h.hexdigest(),
                **mode_fingerprint(self.mode)}

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "root": self.root, "shape": [int(d) for d in self.images.shape],
                "layout": "NCHW" if self.channels_first else ("NHW" if self.images.ndim == 3 else "NHWC"),
                "mode": self.mode, "mode_given": self.mode_given}
