"""The callables the planner puts around a pipeline's ops.

* :class:`OnPIL`: ops that need a PIL image, given one made from the uint8 sample;
* :class:`AsWritten`: a PIL round trip the user wrote (``ToPILImage()`` ... ``PILToTensor()``), kept whole;
* :class:`Pipeline`: a plan's ops as one per-sample callable (what ``ds[i]`` runs);
* :class:`PerSample` / :class:`WholeBatch`: an op without a batch equivalent as a batch step.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import TransformSpecError
from .batch import BatchTransform
from .recognise import combined_size_rule, mutates_input, short_repr


class OnPIL:
    """``ops`` run on a PIL image made from a uint8 (C, H, W) sample, the result made a uint8 tensor again.

    The image is ``F.to_pil_image`` of the sample (RGB for 3 channels, L for 1): for a sample that
    ImageFolder's loader decoded (a store's, with the static ops it recorded), exactly the pixels
    of ImageFolder's PIL image. A PIL result comes back through ``F.pil_to_tensor`` (as
    ``PILToTensor``), to the sample's device.
    """

    def __init__(self, ops: Sequence[Any]):
        self.ops = list(ops)

    def __call__(self, x: Any) -> Any:
        from PIL import Image
        from torchvision.transforms.v2 import functional as F

        device = None
        if isinstance(x, torch.Tensor):
            if x.dtype != torch.uint8:
                raise TransformSpecError(
                    f"{self!r} needs a PIL image, made from a uint8 sample, but got {x.dtype} data: put "
                    f"{', '.join(type(op).__name__ for op in self.ops)} before the conversion to float")
            device = x.device
            x = F.to_pil_image(x.cpu())
        for op in self.ops:
            x = op(x)
        if isinstance(x, Image.Image):
            x = F.pil_to_tensor(x)
        if device is not None and isinstance(x, torch.Tensor) and x.device != device:
            x = x.to(device)
        return x

    def size_rule(self) -> str | None:
        return combined_size_rule(self.ops)

    def __repr__(self) -> str:
        return f"OnPIL({', '.join(map(short_repr, self.ops))})"


class AsWritten:
    """A run of ops kept as the user wrote it (a ``ToPILImage()`` ... ``PILToTensor()`` round trip)."""

    def __init__(self, ops: Sequence[Any]):
        self.ops = list(ops)

    def __call__(self, x: Any) -> Any:
        for op in self.ops:
            x = op(x)
        return x

    def size_rule(self) -> str | None:
        return combined_size_rule(self.ops[1:-1])

    def __repr__(self) -> str:
        return f"AsWritten([{', '.join(map(short_repr, self.ops))}])"


class Pipeline:
    """A plan's ops as one callable on one uint8 (C, H, W) sample, in order (what ``ds[i]`` runs).

    A dlstore batch transform runs on the sample as a batch of one; an op that writes into its input
    (timm's RandomErasing) gets a copy when it comes first (the sample may be a view of the store).
    """

    def __init__(self, ops: Sequence[Any]):
        self.ops = list(ops)

    def __call__(self, x: Any) -> Any:
        if self.ops and mutates_input(self.ops[0]) and isinstance(x, torch.Tensor):
            x = x.clone()
        for op in self.ops:
            x = op(x[None])[0] if isinstance(op, BatchTransform) else op(x)
        return x

    def __repr__(self) -> str:
        inner = "".join(f"\n    {op!r}," for op in self.ops)
        return f"Pipeline([{inner}\n])"


# The global generators are process-wide: a seeded step swaps their state, so steps of batches that
# loader threads build at once take turns.
GLOBAL_GENERATORS = threading.RLock()


class _Seeded:
    """A step that runs an op with torch's, Python's and numpy's global generators seeded from one
    draw of the loader's generator (their state restored after): the op's draws are reproducible
    from the loader's seed, in threads and worker processes alike."""

    def __init__(self, op: Any):
        self.op = op

    def sample(self, shape: Any, *, generator: torch.Generator | None = None,
               device: Any = "cpu") -> dict[str, torch.Tensor]:
        return {"seed": torch.randint(0, 2**62, (), generator=generator, device=device)}

    def _run(self, fn: Any, images: torch.Tensor, params: dict[str, torch.Tensor]) -> Any:
        seed = int(params["seed"])
        device = images.device
        cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        with GLOBAL_GENERATORS:
            py_state, np_state = random.getstate(), np.random.get_state()
            try:
                with torch.random.fork_rng(devices=cuda):
                    torch.default_generator.manual_seed(seed)
                    if cuda:
                        torch.cuda.default_generators[cuda[0]].manual_seed(seed)
                    random.seed(seed)
                    np.random.seed(seed % 2**32)
                    return fn(images)
            finally:
                random.setstate(py_state)
                np.random.set_state(np_state)

    def __call__(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.apply(images, self.sample(images.shape, generator=generator, device=images.device))

    def apply(self, images: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


class PerSample(_Seeded):
    """An op without a batch equivalent, run on each sample of a batch in turn.

    It draws from the global generators, as torchvision (torch's) and timm (Python's, numpy's) do:
    ``sample`` draws one seed from the loader's generator and ``apply`` runs the op on every sample
    with the global generators so seeded (restoring them after): draws reproducible from the
    loader's seed, independent per sample.
    """

    def apply(self, images: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self._run(lambda batch: [self.op(x) for x in batch], images, params)
        shapes = sorted({tuple(x.shape) for x in out})
        if len(shapes) > 1:
            raise TransformSpecError(f"{short_repr(self.op)} gave samples of different shapes {shapes[:4]}; a batch "
                                     f"is one tensor")
        return torch.stack(out)

    def __repr__(self) -> str:
        return f"PerSample({short_repr(self.op)})"


class WholeBatch(_Seeded):
    """An op that takes a (B, C, H, W) batch itself and draws per sample, in sample order, exactly as
    when given each sample in turn (timm's RandomErasing without ``num_splits``): called once, seeded
    as :class:`PerSample` is."""

    def apply(self, images: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        op = self.op
        if str(getattr(op, "device", images.device)) != str(images.device):
            import copy

            op = copy.copy(op)          # its noise made where the batch is, not copied there
            op.device = images.device
        return self._run(op, images, params)

    def __repr__(self) -> str:
        return f"WholeBatch({short_repr(self.op)})"
