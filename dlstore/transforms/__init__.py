"""Transforms in three parts.

* ``static``: the serialisable spec of deterministic ops paid once at conversion
  (``parse_static``, ``apply_static``), bit-identical to torchvision's kernels;
* ``batch``: ``Batch*`` transforms that draw independent parameters per sample,
  then run one pure kernel over the whole batch;
* ``functional``: the pure kernels shared by the read paths (the fused crop/flip gather);
* ``compiled``: the same crop/flip as one GIL-free numba call (the ``fast`` extra), used
  by the readers when numba imports;
* ``hybrid``: ``split_transforms`` cuts a torchvision pipeline into static and
  dynamic parts; ``strip_static_prefix`` plans a whole pipeline given at read time
  (the store's static ops are not run again); ``batch_plan`` maps the dynamic ops
  to batch transforms;
* ``planner``: the one plan every read path takes of a read-time transform (what the
  store already applied, per sample / per batch, host / device stage, GPU batch steps);
  ``opening`` (the pipeline inside a preset object), ``recognise`` (what each op is),
  ``placement`` (how it runs on a uint8 sample), ``prefix`` (the store's static ops in it)
  and ``wrappers`` (the callables the planner puts around ops) are its parts;
* ``ResizeMax``: the ``resize_max`` static op as a transform (with Resize, CenterCrop ... in a
  pipeline whose static part ``split_transforms`` takes).
"""

from .batch import (
    BatchCompose,
    BatchCutout,
    BatchNormalize,
    BatchRandomCrop,
    BatchRandomHorizontalFlip,
    BatchRandomResizedCrop,
    BatchTransform,
)
from .equivalents import batch_plan
from .hybrid import HybridTransform, split_transforms, strip_static_prefix
from .static import (
    ResizeMax,
    StaticSpec,
    apply_static,
    describe,
    output_shape,
    parse_static,
    to_torchvision,
)

__all__ = [
    "BatchCompose",
    "BatchCutout",
    "BatchNormalize",
    "BatchRandomCrop",
    "BatchRandomHorizontalFlip",
    "BatchRandomResizedCrop",
    "BatchTransform",
    "HybridTransform",
    "ResizeMax",
    "StaticSpec",
    "apply_static",
    "batch_plan",
    "describe",
    "output_shape",
    "parse_static",
    "split_transforms",
    "strip_static_prefix",
    "to_torchvision",
]
