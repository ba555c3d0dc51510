"""The transform planner every read path calls: what of a read-time transform runs, and where.

A read-time ``transform`` (a torchvision pipeline, a :class:`HybridTransform`, dlstore
batch transforms or any callable) meets a store that already holds the output of its
static ops. :func:`plan` decides once, for every path:

* what is already applied: the leading ops of a whole pipeline that the store's static
  spec stands for (``strip_static_prefix``), and a hybrid's static part checked
  against the store's;
* what runs per sample and what per batch (``Plan.split``: ``StoreDataset.get_batch``);
* the host stage and the device stage (``Plan.stages``: ``dlstore.loader(device=...)``);
* the batch steps of a loader whose samples already sit in one tensor (``Plan.steps``:
  the GPU loader): each op as its batch equivalent where it has one, else
  :class:`PerSample`, at its place in the sequence.

Only torchvision ops are read by name (:func:`is_torchvision`); any other callable runs
as given, whole.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import StaticMismatchError, TransformSpecError
from .batch import BatchCompose, BatchTransform
from .equivalents import batch_plan, batch_steps
from .hybrid import (
    HybridTransform,
    flatten,
    is_torchvision,
    split_stages,
    strip_static_prefix,
)
from .static import describe, parse_static


@dataclass
class Plan:
    """What runs of a read-time transform on a store (see the module doc).

    Attributes:
        transform: what runs per sample: the transform as given, or the dynamic part
            (one ``v2.Compose``, or None) of a hybrid or of a pipeline whose static ops
            the store already applied.
        hybrid: that hybrid (the one given, or the plan of such a pipeline), else None.
        already_applied: the leading ops of a whole pipeline the store's static spec
            stands for, so they do not run (empty when none).
    """

    transform: Any
    hybrid: HybridTransform | None = None
    already_applied: list[Any] = field(default_factory=list)

    @property
    def ops(self) -> list[Any]:
        """The dynamic part as a flat list: a hybrid's ops, a torchvision pipeline's, else the callable."""
        if self.hybrid is not None:
            return list(self.hybrid.dynamic_ops)
        if self.transform is not None and is_torchvision(self.transform):
            return flatten(self.transform)
        return [] if self.transform is None else [self.transform]

    def split(self, *, fixed_shape: bool) -> tuple[list[Any], list[BatchTransform]]:
        """(per-sample ops, batch transforms) of the dynamic part (``batch_plan``)."""
        return batch_plan(self.ops, fixed_shape=fixed_shape)

    def stages(self) -> tuple[list[Any], list[Any]]:
        """(host ops, device ops); see :func:`stages`."""
        return stages(self.hybrid if self.hybrid is not None else self.transform)

    def steps(self) -> list[Any]:
        """The dynamic part as batch steps, in order: torchvision ops replaced by their batch
        equivalents (a ``ToDtype`` + ``Normalize`` run as one), those without one by
        :class:`PerSample`; dlstore batch transforms and other callables as given."""
        steps: list[Any] = []
        run: list[Any] = []    # consecutive torchvision ops: mapped together (ToDtype + Normalize merge)
        for a in _atoms(self.hybrid if self.hybrid is not None else self.transform) + [None]:
            if a is not None and is_torchvision(a):
                run.append(a)
                continue
            steps += [PerSample(s) if is_torchvision(s) else s for s in batch_steps(run)]
            run = []
            if a is not None:
                steps.append(a)
        return steps


def plan(transform: Any, stored: Any = None, *, where: Any = "the store") -> Plan:
    """The plan of ``transform`` read from a store converted with static spec ``stored``.

    Args:
        transform: the read-time transform (None: none).
        stored: the store's static spec (``manifest["static"]``, ``[]`` for none), or None
            for a source that is not a store (nothing is checked or skipped).
        where: the store, named in errors.

    Raises:
        StaticMismatchError: a hybrid's static part is not the store's, or a pipeline begins
            with some of the store's static ops but not all, or with one under other settings.
    """
    if stored is None:
        return Plan(transform)
    skipped: list[Any] = []
    planned = strip_static_prefix(transform, stored, where=where)
    if planned is not None:
        transform, skipped = planned
    if isinstance(transform, HybridTransform):
        check_static(where, stored, transform)
        return Plan(transform.dynamic, transform, skipped)
    return Plan(transform, None, skipped)


def check_static(where: Any, stored: Any, hybrid: HybridTransform) -> None:
    """Raise StaticMismatchError unless ``hybrid``'s static part is the store's (``stored``)."""
    stored = parse_static(stored or [])
    wanted = hybrid.static_spec
    if stored == wanted:
        return
    detail = ""
    if describe(stored) == describe(wanted):  # differ in a field describe() leaves out
        detail = f"\n  store:     {stored}\n  transform: {wanted}"
    raise StaticMismatchError(
        f"{where}: the store was converted with static transforms {describe(stored)!r}, but the hybrid "
        f"transform's static part is {describe(wanted)!r}{detail}. Training on it would not see the data "
        f"the pipeline describes. Convert again with dlstore.convert(src, {str(where)!r}, static=hybrid, "
        f"overwrite=True), or open it with a hybrid whose static part is {describe(stored)!r}.")


def stages(transform: Any) -> tuple[list[Any], list[Any]]:
    """(host ops, device ops) of a read-time transform: a hybrid's own stages; a torchvision
    pipeline cut at its first float-producing op (``split_stages``); any other callable is
    one op, kept whole on the host (returned as neither)."""
    if isinstance(transform, HybridTransform):
        return list(transform.host_ops), list(transform.device_ops)
    if transform is not None and is_torchvision(transform):
        return split_stages(flatten(transform))
    return [], []


def _atoms(transform: Any) -> list[Any]:
    """``transform`` as a flat list of ops: torchvision ops, batch transforms, other callables."""
    if transform is None:
        return []
    if isinstance(transform, HybridTransform):
        return list(transform.dynamic_ops)
    if isinstance(transform, BatchCompose):
        return [a for t in transform.transforms for a in _atoms(t)]
    if isinstance(transform, (list, tuple)):
        return [a for t in transform for a in _atoms(t)]
    if is_torchvision(transform):
        return flatten(transform)
    if isinstance(transform, torch.nn.Sequential):
        return [a for t in transform for a in _atoms(t)]
    if not callable(transform):
        raise TransformSpecError(f"the GPU loader's transform must be callable (a torchvision transform or "
                                 f"pipeline, a HybridTransform, a dlstore batch transform or a function), got "
                                 f"{type(transform).__name__} {transform!r}")
    return [transform]


class PerSample:
    """A torchvision op without a batch equivalent, run on each sample of a batch in turn.

    It draws from torch's global generators, as torchvision does; ``sample`` draws
    one seed for them from the loader's generator, and ``apply`` runs the op on
    every sample with the global generators so seeded (restoring them after):
    draws reproducible from the loader's seed, independent per sample.
    """

    def __init__(self, op: Any):
        self.op = op

    def sample(self, shape: Any, *, generator: torch.Generator | None = None,
               device: Any = "cpu") -> dict[str, torch.Tensor]:
        return {"seed": torch.randint(0, 2**62, (), generator=generator, device=device)}

    def apply(self, images: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        seed = int(params["seed"])
        device = images.device
        cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.default_generator.manual_seed(seed)
            if cuda:
                torch.cuda.default_generators[cuda[0]].manual_seed(seed)
            out = [self.op(x) for x in images]
        shapes = sorted({tuple(x.shape) for x in out})
        if len(shapes) > 1:
            raise TransformSpecError(f"{self.op!r} gave samples of different shapes {shapes[:4]}; the GPU loader "
                                     f"stacks every batch into one tensor")
        return torch.stack(out)

    def __call__(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.apply(images, self.sample(images.shape, generator=generator, device=images.device))

    def __repr__(self) -> str:
        return f"PerSample({self.op!r})"


def draws_per_sample(step: Any) -> bool:
    """Whether ``step`` draws independent randomness per sample (dlstore batch transforms and
    per-sample loops do), so that running it on several batches at once changes nothing but
    the random stream."""
    if isinstance(step, BatchCompose):
        return all(draws_per_sample(t) for t in step.transforms)
    return isinstance(step, (BatchTransform, PerSample))


def accepts_generator(transform: Callable[..., Any]) -> bool:
    """Whether ``transform`` declares a parameter named ``generator`` that can be passed by keyword
    (``**kwargs`` does not count: torch modules forward them to ``forward``, which refuses it)."""
    try:
        params = inspect.signature(transform).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    p = params.get("generator")
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
