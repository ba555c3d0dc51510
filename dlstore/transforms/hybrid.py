"""Hybrid transforms: a torchvision pipeline split into its static, host and device stages
(the per-batch plan of the dynamic part: equivalents.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from PIL import Image

from ..errors import ArgumentTypeError, StaticMismatchError, TransformSpecError
from .static import (
    _FLOAT_NAMES,
    _TO_TENSOR_NAMES,
    ResizeMax,
    StaticSpec,
    _from_torchvision,
    apply_static,
    describe,
    is_random_transform,
    output_shape,
    parse_static,
)

# ---------------------------------------------------------------------------
# Hybrid transforms: a pipeline split into its static, host and device stages.
# ---------------------------------------------------------------------------


def is_torchvision(t: Any) -> bool:
    """Whether ``t`` is a torchvision transform (or Compose): the ops the planner reads by name."""
    return type(t).__module__.startswith("torchvision.")


def flatten(pipeline: Any) -> list[Any]:
    """The ops of a torchvision pipeline, nested Compose flattened; a list is taken as a Compose."""
    if pipeline is None:
        return []
    if isinstance(pipeline, (list, tuple)):
        return [op for t in pipeline for op in flatten(t)]
    if type(pipeline).__name__ == "Compose" and hasattr(pipeline, "transforms"):
        return [op for t in pipeline.transforms for op in flatten(t)]
    return [pipeline]


def _compose(ops: Sequence[Any]) -> Any:
    """A per-sample callable running ``ops`` in order (None when empty)."""
    if not ops:
        return None
    from torchvision.transforms import v2

    return v2.Compose(list(ops))


def _is_float_op(t: Any) -> bool:
    """Whether ``t`` starts the float tail of a pipeline: a float ``ToDtype`` / ``ConvertImageDtype``,
    a ``ToTensor`` or a ``Normalize`` (which only takes float input)."""
    name = type(t).__name__
    if name in ("ToTensor", "Normalize"):
        return True
    if name in ("ToDtype", "ConvertImageDtype"):
        dtype = getattr(t, "dtype", None)
        return getattr(dtype, "is_floating_point", False) is True
    return False


def _is_to_tensor(t: Any) -> bool:
    """A v1 ``ToTensor`` or a subclass (timm's ``MaybeToTensor``, which passes a tensor through
    *unscaled*: on a store's uint8 tensors it must become ``ToDtype(float32, scale=True)``)."""
    from torchvision.transforms import ToTensor

    return type(t).__name__ == "ToTensor" or isinstance(t, ToTensor)


def split_stages(ops: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Dynamic ``ops`` -> (host ops, device ops).

    The device stage starts at the first float-producing op (``ToDtype`` to a float
    type, ``ConvertImageDtype``, ``ToTensor``, ``Normalize``) and holds every op after
    it: they all see float data, 4x the bytes of uint8. The host stage is the uint8
    part before it.
    """
    ops = list(ops)
    cut = next((k for k, t in enumerate(ops) if _is_float_op(t)), len(ops))
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
            list of them, or None. With ``device=None`` they are split by
            ``split_stages`` (the float tail goes to the device stage); with
            ``device`` given they are the host stage.
        device: the device stage, placed explicitly (a transform, a list, or ``[]``
            for none); None splits ``dynamic``.

    Attributes:
        host_ops: the host stage as a flat list of transforms (uint8 in, uint8 out).
        device_ops: the device stage as a flat list.
        dynamic_ops: ``host_ops + device_ops`` (the whole read-time part).
        dynamic: the dynamic part as one per-sample callable (``v2.Compose``), or None.
        notes: how each op of the original pipeline was placed, and why.
    """

    def __init__(self, static: Any = None, dynamic: Any = None, device: Any = None, *,
                 notes: Sequence[str] = ()):
        self._static = parse_static(static)
        if device is None:
            self.host_ops, self.device_ops = split_stages(flatten(dynamic))
        else:
            self.host_ops, self.device_ops = flatten(dynamic), flatten(device)
        self.dynamic_ops = self.host_ops + self.device_ops
        self.dynamic = _compose(self.dynamic_ops)
        self.notes = list(notes)

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


def split_transforms(pipeline: Any) -> HybridTransform:
    """Split a torchvision pipeline into three stages: static, host, device.

    The static part is the leading run of ops with a static equivalent
    (Resize, CenterCrop, Grayscale, Pad); the first random or float-producing
    op, and every op after it, form the dynamic part. The dynamic part splits
    again (``split_stages``): the uint8 ops before the first float-producing op
    (``ToDtype``, ``Normalize``) are the host stage, that op and every op after it
    the device stage. PILToTensor / ToImage / ToPureTensor are dropped (a store
    already holds uint8 CHW tensors); a v1 ``ToTensor`` in the dynamic part becomes
    ``v2.ToDtype(torch.float32, scale=True)``.

    Args:
        pipeline: ``v2.Compose([...])`` (or v1), a single transform, or a list.

    Returns:
        A HybridTransform whose ``repr`` explains where each op went.
    """
    ops = flatten(pipeline)
    for t in ops:
        if not callable(t):
            raise ArgumentTypeError(f"split_transforms takes torchvision transforms (a Compose, a list or one "
                                    f"transform), got {type(t).__name__} {t!r}")
    static: list[Any] = []
    dynamic: list[Any] = []
    notes: list[str] = []
    on_device = False
    for t in ops:
        name = type(t).__name__
        if name in _TO_TENSOR_NAMES:
            notes.append(f"{name}: dropped (stores hold uint8 CHW tensors already)")
            continue
        if not dynamic:
            try:
                _from_torchvision(t)
            except TransformSpecError:
                reason = ("random: in the static part it would freeze one draw into the data"
                          if is_random_transform(t) else
                          "float output: the store keeps uint8, 4x smaller" if name in _FLOAT_NAMES else
                          "no static equivalent")
                notes.append(f"{name}: dynamic ({reason}); it and every op after it run at read time")
            else:
                static.append(t)
                notes.append(f"{name}: static (deterministic; runs once at conversion)")
                continue
        if _is_to_tensor(t):
            import torch
            from torchvision.transforms import v2

            notes.append(f"{name}: replaced by v2.ToDtype(torch.float32, scale=True) (input is a uint8 tensor)")
            t = v2.ToDtype(torch.float32, scale=True)
        if not on_device and _is_float_op(t):
            on_device = True
            notes.append(f"{type(t).__name__}: device stage from here on (float data, 4x the bytes of uint8: "
                         "loader(device=...) moves uint8 and runs it where the batch goes)")
        dynamic.append(t)
    spec = parse_static(static)
    if output_shape(spec) is None:
        notes.append("the static part fixes no size: the store will be variable-shape, holding every image "
                     "at its decoded size (a size-fixing op such as CenterCrop makes a smaller, faster store)")
    host, device = split_stages(dynamic)
    return HybridTransform(spec, host, device, notes=notes)


def strip_static_prefix(transform: Any, stored: Any, *, where: Any = "the store"
                        ) -> tuple[HybridTransform, list[Any]] | None:
    """The read-time plan of a torchvision pipeline given whole to a store converted with ``stored``.

    A store holds the output of its static ops, so a pipeline that begins with them
    (``v2.Compose([v2.Resize(256), v2.CenterCrop(224), ..., v2.PILToTensor()])`` on a store
    converted with ``"resize=256,center_crop=224"``) must not run them again: those leading
    ops (and PILToTensor / ToImage among them, no-ops on a stored tensor) are taken as
    already applied and the rest runs, so each sample equals ``ImageFolder(folder,
    transform=pipeline)``'s. The rest may start with further static ops (a store of
    ``"resize=256"`` read with ``Resize(256), CenterCrop(224)`` runs the crop); a v1
    ``ToTensor`` in it becomes ``v2.ToDtype(torch.float32, scale=True)``, as in
    ``split_transforms``. A pipeline whose first static op differs from the store's first
    (a validation ``Resize(256), CenterCrop(224)`` on a ``"resize_max=512"`` store), or that
    has no leading static op, runs as given.

    Args:
        transform: a torchvision transform or Compose (v1 or v2), or a list of them; any
            other callable runs as given. A HybridTransform is not planned here: the dataset
            checks its static part against the store's.
        stored: the store's static spec (``manifest["static"]``), in any form ``parse_static`` takes.
        where: the store, named in the error.

    Returns:
        None when ``transform`` runs as given; else ``(hybrid, skipped)``: a HybridTransform
        whose static part is ``stored`` and whose dynamic part is what runs (its ``notes``
        say what was skipped), and the ops of ``transform`` taken as already applied.

    Raises:
        StaticMismatchError: ``transform`` begins with some of the store's static ops but not
            all of them (run as given it would apply those a second time, and without them
            it would not give the pipeline's pixels either), or with one of them under other
            settings (``Resize(256, bicubic)`` on a ``"resize=256"`` store: same size, other
            interpolation or antialias).
    """
    stored = parse_static(stored)
    if not stored or isinstance(transform, HybridTransform):
        return None
    ops = flatten(transform)
    matched: StaticSpec = []
    taken = 0
    differing: Any = None       # the op where the pipeline leaves the store's spec, if any
    other_settings = False      # ... by doing what the store's op did, with other settings
    for k, t in enumerate(ops):
        if len(matched) == len(stored):
            break
        if type(t).__name__ in _TO_TENSOR_NAMES:
            continue
        if not (is_torchvision(t) or isinstance(t, ResizeMax)):
            differing = t     # _from_torchvision reads names: another library's "Resize" is not one
            break
        try:
            spec = _from_torchvision(t)
        except TransformSpecError:
            differing = t
            break
        expected = stored[len(matched):len(matched) + len(spec)]
        if spec != expected:
            differing = t
            other_settings = bool(spec) and _same_geometry(spec[0], expected[0])
            break
        matched += spec
        taken = k + 1
    if other_settings or 0 < len(matched) < len(stored):
        raise _partial_prefix(where, stored, matched, differing, other_settings)
    if not matched:
        return None
    while taken < len(ops) and type(ops[taken]).__name__ in _TO_TENSOR_NAMES:
        taken += 1                # a trailing PILToTensor of the static part is a no-op too
    skipped, rest = ops[:taken], []
    notes = [f"{type(t).__name__}: dropped (stores hold uint8 CHW tensors already)"
             if type(t).__name__ in _TO_TENSOR_NAMES else
             f"{type(t).__name__}: not run again (the store holds the output of its static transforms "
             f"{describe(stored)})" for t in skipped]
    for t in ops[taken:]:
        name = type(t).__name__
        if name in _TO_TENSOR_NAMES:
            notes.append(f"{name}: dropped (stores hold uint8 CHW tensors already)")
            continue
        if _is_to_tensor(t):
            import torch
            from torchvision.transforms import v2

            notes.append(f"{name}: replaced by v2.ToDtype(torch.float32, scale=True) (input is a uint8 tensor)")
            t = v2.ToDtype(torch.float32, scale=True)
        rest.append(t)
    return HybridTransform(stored, rest, notes=notes), skipped


# The fields of a static op that say where pixels go; an op equal in these does what the
# other did (interpolation and antialias only change how the new pixels are computed).
_GEOMETRY = {"resize": ("size", "max_size"), "resize_max": ("size",), "pad": ("padding",)}


def _same_geometry(op: dict[str, Any], other: dict[str, Any]) -> bool:
    keys = _GEOMETRY.get(op["op"])
    return keys is not None and op["op"] == other["op"] and all(op[k] == other[k] for k in keys)


def _partial_prefix(where: Any, stored: StaticSpec, matched: StaticSpec, differing: Any,
                    other_settings: bool) -> StaticMismatchError:
    """The error of a pipeline that begins with only part of the store's static ops, or with one of
    them under other settings: run as given it repeats them, skipped it does not give its pixels."""
    fix = (f"Pass only the dynamic part of the pipeline (the ops after its static ones), or convert again "
           f"with static=dlstore.split_transforms(pipeline) and open with that hybrid; to run the transform as "
           f"given on the stored samples, pass dlstore.HybridTransform({describe(stored)!r}, transform).")
    head = f"{where}: the store was converted with static transforms {describe(stored)!r}; "
    if other_settings:
        theirs = stored[len(matched)]
        return StaticMismatchError(
            f"{head}the transform's {differing!r} does what the store's {describe([theirs])!r} already did, with "
            f"other settings (store: {theirs}, transform: {parse_static(differing)[0]}). Run as given it would "
            f"do it a second time to the stored samples. {fix}")
    missing = describe(stored[len(matched):])
    instead = f"then has {differing!r} where" if differing is not None else "then ends where"
    return StaticMismatchError(
        f"{head}the transform begins with only {describe(matched)!r} of them, {instead} the store has "
        f"{missing!r}. Run as given it would apply {describe(matched)!r} a second time to the stored samples; "
        f"skipping that would not give the pipeline's pixels either (the stored samples also went through "
        f"{missing!r}). {fix}")
