"""The loader's arguments: checked once, and the back-end chosen from them.

``check_arguments`` refuses values of the wrong type or range, arguments that do not apply
to the dataset or to the back-end asked for (a constructor that silently ignores an
argument is a bug waiting to happen), the 0.2 spellings (each error names the new one) and
unknown names (naming the nearest). ``choose_backend`` picks the back-end ``"auto"`` means:

    GPUDataset                              resident (indexed on its device)
    num_workers=0, a batch path threads     threads (GIL-free gathers, batch ops: no IPC)
      run (``StoreDataset.threads_apply``)
    num_workers=0 otherwise                 dataloader, in this process
    num_workers>0, one fixed batch shape    ring (shared-memory slots), if /dev/shm holds it
    num_workers>0 otherwise                 dataloader
"""

from __future__ import annotations

import difflib
import os
import warnings
from typing import Any

import torch

from ..._system import usable_cpus
from ...errors import ArgumentError, ArgumentTypeError

BACKENDS = ("auto", "threads", "ring", "dataloader", "resident")
# num_threads=None picks min(usable CPUs, this): beyond it memory bandwidth, not CPU, bounds a
# gather, and every thread keeps two batches in flight.
MAX_AUTO_THREADS = 8

# Arguments of 0.2 that are gone, and what says the same now.
REMOVED = {
    "threads": "backend='threads' (num_threads=N sets the count; threads=0 was backend='dataloader')",
    "shm_ring": "backend='ring' (shm_ring=True) or backend='dataloader' (shm_ring=False)",
    "transform": "open_dataset(path, transform=...) for a store, GPUDataset(path, transform=...) for a "
                 "GPUDataset: a dataset holds its transform, and every read path runs it",
    "batch_transform": "open_dataset(path, batch_transform=...) for a store; a GPUDataset's batch pipeline is "
                       "GPUDataset(path, transform=...)",
}


def auto_threads() -> int:
    """Threads of ``backend="threads"`` when ``num_threads`` is None: the usable CPUs (under torchrun,
    the node's share of this rank), at most ``MAX_AUTO_THREADS``."""
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(usable_cpus() // ranks, MAX_AUTO_THREADS))


def refuse_unknown(unknown: dict[str, Any], known: list[str]) -> None:
    """ArgumentError for keyword arguments the loader does not take: the 0.2 names with their
    replacement, others with the nearest known name."""
    for name in unknown:
        if name in REMOVED:
            raise ArgumentError(f"dlstore.loader: {name}= is gone since 0.3; use {REMOVED[name]} "
                                "(docs/migration.md)")
        near = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {near[0]}=?" if near else f"; it takes {', '.join(known)}"
        raise ArgumentError(f"dlstore.loader got an unexpected keyword argument {name!r}{hint}")


def positive_int(name: str, value: Any, *, zero: bool = False, none: bool = False) -> Any:
    if value is None and none:
        return None
    low = 0 if zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        allowed = f"an int >= {low}" + (" or None" if none else "")
        raise ArgumentError(f"dlstore.loader: {name} must be {allowed}, got {value!r}")
    return value


def non_negative(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ArgumentError(f"dlstore.loader: {name} must be a number >= 0, got {value!r}")
    return value


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"dlstore.loader: {name} must be True or False, got {value!r}")
    return value


def check_backend(backend: Any) -> str:
    if backend == "gpu":
        raise ArgumentError("dlstore.loader: backend='gpu' is backend='resident' since 0.3 (a GPUDataset's batches, "
                            "indexed where it is held: on a GPU, or on the CPU with device='cpu')")
    if backend not in BACKENDS:
        raise ArgumentError(f"dlstore.loader: backend must be one of {', '.join(map(repr, BACKENDS))}, "
                            f"got {backend!r}")
    return backend


def not_applying(given: dict[str, Any], why: str) -> None:
    """ArgumentError naming every argument of ``given`` (name -> (value, default)) that is not its default."""
    names = [name for name, (value, default) in given.items() if value is not default and value != default]
    if names:
        raise ArgumentError(f"dlstore.loader: {', '.join(names)} {'does' if len(names) == 1 else 'do'} not "
                            f"apply {why}")


def check_device(device: Any) -> torch.device:
    """``device`` as a torch.device that exists here (GPUDataset's check: one rule for both)."""
    from ..gpu.checks import check_device as usable

    return usable(device)


def check_pin_memory(pin_memory: bool) -> bool:
    if pin_memory and not torch.cuda.is_available():
        warnings.warn("dlstore.loader: pin_memory=True but CUDA is not available; batches are not pinned",
                      stacklevel=4)
        return False
    return pin_memory


def choose_store_backend(backend: str, dataset: Any, *, num_workers: int, num_threads: int | None,
                         dataloader_only: list[str], ring_fits: Any) -> str:
    """The back-end for a StoreDataset: ``backend`` checked against the other arguments, or what
    ``"auto"`` means (module doc). ``ring_fits()``: whether the ring can hold this loader's batches."""
    def conflict(other: str, fix: str) -> ArgumentError:
        return ArgumentError(f"dlstore.loader: backend={backend!r} and {other}: {fix}")

    if backend == "resident":
        raise ArgumentError("dlstore.loader: backend='resident' serves a GPUDataset (dlstore.GPUDataset(path, "
                            f"device=...)), got {type(dataset).__name__}")
    if num_threads is not None and backend not in ("auto", "threads"):
        raise conflict(f"num_threads={num_threads}", "num_threads is the thread count of backend='threads'")
    if backend == "auto":
        if num_threads is not None:
            backend = "threads"          # a thread count asks for threads
        elif num_workers == 0:
            return "threads" if dataset.threads_apply and not dataloader_only else "dataloader"
        else:
            return "ring" if ring_fits() else "dataloader"
    if backend == "threads":
        if num_workers:
            raise conflict(f"num_workers={num_workers}", "threads build batches in this process; drop num_workers "
                           "(num_threads sets the count) or pass backend='ring' for worker processes")
        if dataloader_only:
            raise conflict(f"{dataloader_only[0]}=", "threads start no worker processes")
        return "threads"
    if backend == "ring" and not num_workers:
        raise conflict("num_workers=0", "the ring's batches are written by worker processes: pass num_workers >= 1")
    return backend

