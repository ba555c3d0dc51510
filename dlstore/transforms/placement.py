"""How each op of a pipeline runs on a store's uint8 (C, H, W) samples, and which leading ops the
store's static stage already applied.

A pipeline written for ImageFolder gives its first ops a PIL image, up to its conversion to a
tensor (``PILToTensor``, ``ToImage``, ``ToTensor``, timm's ``MaybeToTensor`` ...); a store hands
out the uint8 tensor that conversion would have made. :func:`place` walks the pipeline with
that in mind:

* ops the pipeline gave a PIL image: the store's recorded static ops are not run again; a
  random op proven tensor-safe (``recognise.tensor_safe``) runs on the tensor (the fast path);
  any other op (a static op the store did not record, timm's RandAugment, a callable dlstore
  cannot see into) gets a PIL image made from the sample (:class:`OnPIL`), as ImageFolder gave it;
* the conversion: ``PILToTensor`` / ``ToImage`` / ``ToPureTensor`` / ``ToNumpy`` are dropped (the
  sample is that tensor already); a dividing ``ToTensor`` becomes v1 ``ConvertImageDtype``, its
  exact arithmetic on a uint8 tensor;
* ops the pipeline gave a tensor run as given; a round trip the user wrote (``ToPILImage()`` ...
  ``PILToTensor()``) runs as written (:class:`AsWritten`).

A pipeline with no conversion was written for tensors (dlstore's documented input): its ops run
as given, but for those known to need a PIL image (timm's auto-augmentations), which get one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import TransformSpecError
from .recognise import (
    conversion,
    float_replacement,
    is_float_op,
    library,
    needs_pil,
    on_tensor,
    scaling_replacement,
    short_repr,
    static_of,
    tensor_safe,
)
from .wrappers import AsWritten, OnPIL

DROPPED = "dropped (stores hold uint8 CHW tensors already)"


@dataclass
class Placed:
    """A pipeline placed on uint8 samples.

    Attributes:
        ops: what runs, in order: per-sample callables on a uint8 (C, H, W) tensor.
        stripped: (op, why) of each op of the pipeline that does not run.
        notes: how each op was placed, and why.
    """

    ops: list[Any] = field(default_factory=list)
    stripped: list[tuple[Any, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def initial_state(ops: Sequence[Any]) -> str:
    """``"pil"`` when the pipeline's first conversion turns a PIL image into a tensor (its first ops
    were written for PIL input), ``"tensor"`` when it is a ``ToPILImage`` or there is none."""
    for op in ops:
        kind = conversion(op)
        if kind in ("uint8", "scale", "float"):
            return "pil"
        if kind == "pil":
            return "tensor"
    return "tensor"


class _Walk:
    """The state of :func:`place`'s walk: what the pipeline's next op was given (``state``: "pil" or
    "tensor"), whether the data are float yet, the run of ops waiting for a PIL image."""

    def __init__(self, state: str):
        self.state = state
        self.floating = False
        self.last_float: Any = None
        self.pil_run: list[Any] = []
        self.segment: list[Any] | None = None
        self.out = Placed()

    def flush(self) -> None:
        if self.pil_run:
            self.out.ops.append(OnPIL(self.pil_run))
            self.pil_run = []

    def run(self, op: Any, note: str = "") -> None:
        self.flush()
        self.out.ops.append(op)
        if note:
            self.out.notes.append(note)
        if is_float_op(op):
            self.floating, self.last_float = True, op

    def on_pil(self, op: Any, why: str) -> None:
        if self.floating:
            raise TransformSpecError(
                f"{short_repr(op)} needs a PIL image, but here it gets float data (after "
                f"{short_repr(self.last_float)}); put it "
                f"before the conversion to float, where torchvision's pipelines give it a PIL image")
        self.pil_run.append(op)
        self.out.notes.append(f"{type(op).__name__}: gets a PIL image made from the uint8 sample ({why})")


def place(ops: Sequence[Any], *, taken: int = 0, taken_reason: str = "", state: str | None = None) -> Placed:
    """Place ``ops`` (a flat pipeline) on uint8 samples (see the module doc).

    Args:
        ops: the pipeline's ops, flattened (``recognise.unwrap``).
        taken: how many leading ops do not run (the store applied them), each recorded in
            ``stripped`` with ``taken_reason`` (conversions among them with theirs).
        state: what the first op is given ("pil" or "tensor"); default ``initial_state(ops)``.

    Raises:
        TransformSpecError: an op known to need a PIL image comes after the data became float, a
            v1 ToTensor gets a tensor (it would fail on it in the original pipeline too), or the
            pipeline ends on a PIL image.
    """
    walk = _Walk(initial_state(ops) if state is None else state)
    for k, op in enumerate(ops):
        kind = conversion(op)
        name = type(op).__name__
        if walk.segment is not None:            # inside a ToPILImage ... conversion the user wrote
            walk.segment.append(op)
            if kind in ("uint8", "scale", "float"):
                walk.run(AsWritten(walk.segment), f"{name}: ends a PIL round trip written in the pipeline, "
                                                  f"kept as written")
                walk.segment, walk.state = None, "tensor"
                walk.floating = walk.floating or kind != "uint8"
            continue
        if k < taken:
            walk.out.stripped.append((op, DROPPED if kind == "uint8" else taken_reason))
            walk.state = "tensor" if kind == "uint8" else walk.state
            continue
        if kind == "pil":
            walk.flush()
            walk.segment = [op]
        elif kind:
            _convert(walk, op, kind)
        elif walk.state == "pil" and tensor_safe(op):
            twin = on_tensor(op)
            walk.run(twin, "" if twin is op else f"{name}: given a PIL image in the pipeline; on the uint8 "
                                                  "tensor it resamples with v2's kernel, the closer to PIL's")
        elif walk.state == "pil":
            why = ("as ImageFolder ran it; the store did not record it" if static_of(op) is not None else
                   "known to need one" if needs_pil(op) else "not proven to take a tensor")
            walk.on_pil(op, why)
        elif needs_pil(op):
            walk.on_pil(op, "known to need one")
        else:
            walk.run(op)
    walk.flush()
    if walk.segment is not None:
        raise TransformSpecError(
            f"the transform ends on a PIL image (after {short_repr(walk.segment[0])}), but samples and batches are "
            f"tensors: add v2.PILToTensor() after {short_repr(walk.segment[-1])}")
    return walk.out


def _convert(walk: _Walk, op: Any, kind: str) -> None:
    """A conversion to a tensor, on the uint8 tensor a store gives."""
    name = type(op).__name__
    if walk.state == "tensor" and kind != "uint8":
        if library(op) == "torchvision" and type(op).__module__.startswith("torchvision.transforms.transforms"):
            raise TransformSpecError(
                f"{short_repr(op)} takes a PIL image, but here it gets a tensor (after an earlier conversion): use "
                f"torchvision.transforms.ConvertImageDtype(torch.float32) to scale it as ToTensor does")
        walk.flush()
        walk.out.stripped.append((op, "passes a tensor through (as it does in the pipeline)"))
        return
    walk.flush()
    walk.state = "tensor"
    if kind == "uint8":
        walk.out.stripped.append((op, DROPPED))
        walk.out.notes.append(f"{name}: {DROPPED}")
        return
    new = scaling_replacement() if kind == "scale" else float_replacement(op)
    walk.run(new, f"{name}: replaced by {new!r} to {new.dtype} (what it does to the sample, bit for bit: the input is a "
                  f"uint8 tensor)")
