"""The one transform planner: what of a read-time transform the store already applied, and where the rest runs.

Reference: the pipeline as written (which of its ops are the store's static ones, which run per
sample, per batch, on the host or the device), and torchvision's own module layout for the
predicate that says which ops are read by name.
"""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms as v1
from torchvision.transforms import v2

from dlstore.errors import StaticMismatchError, TransformSpecError
from dlstore.transforms import (
    BatchNormalize,
    BatchRandomCrop,
    BatchRandomHorizontalFlip,
    HybridTransform,
    parse_static,
)
from dlstore.transforms.planner import PerSample, is_torchvision, plan, stages

STORED = parse_static("resize=40,center_crop=32")
MEAN, STD = [0.5, 0.4, 0.3], [0.2, 0.3, 0.4]


def _ids(ops):
    return [id(t) for t in ops]


def test_a_whole_pipeline_runs_without_the_stores_static_ops():
    ops = [v2.Resize(40), v2.CenterCrop(32), v2.PILToTensor(), v2.RandomHorizontalFlip(),
           v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
    planned = plan(v2.Compose(ops), STORED, where="s.shards")
    assert _ids(planned.already_applied) == _ids(ops[:3])
    assert _ids(planned.ops) == _ids(ops[3:])
    host, device = planned.stages()
    assert _ids(host) == _ids(ops[3:4]) and _ids(device) == _ids(ops[4:])
    per_sample, batch = planned.split(fixed_shape=True)
    assert per_sample == [] and [type(b) for b in batch] == [BatchRandomHorizontalFlip, BatchNormalize]
    assert batch[1].mean == MEAN and batch[1].std == STD and batch[1].scale


def test_a_pipeline_not_made_of_the_stores_ops_runs_as_given():
    pipeline = v2.Compose([v2.RandomCrop(16), v2.RandomHorizontalFlip()])
    planned = plan(pipeline, STORED)
    assert planned.hybrid is None and planned.already_applied == [] and planned.stripped == []
    assert _ids(planned.ops) == _ids(pipeline.transforms) and _ids(planned.transform.ops) == _ids(pipeline.transforms)
    lam = plan(lambda x: x, STORED)
    assert len(lam.ops) == 1 and lam.stages() == (lam.ops, [])   # a plain callable: one op, on the host


def test_a_hybrid_is_checked_against_the_store_only_when_there_is_one():
    hybrid = HybridTransform("center_crop=8", [v2.RandomHorizontalFlip()])
    with pytest.raises(StaticMismatchError, match="center_crop"):
        plan(hybrid, STORED, where="s.shards")
    assert plan(hybrid, None).hybrid is hybrid      # not a store: nothing to check
    same = HybridTransform(STORED, [v2.RandomHorizontalFlip()])
    planned = plan(same, STORED)
    assert planned.hybrid is same and _ids(planned.ops) == _ids(same.dynamic_ops)


def test_batch_steps_keep_the_order_and_run_ops_without_a_batch_equivalent_per_sample():
    jitter = v2.ColorJitter(0.5)
    ops = [v2.RandomCrop((12, 10), padding=2), jitter, v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
    steps = plan(ops).steps()
    assert [type(s) for s in steps] == [BatchRandomCrop, PerSample, BatchNormalize]
    assert steps[1].op is jitter and steps[2].mean == MEAN
    own = BatchRandomHorizontalFlip(0.5)
    steps = plan([own, v2.RandomHorizontalFlip(0.25)]).steps()   # dlstore ops as given, torchvision ones mapped
    assert steps[0] is own and type(steps[1]) is BatchRandomHorizontalFlip and steps[1].p == 0.25
    with pytest.raises(TransformSpecError, match="callable"):
        plan("flip").steps()


def test_stages_cut_a_pipeline_at_its_first_float_op():
    flip, crop, to_float = v2.RandomHorizontalFlip(), v2.RandomCrop(8), v2.ToDtype(torch.float32, scale=True)
    host, device = stages(v2.Compose([flip, crop, to_float, v2.Normalize(MEAN, STD)]))
    assert _ids(host) == _ids([flip, crop]) and _ids(device[:1]) == _ids([to_float]) and len(device) == 2


class Resize:   # named like torchvision's, from another library: never read by name
    def __call__(self, x):
        return x


def test_is_torchvision_is_about_the_module_not_the_name():
    assert is_torchvision(v2.Resize(8)) and is_torchvision(v1.Resize(8)) and is_torchvision(v2.Compose([v2.Resize(8)]))
    assert not is_torchvision(Resize()) and not is_torchvision(BatchRandomCrop(8))
    assert not is_torchvision(lambda x: x)
