"""``dlstore.loader`` and the one class it returns: :class:`Loader`.

A Loader has DataLoader's attributes with DataLoader's meanings (``dataset``,
``batch_size``, ``sampler``, ``batch_sampler``, ``num_workers``, ...) plus ``backend``,
``device``, ``seed``, ``set_epoch`` and ``state_dict``. What builds the batches is a
back-end strategy behind it, one module each::

    threads.py     ThreadBackend     loader threads in this process (GIL-free batch paths)
    shm_ring.py    RingBackend       worker processes writing into shared-memory slots
    dataloader.py  DataLoaderBackend a torch DataLoader (per-sample pipelines, its options)
    resident.py    ResidentBackend   a GPUDataset's batches, indexed on its device
    device.py      DeviceStage       device=: the float tail of the transform, on the device

The Loader owns what every back-end shares: the order (sampler and batch sampler), the
epoch, the seeds (``seeds.py``: batch k of epoch e draws from one seed, whatever builds
it), the place in the epoch (``state.py``), ``collate_fn`` (``collate.py``) and the
composition of a host back-end with the device stage. A pass::

    epoch, pass generator (seeds.py) -> base seed, sampler order -> PassPlan
      -> back-end.begin(plan): host batches from plan.first on (built into the loader's memory)
      -> device stage (device=) -> collate_fn -> the user
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from ...errors import ArgumentError, ArgumentTypeError
from ...transforms import compiled
from ..dataset import StoreDataset
from ..gpu.dataset import GPUDataset
from ..gpu.partition import ShareSampler, per_rank
from . import options as opt
from .collate import is_default, run_collate
from .dataloader import DataLoaderBackend
from .device import DeviceStage
from .passes import LoaderIterator, PassPlan
from .resident import ResidentBackend
from .ring_slots import batch_spec, ring_bytes, shm_free, shm_message
from .seeds import COLLATE_STREAM, Seeding, agreed_seed, check_seed, distributed_group
from .shm_ring import RingBackend
from .state import Fit, PassState
from .threads import ThreadBackend

_KNOWN = ["dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "num_workers", "collate_fn",
          "pin_memory", "drop_last", "timeout", "worker_init_fn", "multiprocessing_context", "generator", "prefetch_factor",
          "persistent_workers", "in_order", "backend", "num_threads", "seed", "distributed", "device", "dtype",
          "channels_last", "fused", "compile"]


class Loader:
    """Batches of a store's dataset or a GPUDataset, for every back-end (see the module doc).

    Iterating gives ``(images, targets)`` batches, in sampler order; each ``iter()`` is one
    epoch (``set_epoch(e)`` chooses which). ``len()`` is the batches per epoch.

    Its arguments are DataLoader's, in DataLoader's order and with its meanings (a drop-in
    for ``torch.utils.data.DataLoader``), then dlstore's own, keyword-only: hence more than ten.

    Args:
        dataset: a StoreDataset (``dlstore.open_dataset``) or a GPUDataset.
        batch_size: samples per batch (None with ``batch_sampler``).
        shuffle: a new order every epoch (``RandomSampler``).
        sampler: the order of the samples (e.g. ``BlockShuffleSampler`` for a store bigger than
            memory, ``DistributedSampler(ds, num_replicas, rank)`` for a rank set by hand).
        batch_sampler: yields each batch's indices (excludes batch_size, shuffle, sampler, drop_last).
        num_workers: worker processes (0: none; batches built by threads in this process where
            the batch path allows it).
        collate_fn: DataLoader's: called with the list of ``(image, target)`` samples of each
            batch (``collate.py``); ``default_collate`` and None return the batch as built.
        pin_memory: page-locked batches (CUDA only).
        drop_last: drop a last, smaller batch.
        worker_init_fn, multiprocessing_context, persistent_workers: DataLoader's, for worker processes
            (``worker_init_fn`` with ``num_workers=0`` is never called, as with DataLoader).
        timeout: DataLoader's: seconds to wait for a batch from the worker processes (0: no limit);
            without workers (threads, a GPUDataset) it does not apply, as with DataLoader.
        generator: DataLoader's: the order and the draws come from it, advanced by each pass.
        prefetch_factor: batches built ahead per worker (thread or process); default 2.
        backend: ``"auto"``, ``"threads"``, ``"ring"``, ``"dataloader"`` or ``"resident"`` (options.py).
        num_threads: threads of ``backend="threads"`` (None: the usable CPUs, at most 8).
        seed: an int makes every epoch's order and draws a function of (seed, epoch), on every
            back-end; None (default) a fresh order each run, as DataLoader (``seeds.py``).
        distributed: read this rank's share under an initialised ``torch.distributed`` group
            (a ``DistributedSampler``; the ranks agree on its seed).
        device: run the float tail of the transform on this device and deliver batches there.
        dtype: with ``device=``, the float dtype of the images.
        channels_last: images in ``torch.channels_last`` memory format (with ``device=``, or a GPUDataset).
        fused, compile: a GPUDataset's crop + flip + conversion as one gather (``gpu/fused.py``).

    Raises:
        ArgumentError: a value that cannot work, an argument that does not apply to this dataset
            or back-end, a 0.2 spelling (naming the new one), an unknown name (naming the nearest).
    """

    def __init__(self, dataset: StoreDataset | GPUDataset, batch_size: int | None = 1, shuffle: bool = False,
                 sampler: Sampler | Iterable | None = None, batch_sampler: Sampler | Iterable | None = None,
                 num_workers: int = 0, collate_fn: Callable[[Any], Any] | None = None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None, generator: torch.Generator | None = None, *,
                 prefetch_factor: int | None = None, persistent_workers: bool = False, in_order: bool = True,
                 backend: str = "auto",
                 num_threads: int | None = None, seed: int | None = None, distributed: bool = False,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 channels_last: bool = False, fused: bool | None = None, compile: bool = False, **unknown: Any):
        opt.refuse_unknown(unknown, _KNOWN)
        if not isinstance(dataset, (StoreDataset, GPUDataset)):
            raise ArgumentTypeError(f"dlstore.loader takes a StoreDataset (dlstore.open_dataset(path)) or a GPUDataset, "
                                    f"got {type(dataset).__name__}; for other datasets use torch.utils.data.DataLoader")
        self.dataset = dataset
        self.shuffle = opt.flag("shuffle", shuffle)
        self.drop_last = opt.flag("drop_last", drop_last)
        self.num_workers = opt.positive_int("num_workers", num_workers, zero=True)
        self.prefetch_factor = opt.positive_int("prefetch_factor", prefetch_factor, none=True)
        self.persistent_workers = opt.flag("persistent_workers", persistent_workers)
        self.pin_memory = opt.flag("pin_memory", pin_memory)
        self.timeout = opt.non_negative("timeout", timeout)
        if in_order is not True:
            raise ArgumentError("dlstore.loader: in_order=False is not supported: batches always come in the "
                                "sampler's order (which is what makes an epoch reproducible)")
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.generator = generator
        self.collate_fn = collate_fn
        if collate_fn is not None and not callable(collate_fn):
            raise ArgumentTypeError(f"dlstore.loader: collate_fn must be callable, got {collate_fn!r}")
        self.num_threads = opt.positive_int("num_threads", num_threads, none=True)
        self.seed = check_seed(seed)
        self.channels_last = opt.flag("channels_last", channels_last)
        self.device = None if device is None else opt.check_device(device)
        self.dtype = dtype
        wanted = opt.check_backend(backend)
        self.distributed = opt.flag("distributed", distributed)
        _check_samplers(sampler, batch_sampler, shuffle=self.shuffle, distributed=self.distributed)
        group = distributed_group() if distributed else None
        if distributed and group is None:
            raise ArgumentError("dlstore.loader(distributed=True) needs an initialised torch.distributed process group "
                                "(launch with torchrun and call torch.distributed.init_process_group first)")
        self._seeding = Seeding(self.seed, generator)
        self.batch_size, self.sampler, self.batch_sampler = self._samplers(batch_size, sampler, batch_sampler, group)
        self._seeding.rank = _rank_of(self.sampler, dataset, group)
        if isinstance(dataset, GPUDataset):
            self._backend: Any = self._resident(wanted, fused=fused, compile=compile)
            self._device: DeviceStage | None = None
        else:
            opt.not_applying({"fused": (fused, None), "compile": (compile, False)},
                             "to a StoreDataset (a GPUDataset's gather on its device); a store's crop + flip is "
                             "fused into its batch copy already")
            self._backend, self._device = self._host(wanted)
        self.pin_memory = self.pin_memory and self._device is None   # the device stage stages pinned itself
        self.epoch = 0
        self._sampler_epoch: int | None = getattr(self.sampler, "epoch", None)   # see _begin
        self._state = PassState()

    # --- construction steps ---------------------------------------------------------------

    def _samplers(self, batch_size: Any, sampler: Any, batch_sampler: Any, group: tuple[int, int] | None
                  ) -> tuple[int | None, Any, Any]:
        """(batch_size, sampler, batch_sampler) as DataLoader sets them, from what was given."""
        sharded = isinstance(self.dataset, GPUDataset) and self.dataset.sharded
        for given in (sampler, getattr(batch_sampler, "sampler", None)):
            # a sampler with no randomness of its own draws from the pass generator (seeds.py)
            if getattr(given, "generator", 0) is None and getattr(given, "seed", None) is None:
                given.generator = self._seeding.generator
        if batch_sampler is not None:
            if batch_size not in (1, None) or self.shuffle or sampler is not None or self.drop_last or self.distributed:
                raise ArgumentError("dlstore.loader: batch_sampler= sets the batches: it excludes batch_size, shuffle, "
                                    "sampler, drop_last and distributed (as DataLoader)")
            return None, getattr(batch_sampler, "sampler", None), batch_sampler
        batch_size = opt.positive_int("batch_size", batch_size)
        if sampler is not None:
            if sharded:
                raise ArgumentError("dlstore.loader: sampler= with a GPUDataset that holds one rank's share "
                                    "(shard=True): its loader serves that share in its own order; drop sampler")
        elif sharded:
            if self.distributed:
                raise ArgumentError("dlstore.loader: distributed=True with a GPUDataset that holds one rank's share "
                                    "(shard=True): its loader serves that share already; drop distributed")
            ds = self.dataset
            sampler = ShareSampler(len(ds), per_rank(ds.total_samples, ds.world_size), shuffle=self.shuffle,
                                   rank=ds.rank, generator=self._seeding.generator)
        elif group is not None:
            sampler = DistributedSampler(self.dataset, num_replicas=group[1], rank=group[0], shuffle=self.shuffle,
                                         seed=agreed_seed(self.seed), drop_last=self.drop_last)
        elif self.shuffle:
            sampler = RandomSampler(self.dataset, generator=self._seeding.generator)
        else:
            sampler = SequentialSampler(self.dataset)
        return batch_size, sampler, BatchSampler(sampler, batch_size, self.drop_last)

    def _resident(self, wanted: str, *, fused: bool | None, compile: bool) -> ResidentBackend:
        if wanted not in ("auto", "resident"):
            raise ArgumentError(f"dlstore.loader: backend={wanted!r} with a GPUDataset: its batches are indexed on "
                                "its device (backend='resident'); for threads or workers open the store with "
                                "open_dataset")
        opt.not_applying({
            "num_workers": (self.num_workers, 0), "num_threads": (self.num_threads, None),
            "pin_memory": (self.pin_memory, False), "persistent_workers": (self.persistent_workers, False),
            "multiprocessing_context": (self.multiprocessing_context, None),
            "worker_init_fn": (self.worker_init_fn, None), "device": (self.device, None), "dtype": (self.dtype, None),
        }, "to a GPUDataset: it has no workers and is already on its device")
        return ResidentBackend(self.dataset, batch_size=self.batch_size, prefetch=self.prefetch_factor or 2,
                               fused=fused, compile=compile, channels_last=self.channels_last)

    def _host(self, wanted: str) -> tuple[Any, DeviceStage | None]:
        """The host back-end over the dataset's host stage, and the device stage (``device=``)."""
        host_ds, stage = self.dataset, None
        if self.device is None:
            opt.not_applying({"channels_last": (self.channels_last, False), "dtype": (self.dtype, None)},
                             "without device= (where the float stage runs) or a GPUDataset")
        else:
            if self.pin_memory:
                raise ArgumentError("dlstore.loader: pin_memory=True with device=: the loader stages batches in its "
                                    "own pinned buffers when the device is CUDA; drop pin_memory")
            # JPEG records go to CUDA undecoded (nvjpeg decodes them there), except through the ring,
            # whose slots hold pixels
            records = self.device.type == "cuda" and wanted != "ring"
            host_ds, steps = self.dataset.host_stage(records_to=self.device if records else None)
            stage = DeviceStage(self.device, steps, dtype=self.dtype, channels_last=self.channels_last)
        self.pin_memory = opt.check_pin_memory(self.pin_memory)
        # (worker_init_fn without workers is accepted and never called, as DataLoader accepts it)
        dataloader_only = [name for name, value in (("persistent_workers", self.persistent_workers),
                                                    ("multiprocessing_context", self.multiprocessing_context)) if value]
        if dataloader_only and not self.num_workers:
            raise ArgumentError(f"dlstore.loader: {dataloader_only[0]}= applies to worker processes: pass num_workers "
                                ">= 1")
        spec: list[Any] = []

        def ring_fits(warn: bool = True) -> bool:
            spec[:] = [batch_spec(host_ds) if self.batch_size is not None else None]
            if spec[0] is None:
                return False
            need = ring_bytes(spec[0], self.batch_size, self.num_workers * (self.prefetch_factor or 2),
                              self.num_workers)
            free = shm_free()
            if free is not None and need > free // 2:
                warnings.warn(f"dlstore.loader: not using worker processes' shared-memory ring: {shm_message(need)}",
                              stacklevel=5)
                return False
            return True

        name = opt.choose_store_backend(wanted, host_ds, num_workers=self.num_workers, num_threads=self.num_threads,
                                        dataloader_only=dataloader_only, ring_fits=ring_fits)
        if self.num_workers and host_ds.fuses_crop_flip:
            compiled.available()   # numba's kernel built (or loaded) here, once, before workers fork
        return self._make_host(name, host_ds, spec, stage, chosen=wanted == "auto"), stage

    def _make_host(self, name: str, host_ds: Any, spec: list[Any], stage: DeviceStage | None, *,
                   chosen: bool) -> Any:
        prefetch = self.prefetch_factor or 2
        if name == "threads":
            self.num_threads = self.num_threads or opt.auto_threads()
            return ThreadBackend(host_ds, threads=self.num_threads, prefetch=self.num_threads * prefetch,
                                 batch_size=self.batch_size, pin_memory=self.pin_memory)

        def dataloader() -> DataLoaderBackend:
            return DataLoaderBackend(host_ds, num_workers=self.num_workers, pin_memory=self.pin_memory,
                                     persistent_workers=self.persistent_workers, prefetch_factor=self.prefetch_factor,
                                     multiprocessing_context=self.multiprocessing_context,
                                     worker_init_fn=self.worker_init_fn, timeout=self.timeout,
                                     collate_fn=None if stage is not None or is_default(self.collate_fn)
                                     else self.collate_fn)
        if name == "dataloader":
            return dataloader()
        if not spec:
            spec.append(batch_spec(host_ds) if self.batch_size is not None else None)
        if spec[0] is None:
            raise ArgumentError(f"dlstore.loader: backend='ring' needs batches of one fixed shape and a batch_size; "
                                f"{host_ds!r} gives variable shapes or non-tensor batches: pass backend='dataloader' "
                                "(or 'auto')")
        return RingBackend(host_ds, workers=self.num_workers, prefetch=self.num_workers * prefetch, spec=spec[0],
                           batch_size=self.batch_size, pin_memory=self.pin_memory,
                           persistent_workers=self.persistent_workers,
                           multiprocessing_context=self.multiprocessing_context, worker_init_fn=self.worker_init_fn,
                           fallback=dataloader if chosen else None, timeout=self.timeout)   # asked for: its error stands

    # --- DataLoader's interface -----------------------------------------------------------

    @property
    def strategy(self) -> Any:
        """The back-end object building the batches (ThreadBackend, RingBackend, DataLoaderBackend or
        ResidentBackend), for inspection: e.g. a resident one's ``fused`` / ``fused_reason``."""
        return getattr(self._backend, "fallen_back", None) or self._backend

    @property
    def device_stage(self) -> DeviceStage | None:
        """What runs on the device with ``device=`` (its ``steps``), or None."""
        return self._device

    @property
    def backend(self) -> str:
        """The back-end building the batches: threads, ring, dataloader or resident."""
        return self.strategy.name

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next pass (its order, its draws, a DistributedSampler's shuffle)."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ArgumentError(f"set_epoch takes an int >= 0, got {epoch!r}")
        self.epoch = epoch
        self._sampler_epoch = None
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
            self._sampler_epoch = epoch

    def _fit(self) -> Fit:
        return Fit(dataset_length=len(self.dataset), dataset=self.dataset.fingerprint, batch_size=self.batch_size,
                   drop_last=self.drop_last, sampler=type(self.sampler).__name__, backend=self.backend,
                   seed=self.seed)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands in its epoch, and what it fits: ``load_state_dict`` on a loader made with
        the same arguments (in another process too) continues with the same batches and augmentations."""
        generator = None if self.seed is not None else self._seeding.current()
        return self._state.state_dict(self._fit(), generator, self.epoch)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next pass is its epoch, past the batches already handed out
        (not built again). StateMismatchError if the state was saved by a loader this one does not fit."""
        self._state.load_state_dict(state, self._fit(), len(self))

    def close(self) -> None:
        """Stop what outlives a pass (persistent workers, the ring's shared memory)."""
        self._backend.close()

    # --- a pass ---------------------------------------------------------------------------

    def _begin(self) -> tuple[PassPlan, bool]:
        """The next pass's plan (and whether collate_fn runs here rather than in the back-end)."""
        epoch = self._state.pending_epoch()
        if epoch is None:
            epoch = self.epoch
            sampler_epoch = getattr(self.sampler, "epoch", None)
            if isinstance(sampler_epoch, int) and self._sampler_epoch is not None \
                    and sampler_epoch != self._sampler_epoch:
                epoch = sampler_epoch      # loader.sampler.set_epoch(e), DataLoader's idiom, counts as set_epoch(e)
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
            self._sampler_epoch = epoch
        generator = self._seeding.begin(epoch)
        first = self._state.begin(generator, epoch, seeded=self.seed is not None)
        base = Seeding.draw_base(generator)
        self.epoch = epoch + 1
        run = PassPlan(epoch, base, self._seeding.rank, first, enumerate(self.batch_sampler))
        collates_here = not is_default(self.collate_fn) and not getattr(self._backend, "collates", False)
        return run, collates_here

    def __iter__(self) -> Iterator[Any]:
        # worker processes start here, as a DataLoader's do at iter(); the pass itself (its epoch,
        # its draws) begins with the first batch asked for, so an iterator dropped unstarted
        # takes no epoch and draws nothing
        prepare = getattr(self._backend, "prepare", None)
        token = prepare() if prepare is not None else None
        batches = self._pass()
        return LoaderIterator(batches, functools.partial(_release_unstarted, self._backend, batches, token))

    def _pass(self) -> Generator[Any, None, None]:
        run, collates_here = self._begin()
        host = self._backend.begin(run)
        batches = host if self._device is None else self._device.batches(iter(host), run)
        k = run.first
        try:
            for batch in batches:
                if collates_here:
                    batch = run_collate(self.collate_fn, batch, run.seed(k, COLLATE_STREAM))
                k += 1
                self._state.served = k
                yield batch
                del batch      # this frame keeps no reference to a batch handed out (its buffer is reused)
            self._state.end()
        finally:
            for it in (batches, host):
                close = getattr(it, "close", None)
                if close is not None:
                    close()

    def __repr__(self) -> str:
        where = f", device={self.device}" if self.device is not None else ""
        how = self._backend.describe() + (f"; {self._device.describe()}" if self._device is not None else "")
        return (f"Loader({self.dataset!r}, batch_size={self.batch_size}, shuffle={self.shuffle}, "
                f"batches={len(self)}, backend={self.backend!r}{where}, {self._seeding.describe()}; {how})")


def loader(dataset: StoreDataset | GPUDataset, *args: Any, **options: Any) -> Loader:
    """A :class:`Loader` over ``dataset``: ``dlstore.loader(ds, 64, shuffle=True)`` is
    ``DataLoader(ds, 64, shuffle=True)`` for a store (the same arguments, in the same order; see
    :class:`Loader`)."""
    return Loader(dataset, *args, **options)


def _rank_of(sampler: Any, dataset: Any, group: tuple[int, int] | None) -> int:
    """This process's rank, mixed into the batch seeds so that ranks draw apart: the process group's,
    a rank given by hand to the sampler (``DistributedSampler(num_replicas=, rank=)``), or a sharded
    GPUDataset's."""
    if group is not None:
        return group[0]
    if isinstance(getattr(sampler, "rank", None), int) and getattr(sampler, "num_replicas", 1) > 1:
        return sampler.rank
    return int(getattr(dataset, "rank", 0)) if getattr(dataset, "sharded", False) else 0


def _check_samplers(sampler: Any, batch_sampler: Any, *, shuffle: bool, distributed: bool) -> None:
    for name, given in (("sampler", sampler), ("batch_sampler", batch_sampler)):
        if given is not None and not (hasattr(given, "__iter__") and hasattr(given, "__len__")):
            hint = " (num_workers is a keyword argument: DataLoader's order puts sampler 4th)" \
                if name == "sampler" and isinstance(given, int) else ""
            raise ArgumentTypeError(f"dlstore.loader: {name}= takes a Sampler (iterable, with len), got "
                                    f"{type(given).__name__}{hint}")
    if sampler is not None:
        for name, value in (("shuffle", shuffle), ("distributed", distributed)):
            if value:
                raise ArgumentError(f"dlstore.loader: sampler= and {name}=True: the sampler sets the order "
                                    f"(give it distributed=True or num_replicas/rank); drop {name}")


def _release_unstarted(backend: Any, batches: Generator, token: Any) -> None:
    """As a pass's iterator is closed or dropped: one never advanced gives back what ``iter()`` started
    (its generator never ran, so no ``finally`` did either)."""
    release = getattr(backend, "release", None)
    if release is not None and inspect.getgeneratorstate(batches) == inspect.GEN_CREATED:
        release(token)
