"""Where a loader stands in its epoch, and what a saved state fits: ``state_dict`` / ``load_state_dict``.

A pass is reproducible from its pass generator's state when it began (which drew the order
and the pass's base seed: ``seeds.py``) and its epoch; batch k's draws depend only on
(base, epoch, k). So a state is that generator state (none for an int seed: the epoch
recomputes it), the epoch and the batches handed out; a pass resumed from it skips those
batches without building them. Between passes it is the state the next pass will begin from.

A state also records what it fits (``Fit``): the dataset (its length and fingerprint), the
batch size, ``drop_last``, the sampler's kind, the back-end and the seed. Loaded into a
loader that differs in any of them it would skip the wrong samples or draw other
augmentations, so ``load_state_dict`` refuses, naming each difference. One difference is
harmless: the host back-ends (threads, ring, dataloader) build the same batches from the
same seeds, so a state moves between them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ...errors import StateMismatchError

STATE_VERSION = 2
HOST_BACKENDS = ("threads", "ring", "dataloader")


@dataclass(frozen=True)
class Fit:
    """What a loader's state depends on (see the module doc)."""

    dataset_length: int
    dataset: str          # the dataset's fingerprint
    batch_size: int | None
    drop_last: bool
    sampler: str          # the sampler's class name
    backend: str
    seed: int | None

    def differences(self, saved: dict[str, Any]) -> list[str]:
        mine = asdict(self)
        out = []
        for name, value in mine.items():
            theirs = saved.get(name, "(missing)")
            if name == "backend" and value in HOST_BACKENDS and theirs in HOST_BACKENDS:
                continue       # the same batches on each
            if theirs != value:
                out.append(f"{name}: the state has {theirs!r}, this loader {value!r}")
        return out


class PassState:
    """A loader's place in its epoch (see the module doc)."""

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None   # loaded, applied when the next pass begins
        self._began: torch.Tensor | None = None       # pass generator state at the start of the pass in progress
        self._epoch = 0
        self.in_pass = False
        self.served = 0                               # batches of that pass handed out

    def pending_epoch(self) -> int | None:
        """The epoch a loaded state resumes, until the next pass begins."""
        return None if self._pending is None else int(self._pending["epoch"])

    def begin(self, generator: torch.Generator, epoch: int, *, seeded: bool) -> int:
        """Called as a pass starts, before it draws anything (``generator`` ready): the batches to skip.
        ``seeded``: the generator was just seeded from (seed, epoch), so a saved state is not restored."""
        skip = 0
        if self._pending is not None:
            if not seeded:
                generator.set_state(self._pending["generator"])
            skip = int(self._pending["batches"])
            self._pending = None
        self._began = None if seeded else generator.get_state()
        self._epoch, self.served, self.in_pass = epoch, skip, True
        return skip

    def end(self) -> None:
        """Called when a pass has handed out its last batch."""
        self._began, self.served, self.in_pass = None, 0, False

    def state_dict(self, fit: Fit, generator: torch.Generator | None, epoch: int) -> dict[str, Any]:
        """``generator``: the pass generator as it is now, or None for an int seed."""
        if self._pending is not None:     # loaded and not started yet: still that state
            return {**self._pending, "fit": asdict(fit)}
        if self.in_pass:
            state = {"epoch": self._epoch, "batches": self.served,
                     "generator": None if self._began is None else self._began.clone()}
        else:
            state = {"epoch": epoch, "batches": 0,
                     "generator": None if generator is None else generator.get_state()}
        return {"version": STATE_VERSION, **state, "fit": asdict(fit)}

    def load_state_dict(self, state: Any, fit: Fit, batches: int) -> int:
        """Keep ``state`` for the next pass; its epoch. ``batches``: the length of an epoch.

        Raises:
            StateMismatchError: not a state of this version, damaged, or saved by a loader this one
                does not fit (each difference named).
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise StateMismatchError(f"load_state_dict takes what a dlstore 0.3 loader's state_dict() returned "
                                     f"(version {STATE_VERSION}), got {got!r}")
        saved = state.get("fit")
        if not isinstance(saved, dict):
            raise StateMismatchError("load_state_dict: the state records no 'fit' (what loader saved it)")
        differences = fit.differences(saved)
        if differences:
            raise StateMismatchError("load_state_dict: this state was saved by a loader that differs from this one "
                                     "(it would resume at other samples or with other draws): "
                                     + "; ".join(differences))
        served, epoch, rng = state.get("batches"), state.get("epoch"), state.get("generator")
        if not isinstance(served, int) or not 0 <= served <= batches or not isinstance(epoch, int) \
                or not (rng is None or isinstance(rng, torch.Tensor)) or (rng is None) != (fit.seed is not None):
            raise StateMismatchError(f"load_state_dict: a damaged state (batches={served!r} of an epoch of "
                                     f"{batches}, epoch={epoch!r}, generator {type(rng).__name__})")
        self._pending = {"version": STATE_VERSION, "epoch": epoch, "batches": served,
                         "generator": None if rng is None else rng.clone()}
        return epoch
