"""Where a loader's randomness comes from: one rule for every back-end and every dataset kind.

A pass (one epoch, or the rest of one after ``load_state_dict``) draws two things from its
*pass generator*: the sampler's order (``RandomSampler`` draws from it when it iterates) and
one int64, the pass's ``base``. Batch ``k`` then gets a generator of its own, seeded with
``batch_seed(base, epoch, k, rank)``: its random crops, flips, per-sample ops and
``collate_fn`` draw from that alone, so batch k is the same whatever the back-end, the
thread or worker count, or the batches built before it. The pass generator is::

    seed=int            a private generator seeded from (seed, epoch): epoch e is a pure
                        function of (seed, e), whatever ran before in the process
    generator=g         g as it is (DataLoader's meaning: each pass advances it)
    neither             torch's default generator as it is (torch.manual_seed at the top
                        of a script makes the run reproducible, as with DataLoader)

Under ``torch.distributed`` the ranks must agree on the order (``DistributedSampler``'s
seed): ``agreed_seed`` gives every rank rank 0's seed, drawn there when none is given.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...errors import ArgumentError, ArgumentTypeError

_MASK = (1 << 64) - 1
# stream ids that keep the seeds of a batch's stages apart (SeedSequence entropy)
COLLATE_STREAM = 1
DEVICE_STREAM = 2


def batch_seed(base: int, epoch: int, k: int, rank: int = 0, stream: int = 0) -> int:
    """The seed of batch ``k`` of a pass whose base seed is ``base``, in epoch ``epoch``, on ``rank``;
    ``stream`` tells apart the stages of one batch that draw (the host build, collate, the device)."""
    entropy = [base & _MASK, epoch & _MASK, k]
    if rank or stream:
        entropy += [rank, stream]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0])


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch``'s pass generator for a loader of seed ``seed``."""
    return int(np.random.SeedSequence([seed & _MASK, epoch & _MASK]).generate_state(1, dtype=np.uint64)[0]) >> 1


def check_seed(seed: Any) -> int | None:
    if seed is not None and (not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)):
        raise ArgumentTypeError(f"seed must be an int (reproducible order and draws) or None (a fresh order "
                                f"each run), got {seed!r}")
    return None if seed is None else int(seed)


def distributed_group() -> tuple[int, int] | None:
    """(rank, world size) of an initialised ``torch.distributed`` group, else None."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def agreed_seed(seed: int | None) -> int:
    """``seed``, or one drawn on rank 0 (from torch's default generator) and broadcast to every rank.

    A collective: every rank of the group must call it, as each builds its loader.
    """
    if seed is not None:
        return seed
    dist = torch.distributed
    drawn = [int(torch.empty((), dtype=torch.int64).random_().item()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(drawn, src=0)
    return int(drawn[0])


class Seeding:
    """The pass generator of a loader (see the module doc) and the per-batch seeds drawn from it.

    Args:
        seed: an int, or None.
        generator: a CPU ``torch.Generator`` (DataLoader's ``generator=``), or None.
        rank: this process's rank, mixed into batch seeds so ranks draw apart.
    """

    def __init__(self, seed: int | None, generator: torch.Generator | None, rank: int = 0):
        self._epoch_generator = torch.Generator() if seed is not None else None
        if seed is not None and generator is not None:
            raise ArgumentError("seed= and generator= both set the loader's randomness: pass one (seed=int makes "
                                "each epoch a function of (seed, epoch); generator= is DataLoader's, advanced "
                                "by every pass)")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ArgumentTypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if generator is not None and generator.device.type != "cpu":
            raise ArgumentError(f"generator must be a CPU generator (the order and the draws are made on the host), "
                                f"got one on {generator.device}")
        self.seed = seed
        self.user_generator = generator
        self.rank = rank
        # what a sampler built by the loader draws its order from
        self.generator: torch.Generator | None = self._epoch_generator or generator

    def begin(self, epoch: int) -> torch.Generator:
        """The pass generator of a pass of ``epoch``, ready to draw (reseeded for an int seed)."""
        if self.seed is not None and self._epoch_generator is not None:
            self._epoch_generator.manual_seed(epoch_seed(self.seed, epoch))
            return self._epoch_generator
        return self.generator if self.generator is not None else torch.default_generator

    def current(self) -> torch.Generator:
        """The pass generator as it is now (no reseeding)."""
        return self.generator if self.generator is not None else torch.default_generator

    @staticmethod
    def draw_base(generator: torch.Generator) -> int:
        return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())

    def describe(self) -> str:
        if self.seed is not None:
            return f"seed={self.seed}"
        return "generator=<given>" if self.user_generator is not None else "seed=None"
