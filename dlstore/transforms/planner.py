"""The transform planner every read path calls: what of a read-time transform runs, and where.

A read-time ``transform`` (a torchvision pipeline v1 or v2, a preset object holding one in
``.transforms``, ``weights.transforms()``, timm's ``create_transform``, a :class:`HybridTransform`,
dlstore batch transforms or any callable) meets a store that already holds the output of its
static ops. :func:`plan` decides once, in ONE list of ops (``Plan.ops``), for every path:

* what is already applied: the leading ops the store's static spec stands for
  (``prefix.match_static``), a hybrid's static part checked against the store's; a leading
  deterministic op that differs from the store's static stage is refused (StaticMismatchError)
  unless the caller passes ``static_mismatch="allow"``;
* how each op runs on a uint8 sample (``placement.place``): conversions dropped or replaced by
  their exact arithmetic, an op that needs a PIL image given one;
* per sample (``Plan.sample_transform``: ``ds[i]``), per sample then per batch (``Plan.split``:
  ``get_batch``, every loader back-end), host and device stage (``Plan.stages``), the batch
  steps of a loader whose samples already sit in one tensor (``Plan.steps``: the GPU loader).
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import TransformSpecError
from .batch import BatchCompose, BatchTransform
from .equivalents import batch_plan, batch_step, batch_steps
from .hybrid import HybridTransform, split_stages, strip_static_prefix
from .placement import place
from .prefix import check_mismatch_argument, hybrid_mismatch, leading_static, match_static
from .recognise import conversion, is_torchvision, library, short_repr, unwrap
from .static import StaticSpec, describe, parse_static
from .wrappers import Pipeline, PerSample, WholeBatch

__all__ = ["PerSample", "Plan", "WholeBatch", "accepts_generator", "draws_per_sample", "is_torchvision", "plan",
           "stages", "strip_static_prefix"]


@dataclass
class Plan:
    """The one plan of a read-time transform on a store (see the module doc).

    Attributes:
        given: the transform as given.
        ops: what runs, in order: the normalised dynamic part, each op a per-sample callable on a
            uint8 (C, H, W) tensor (torchvision ops, dlstore ops and the planner's wrappers).
        static: the store's recorded static spec (canonical), or None for a source that is not a
            store (nothing checked or skipped).
        stripped: (op, why) of each op of the transform that does not run.
        already_applied: the leading ops of the transform the store's static spec stands for.
        hybrid: the hybrid given, or (when ops were taken as applied) the plan as a hybrid whose
            static part is the store's; else None.
        mismatch: when ``static_mismatch="allow"`` let a static mismatch through, what it was.
        notes: how the transform was opened up and each op placed, and why.
    """

    given: Any
    ops: list[Any] = field(default_factory=list)
    static: StaticSpec | None = None
    stripped: list[tuple[Any, str]] = field(default_factory=list)
    already_applied: list[Any] = field(default_factory=list)
    hybrid: HybridTransform | None = None
    mismatch: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def sample_transform(self) -> Pipeline | None:
        """The whole read-time part as one callable on one uint8 (C, H, W) sample (what ``ds[i]`` runs),
        or None when nothing runs."""
        return Pipeline(self.ops) if self.ops else None

    @property
    def transform(self) -> Pipeline | None:
        """Same as ``sample_transform``."""
        return self.sample_transform

    def split(self, *, fixed_shape: bool) -> tuple[list[Any], list[Any]]:
        """(per-sample ops, batch steps): the ops to run on each sample before the batch is stacked,
        then the steps on the batch, each called ``step(images, generator)`` (``batch_plan``)."""
        return batch_plan(self.ops, fixed_shape=fixed_shape)

    def python_ops(self, *, fixed_shape: bool) -> list[Any]:
        """The ops that ``split`` runs sample by sample in Python: its per-sample ops, and those
        inside its per-sample batch steps. They hold the GIL between small kernels: a loader runs
        a pipeline with any in worker processes rather than threads."""
        head, tail = self.split(fixed_shape=fixed_shape)
        return head + [step.op for step in tail if isinstance(step, (PerSample, WholeBatch))]

    def stages(self) -> tuple[list[Any], list[Any]]:
        """(host ops, device ops): ``ops`` cut at the first float-producing op (``split_stages``)."""
        return split_stages(self.ops)

    def host_plan(self) -> Plan:
        """This plan without its device stage: what a dataset gives a loader with ``device=``."""
        host, _ = self.stages()
        return Plan(self.given, host, self.static, self.stripped, self.already_applied, None, self.mismatch,
                    self.notes)

    def device_steps(self) -> list[Any]:
        """The device stage as batch steps (``steps`` of its ops)."""
        return _steps(self.stages()[1])

    def steps(self) -> list[Any]:
        """``ops`` as batch steps, in order: each op's batch equivalent (a ``ToDtype`` + ``Normalize``
        run as one), timm's RandomErasing on the whole batch, other ops of known libraries and the
        planner's wrappers :class:`PerSample` (seeded from the loader's generator); dlstore batch
        transforms and other callables as given (called on the batch)."""
        return _steps(self.ops)

    def describe(self, *, fixed_shape: bool | None = None) -> str:
        """What runs where: the static stage recorded, the ops not run, per sample, per batch (given
        ``fixed_shape``: whether the store's samples share one shape), and the device stage."""
        lines = [f"transform plan of {_name(self.given)}:"]
        if self.static is not None:
            lines.append(f"  static, recorded in the store (not run): {describe(self.static)}")
        if self.mismatch:
            lines.append(f"  STATIC MISMATCH ALLOWED (static_mismatch='allow'): {self.mismatch}")
        reasons: dict[str, list[str]] = {}
        for t, why in self.stripped:
            reasons.setdefault(why, []).append(_short(t))
        lines += [f"  not run: {', '.join(names)}: {why}" for why, names in reasons.items()]
        if fixed_shape is None:
            lines.append(f"  runs: {_listing(self.ops)}")
        else:
            head, tail = self.split(fixed_shape=fixed_shape)
            lines.append(f"  per sample: {_listing(head)}")
            lines.append(f"  per batch: {_listing(tail)}")
        lines.append(f"  device stage, with loader(device=...): {_listing(self.stages()[1])}")
        lines += [f"  - {n}" for n in self.notes]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.describe()


def plan(transform: Any, stored: Any = None, *, where: Any = "the store", static_mismatch: str = "error") -> Plan:
    """The plan of ``transform`` read from a store converted with static spec ``stored``.

    Args:
        transform: the read-time transform (None: none).
        stored: the store's static spec (``manifest["static"]``, ``[]`` for none), or None
            for a source that is not a store (nothing is checked or skipped).
        where: the store, named in errors.
        static_mismatch: ``"error"`` (default) refuses a transform whose leading deterministic ops
            differ from the store's static stage; ``"allow"`` runs it on the stored samples as
            given, and the plan says so (``Plan.mismatch``, ``describe``).

    Raises:
        StaticMismatchError: a hybrid's static part is not the store's, or a pipeline's leading
            deterministic ops are not the store's static ops (another size, another crop, only
            some of them, or one under other settings).
        TransformSpecError: an op of the transform is not callable, or cannot get the input it needs
            (a PIL-only op after the conversion to float; a pipeline ending on a PIL image).
        ArgumentError: ``static_mismatch`` is not one of "error", "allow".
    """
    check_mismatch_argument(static_mismatch)
    spec = None if stored is None else parse_static(stored)
    if isinstance(transform, HybridTransform):
        error = hybrid_mismatch(where, spec, transform.static_spec) if spec is not None else None
        if error is not None and static_mismatch == "error":
            raise error
        return Plan(transform, list(transform.dynamic_ops), spec, hybrid=transform, notes=list(transform.notes),
                    mismatch=_mismatch_note(error, transform.static_spec, spec))
    ops, notes = unwrap(transform)
    for op in ops:
        if not callable(op):
            raise TransformSpecError(f"a transform must be callable (a torchvision transform or pipeline, a "
                                     f"HybridTransform, a dlstore batch transform or a function), got "
                                     f"{type(op).__name__} {op!r}")
    taken, error = match_static(ops, spec, where) if spec else (0, None)
    if error is not None and static_mismatch == "error":
        raise error
    reason = f"not run again (the store holds the output of its static transforms {describe(spec or [])})"
    placed = place(ops, taken=taken, taken_reason=reason)
    if spec and not taken:
        _warn_if_opaque(ops, spec, where)
    already = list(ops[:taken])
    hybrid = None
    if taken:
        stripped_notes = [f"{type(t).__name__}: {why}" for t, why in placed.stripped[:taken]]
        hybrid = HybridTransform(spec, placed.ops, notes=stripped_notes + placed.notes)
    return Plan(transform, placed.ops, spec, placed.stripped, already, hybrid,
                _mismatch_note(error, leading_static(ops)[0], spec), notes + placed.notes)


def _mismatch_note(error: Exception | None, theirs: StaticSpec, spec: StaticSpec | None) -> str | None:
    if error is None:
        return None
    first = f" ({describe(theirs)})" if theirs else ""
    return (f"the transform's deterministic ops{first} run on samples that already went through the store's "
            f"static transforms {describe(spec or [])}")


def _warn_if_opaque(ops: list[Any], spec: StaticSpec, where: Any) -> None:
    """A store with static ops read through an object dlstore cannot see into: say what to pass."""
    first = next((op for op in ops if conversion(op) != "uint8"), None)
    if first is None or library(first) or isinstance(first, (types.FunctionType, types.BuiltinFunctionType,
                                                             types.MethodType, functools.partial)):
        return
    name = type(first).__name__
    warnings.warn(
        f"{where}: the store's samples already went through its static transforms {describe(spec)!r}, and "
        f"dlstore cannot see inside {name}, so it runs as given on them (uint8 CHW tensors). If {name} holds a "
        f"torchvision pipeline, pass that pipeline (for example transform=obj.transforms): the store's static ops "
        f"are then not run again and PILToTensor / ToTensor are handled; if it resizes or crops, pass only the "
        f"ops after those", UserWarning, stacklevel=3)


def _steps(ops: list[Any]) -> list[Any]:
    def wrap(op: Any) -> Any:
        if isinstance(op, BatchTransform) or not library(op):
            return op
        step = batch_step(op)
        return step if step is not None else PerSample(op)

    out: list[Any] = []
    for op in ops:   # a BatchCompose given runs as its steps
        out += list(op.transforms) if isinstance(op, BatchCompose) else [op]
    return batch_steps(out, wrap=wrap)


def stages(transform: Any) -> tuple[list[Any], list[Any]]:
    """(host ops, device ops) of a read-time transform: a hybrid's own stages; a pipeline placed
    (``plan``) and cut at its first float-producing op (``split_stages``); any other callable
    is one op, kept whole on the host (returned as neither)."""
    if isinstance(transform, HybridTransform):
        return list(transform.host_ops), list(transform.device_ops)
    if transform is None or not library(transform) and not _opens_up(transform):
        return [], []
    return plan(transform).stages()


def _opens_up(transform: Any) -> bool:
    ops, _ = unwrap(transform)
    return len(ops) != 1 or ops[0] is not transform


def _name(t: Any) -> str:
    if t is None:
        return "no transform"
    ops, _ = unwrap(t)
    return f"{type(t).__name__} ({len(ops)} ops)" if len(ops) != 1 or ops[0] is not t else type(t).__name__


def _short(t: Any) -> str:
    return short_repr(t, 200) if library(t) else type(t).__name__


def _listing(ops: list[Any]) -> str:
    return "[" + ", ".join(_short(op) for op in ops) + "]" if ops else "none"


def draws_per_sample(step: Any) -> bool:
    """Whether ``step`` draws independent randomness per sample (dlstore batch transforms and
    per-sample loops do), so that running it on several batches at once changes nothing but
    the random stream."""
    if isinstance(step, BatchCompose):
        return all(draws_per_sample(t) for t in step.transforms)
    return isinstance(step, (BatchTransform, PerSample, WholeBatch))


def accepts_generator(transform: Callable[..., Any]) -> bool:
    """Whether ``transform`` declares a parameter named ``generator`` that can be passed by keyword
    (``**kwargs`` does not count: torch modules forward them to ``forward``, which refuses it)."""
    try:
        params = inspect.signature(transform).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    p = params.get("generator")
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)

