"""Hybrid transforms: a torchvision pipeline split into its static, host and device stages
(how each op runs on a store's samples: placement.py; the per-batch plan: equivalents.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from PIL import Image

from ..errors import ArgumentTypeError, TransformSpecError
from .placement import DROPPED, initial_state, place
from .prefix import leading_static, match_static
from .recognise import conversion, is_float_op, is_torchvision, unwrap
from .static import (
    _FLOAT_NAMES,
    StaticSpec,
    apply_static,
    describe,
    is_random_transform,
    output_shape,
    parse_static,
)
from .wrappers import Pipeline

__all__ = ["HybridTransform", "flatten", "is_torchvision", "split_stages", "split_transforms", "strip_static_prefix"]


def flatten(pipeline: Any) -> list[Any]:
    """The ops of a pipeline: Compose, nn.Sequential and lists flattened, a preset object's
    ``.transforms`` and torchvision's ``ImageClassification`` opened up (``recognise.unwrap``)."""
    return unwrap(pipeline)[0]


def _compose(ops: Sequence[Any]) -> Any:
    """A per-sample callable running ``ops`` in order (None when empty)."""
    return Pipeline(ops) if ops else None


def split_stages(ops: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Dynamic ``ops`` -> (host ops, device ops).

    The device stage starts at the first float-producing op (``ToDtype`` to a float
    type, ``ConvertImageDtype``, ``ToTensor``, ``Normalize``) and holds every op after
    it: they all see float data, 4x the bytes of uint8. The host stage is the uint8
    part before it.
    """
    ops = list(ops)
    cut = next((k for k, t in enumerate(ops) if is_float_op(t)), len(ops))
    return ops[:cut], ops[cut:]


class HybridTransform:
    """A transform pipeline in three stages: static (at conversion), host and device (per read).

    * static: deterministic ops run once by ``convert`` (decode, resize, center crop);
    * host: the random uint8 ops (crops, flips), run per batch by the loader's threads
      or worker processes;
    * device: the float tail (``ToDtype``, ``Normalize`` and every op after them), run
      per batch where the batch goes: on the accelerator with ``dlstore.loader(ds, ...,
      device="cuda")``, in the threads/workers with the rest otherwise.

    ``convert(src, dst, static=hybrid)`` stores the output of the static part;
    ``open_dataset(dst, transform=hybrid)`` checks that the store was made with
    that static part and applies only the dynamic part (host + device, per batch
    where every op has a batch equivalent, see :func:`~dlstore.transforms.equivalents.batch_plan`). Calling the hybrid
    on a PIL image runs every stage: the reference result of the whole pipeline.

    Args:
        static: a static spec in any form ``parse_static`` accepts (string, list
            of dicts, torchvision transforms); deterministic ops only.
        dynamic: the read-time transforms: a torchvision transform or Compose, a
            list of them, or None, placed on the store's uint8 samples as
            ``placement.place`` says (conversions dropped or replaced, an op that needs a
            PIL image given one). With ``device=None`` they are split by
            ``split_stages`` (the float tail goes to the device stage); with
            ``device`` given they are the host stage.
        device: the device stage, placed explicitly (a transform, a list, or ``[]``
            for none); None splits ``dynamic``.

    Attributes:
        host_ops: the host stage as a flat list of transforms (uint8 in, uint8 out).
        device_ops: the device stage as a flat list.
        dynamic_ops: ``host_ops + device_ops`` (the whole read-time part).
        dynamic: the dynamic part as one per-sample callable (``wrappers.Pipeline``), or None.
        notes: how each op of the original pipeline was placed, and why.
    """

    def __init__(self, static: Any = None, dynamic: Any = None, device: Any = None, *,
                 notes: Sequence[str] = ()):
        self._static = parse_static(static)
        host, dev = unwrap(dynamic)[0], (unwrap(device)[0] if device is not None else [])
        state = initial_state(host + dev)
        placed = place(host, state=state)
        self.notes = list(notes) + [n for n in placed.notes if n not in notes]
        if device is None:
            self.host_ops, self.device_ops = split_stages(placed.ops)
        else:
            after = "tensor" if any(conversion(t) for t in host) else state
            placed_dev = place(dev, state=after)
            self.host_ops, self.device_ops = placed.ops, placed_dev.ops
            self.notes += [n for n in placed_dev.notes if n not in notes]
        self.dynamic_ops = self.host_ops + self.device_ops
        self.dynamic = _compose(self.dynamic_ops)

    @property
    def static_spec(self) -> StaticSpec:
        """The canonical static spec (a copy): what ``convert`` records in the manifest."""
        return [dict(op) for op in self._static]

    def host_only(self) -> HybridTransform:
        """This hybrid without its device stage: what a loader with ``device=`` gives the dataset."""
        return HybridTransform(self._static, self.host_ops, [], notes=self.notes)

    def __call__(self, img: Image.Image) -> Any:
        """The whole pipeline on one RGB PIL image: static part, then dynamic part."""
        import torch

        out: Any = torch.from_numpy(apply_static(img, self._static))
        return self.dynamic(out) if self.dynamic is not None else out

    def __repr__(self) -> str:
        def stage(title: str, ops: list[Any]) -> str:
            inner = "".join(f"\n    {op!r}," for op in ops)
            return f"  {title}: [{inner}\n  ]" if ops else f"  {title}: none"

        lines = [
            "HybridTransform(",
            f"  static (once, at conversion): {describe(self._static)}",
            stage("host (every read, uint8 CHW, in the loader's threads/workers)", self.host_ops),
            stage("device (every read, float, where the batch goes: loader(device=...))", self.device_ops),
        ]
        if self.notes:
            lines.append("  split:")
            lines += [f"    - {n}" for n in self.notes]
        return "\n".join(lines) + "\n)"


def split_transforms(pipeline: Any, *, resize_max: int | None = None) -> HybridTransform:
    """Split a torchvision pipeline into three stages: static, host, device.

    The static part is the leading run of ops with a static equivalent
    (Resize, CenterCrop, Grayscale, Pad, ResizeMax); the first random or float-producing
    op, and every op after it, form the dynamic part, placed on the store's uint8 samples
    as ``placement.place`` says (PILToTensor / ToImage / ToPureTensor dropped, a ``ToTensor``
    replaced by v1 ``ConvertImageDtype``, its exact arithmetic; an op that needs a PIL image
    given one). The dynamic part splits again (``split_stages``): the uint8 ops before the
    first float-producing op (``ToDtype``, ``Normalize``) are the host stage, that op and
    every op after it the device stage.

    Args:
        pipeline: ``v2.Compose([...])`` (or v1), a single transform, a list, a preset object
            holding its pipeline in ``.transforms``, or torchvision's ``ImageClassification``.
        resize_max: a training pipeline whose static part fixes no size (it starts with a
            random crop) gets the static part ``resize_max=N``: the store holds every image
            downscaled to a longer side of at most N (the recipe for large photos), and the
            hybrid opens such a store.

    Returns:
        A HybridTransform whose ``repr`` explains where each op went.
    """
    ops, notes = unwrap(pipeline)
    for t in ops:
        if not callable(t):
            raise ArgumentTypeError(f"split_transforms takes torchvision transforms (a Compose, a list or one "
                                    f"transform), got {type(t).__name__} {t!r}")
    spec, end = leading_static(ops)
    for t in ops[:end]:
        notes.append(f"{type(t).__name__}: {DROPPED}" if conversion(t) == "uint8"
                     else f"{type(t).__name__}: static (deterministic; runs once at conversion)")
    first = next((t for t in ops[end:] if conversion(t) != "uint8"), None)
    if first is not None:
        notes.append(f"{type(first).__name__}: dynamic ({_why_dynamic(first)}); it and every op after it run "
                     f"at read time")
    placed = place(ops, taken=end, taken_reason="static")
    notes += placed.notes
    host, device = split_stages(placed.ops)
    if device:
        notes.append(f"{type(device[0]).__name__}: device stage from here on (float data, 4x the bytes of uint8: "
                     "loader(device=...) moves uint8 and runs it where the batch goes)")
    if resize_max is not None:
        if spec:
            raise TransformSpecError(
                f"split_transforms(resize_max={resize_max}): the pipeline's static part is {describe(spec)!r}; "
                f"downscaling first would change what those ops give. resize_max is for a pipeline that starts "
                f"with a random crop (its static part is none)")
        spec = parse_static([{"op": "resize_max", "size": resize_max}])
        notes.append(f"resize_max={resize_max}: static, asked for (every image stored downscaled to a longer side "
                     f"of at most {resize_max}; the random crop reads that)")
    elif output_shape(spec) is None:
        notes.append("the static part fixes no size: the store will be variable-shape, holding every image "
                     "at its decoded size (a size-fixing op such as CenterCrop makes a smaller, faster store; "
                     "split_transforms(pipeline, resize_max=N) caps it)")
    return HybridTransform(spec, host, device, notes=notes)


def _why_dynamic(t: Any) -> str:
    if is_random_transform(t):
        return "random: in the static part it would freeze one draw into the data"
    if type(t).__name__ in _FLOAT_NAMES:
        return "float output: the store keeps uint8, 4x smaller"
    return "no static equivalent"


def strip_static_prefix(transform: Any, stored: Any, *, where: Any = "the store"
                        ) -> tuple[HybridTransform, list[Any]] | None:
    """The read-time plan of a pipeline given whole to a store converted with ``stored``.

    A store holds the output of its static ops, so a pipeline that begins with them
    (``v2.Compose([v2.Resize(256), v2.CenterCrop(224), ..., v2.PILToTensor()])`` on a store
    converted with ``"resize=256,center_crop=224"``) must not run them again: those leading
    ops (and PILToTensor / ToImage among them, no-ops on a stored tensor) are taken as
    already applied and the rest runs, placed as ``placement.place`` says, so each sample
    equals ``ImageFolder(folder, transform=pipeline)``'s. The rest may start with further
    static ops (a store of ``"resize=256"`` read with ``Resize(256), CenterCrop(224)`` runs
    the crop, on PIL as ImageFolder did). A pipeline with no leading static op runs as given.

    Args:
        transform: a pipeline in any form ``flatten`` takes; a HybridTransform is not planned
            here (the planner checks its static part against the store's).
        stored: the store's static spec (``manifest["static"]``), in any form ``parse_static`` takes.
        where: the store, named in the error.

    Returns:
        None when nothing is taken as applied; else ``(hybrid, skipped)``: a HybridTransform
        whose static part is ``stored`` and whose dynamic part is what runs (its ``notes``
        say what was skipped), and the ops of ``transform`` taken as already applied.

    Raises:
        StaticMismatchError: ``transform``'s leading deterministic ops differ from the store's
            static ops (``prefix.match_static``: another size, another crop, part of them, or
            one under other settings); ``planner.plan(..., static_mismatch="allow")`` runs it anyway.
    """
    stored = parse_static(stored)
    if not stored or isinstance(transform, HybridTransform):
        return None
    ops = flatten(transform)
    taken, error = match_static(ops, stored, where)
    if error is not None:
        raise error
    if not taken:
        return None
    placed = place(ops, taken=taken, taken_reason=f"not run again (the store holds the output of its static "
                                                   f"transforms {describe(stored)})")
    notes = [f"{type(t).__name__}: {why}" for t, why in placed.stripped[:taken]] + placed.notes
    return HybridTransform(stored, placed.ops, notes=notes), list(ops[:taken])
