"""A torchvision v2 pipeline written for ``(tv_tensors.Image, tv_tensors.Mask)``, as a segmentation
store runs it per batch: ``plan_joint(transform)``.

::

    head   the ops that move pixels, on the image and its mask with the same draws, in order:
           RandomCrop (a fill per type: ``fill={tv_tensors.Image: 0, tv_tensors.Mask: 255}``),
           RandomHorizontalFlip, RandomResizedCrop (the image bilinear, the mask nearest: v2's
           Mask kernel); leading ToImage / PILToTensor are no-ops on a stored sample
    tail   the ops after them, which v2 runs on the image and passes the Mask through (colour
           ops, ToDtype, Normalize, blur, erasing), planned as for a classification store
           (``planner.plan``) and run on the images

Refused, with the reason: a v1 transform or a plain function (they take one image, so the mask
would be transformed as an image or not at all), a geometric op dlstore does not run jointly, a
geometric op after a tail op (run it first), and a ``RandomResizedCrop`` not bilinear.
``ds[i]`` runs the pipeline as given on the pair, which is the reference the batches equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import TransformSpecError
from .batch import BatchRandomCrop, BatchRandomHorizontalFlip, BatchRandomResizedCrop
from .equivalents import random_crop_op
from .hybrid import HybridTransform
from .opening import library, name_of, short_repr, version
from .planner import Plan, plan
from .prefix import check_mismatch_argument, hybrid_mismatch, match_static
from .recognise import unwrap
from .static import describe as describe_static
from .static import parse_static

JOINT = ("RandomCrop", "RandomHorizontalFlip", "RandomResizedCrop")
NO_OPS = ("ToImage", "PILToTensor", "ToPureTensor")
PROBES = 8   # draws of a tail op checked to leave a Mask as it is


@dataclass
class JointCrop:
    """A RandomCrop on both fields: ``crop`` pads the image with its fill, ``mask_fill`` the mask."""

    crop: BatchRandomCrop
    mask_fill: int


@dataclass
class JointPlan:
    """The pipeline as dlstore runs it on a segmentation store's batches (see the module doc).

    Attributes:
        given: the transform as given.
        ops: its ops that run on the stored pairs (those after the store's static ones), in order:
            ``ds[i]`` runs them on the pair as v2 does (``sample_transform``).
        head: the joint ops, in order: ``JointCrop``, ``BatchRandomHorizontalFlip``,
            ``BatchRandomResizedCrop`` (the mask resampled nearest).
        tail: the image-only ops after them, planned as on a classification store.
    """

    given: Any
    ops: list[Any] = field(default_factory=list)
    head: list[Any] = field(default_factory=list)
    tail: Plan = field(default_factory=lambda: Plan(None))

    @property
    def sample_transform(self) -> Any:
        """The ops on one (Image, Mask) pair, as v2 runs them (None when nothing runs)."""
        return _compose(self.ops) if self.ops else None

    def host_plan(self) -> JointPlan:
        """This plan without its device stage (the float tail, which ``loader(device=)`` runs there)."""
        return JointPlan(self.given, self.ops, self.head, self.tail.host_plan())

    def device_steps(self) -> list[Any]:
        return self.tail.device_steps()

    def describe(self, *, fixed_shape: bool | None = None) -> str:
        """What runs where (``fixed_shape``: taken for ``Plan.describe``'s sake; the store's batches are fixed)."""
        head, batch = self.tail.split(fixed_shape=True)
        given = short_repr(self.given)
        if isinstance(self.given, HybridTransform):
            given = (f"HybridTransform(static {describe_static(self.given.static_spec)}; "
                     f"{', '.join(type(op).__name__ for op in self.ops)})")
        elif name_of(self.given) == "Compose":
            given = f"Compose({', '.join(type(op).__name__ for op in unwrap(self.given)[0])})"
        lines = [f"joint plan of {given}:",
                 f"  image and mask, per batch: {', '.join(map(repr, self.head)) or 'nothing'}",
                 f"  image only, per sample: {', '.join(map(short_repr, head)) or 'nothing'}",
                 f"  image only, per batch: {', '.join(map(repr, batch)) or 'nothing'}",
                 "  device stage, with loader(device=...): "
                 + (", ".join(map(short_repr, self.tail.stages()[1])) or "nothing")]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.describe()


def plan_joint(transform: Any, stored: Any = None, *, where: Any = "the store",
               static_mismatch: str = "error") -> JointPlan:
    """The joint plan of ``transform`` on the store at ``where``, converted with static spec ``stored``.

    ``transform``: a v2 ``Compose`` or one v2 op, or None; a whole pipeline whose leading ops are
    the store's static ones (they are not run again), or the HybridTransform ``split_transforms``
    made of one (its static part must be the store's), as on a classification store
    (``planner.plan``; ``static_mismatch`` as there).

    Raises:
        TransformSpecError: an op dlstore cannot run on the image and its mask as v2 does, and why.
        StaticMismatchError: the leading static ops, or the hybrid's static part, are not the store's.
    """
    if transform is None:
        return JointPlan(None)
    check_mismatch_argument(static_mismatch)
    spec = None if stored is None else parse_static(stored)
    if isinstance(transform, HybridTransform):
        error = hybrid_mismatch(where, spec, transform.static_spec) if spec is not None else None
        ops = list(transform.dynamic_ops)
    else:
        ops = unwrap(transform)[0]
        taken, error = match_static(ops, spec, where) if spec else (0, None)
        ops = ops[taken:]
    if error is not None and static_mismatch == "error":
        raise error
    head: list[Any] = []
    if not ops:
        return JointPlan(transform)
    k = 0
    while k < len(ops) and name_of(ops[k]) in NO_OPS:
        k += 1
    for op in ops[k:]:
        _check_v2(op, where)
    while k < len(ops) and name_of(ops[k]) in JOINT:
        head.append(_joint_op(ops[k], where))
        k += 1
    tail = ops[k:]
    for op in _moving_mask(tail):
        raise TransformSpecError(
            f"{where}: {short_repr(op)} moves the mask (or cannot take it): dlstore runs on the image and its mask "
            f"together only {', '.join(JOINT)}, first in the pipeline (before the colour and dtype ops, which v2 "
            f"runs on the image only); move it there, or leave it out")
    tail_plan = plan(_compose(tail), None, where=where) if tail else Plan(None)
    return JointPlan(transform, ops, head, tail_plan)


def _check_v2(op: Any, where: Any) -> None:
    if version(op) == "v2":
        return
    what = (f"the torchvision v1 op {short_repr(op)}" if version(op) == "v1"
            else f"{short_repr(op)} (not a torchvision v2 op)" if library(op) != "dlstore"
            else f"the dlstore op {short_repr(op)}")
    raise TransformSpecError(
        f"{where} holds images with masks, and {what} takes one image: the mask would be transformed as an "
        "image, or not at all. Write the pipeline with torchvision.transforms.v2, which transforms "
        "(tv_tensors.Image, tv_tensors.Mask) together (docs/segmentation.md)")


def _joint_op(op: Any, where: Any) -> Any:
    from torchvision import tv_tensors

    name = name_of(op)
    if name == "RandomHorizontalFlip":
        return BatchRandomHorizontalFlip(op.p)
    if name == "RandomCrop":
        image_fill, mask_fill = _fill_for(op, tv_tensors.Image), _fill_for(op, tv_tensors.Mask)
        if mask_fill is None:
            mask_fill = 0
        if not isinstance(mask_fill, (int, float)) or isinstance(mask_fill, bool) or mask_fill != int(mask_fill) \
                or not 0 <= mask_fill <= 65535:
            raise TransformSpecError(f"{where}: {short_repr(op)} pads the mask with {mask_fill!r}; a mask's fill "
                                     "is one class index (255 for 'ignore' is usual)")
        return JointCrop(random_crop_op(op, 0 if image_fill is None else image_fill), int(mask_fill))
    interpolation = getattr(op.interpolation, "value", op.interpolation)
    if interpolation != "bilinear":
        raise TransformSpecError(f"{where}: {short_repr(op)} resamples the image with {interpolation}; dlstore runs "
                                 "RandomResizedCrop bilinear (the mask always nearest, as v2 does)")
    antialias = True if op.antialias is None else bool(op.antialias)
    return BatchRandomResizedCrop(list(op.size), op.scale, op.ratio, antialias=antialias, kernel="v2")


def _fill_for(op: Any, kind: type) -> Any:
    """The fill v2's RandomCrop pads a ``kind`` with (``_get_fill``: the type's, else "others", else None)."""
    fills = op.fill
    if not isinstance(fills, dict):
        return fills
    return fills.get(kind, fills.get("others"))


def _moving_mask(ops: list[Any]) -> list[Any]:
    """The first op of the chain ``ops`` that does not leave a ``tv_tensors.Mask`` as it is, or cannot
    take the pair (each op fed the one before's image, over ``PROBES`` draws), as a list ([]: none)."""
    import torch
    from torchvision import tv_tensors

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        mask = tv_tensors.Mask(torch.randint(0, 5, (12, 16), dtype=torch.uint8))
        for _ in range(PROBES):
            image: Any = tv_tensors.Image(torch.randint(0, 256, (3, 12, 16), dtype=torch.uint8))
            for op in ops:
                if name_of(op) in JOINT:
                    return [op]
                try:
                    out = op(image, mask)
                except Exception:  # noqa: BLE001 - an op that cannot take the pair does not pass it
                    return [op]
                if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], tv_tensors.Mask)
                        and out[1].shape == mask.shape and torch.equal(out[1], mask)):
                    return [op]
                image = out[0]
    return []


def _compose(ops: list[Any]) -> Any:
    from torchvision.transforms import v2

    return ops[0] if len(ops) == 1 else v2.Compose(ops)
