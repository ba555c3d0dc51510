"""The exceptions dlstore raises, each built on the builtin type it refines.

Catch ``DlstoreError`` to catch everything dlstore raises on purpose; catch the
builtin base (``ValueError``, ``FileExistsError``, ...) if you do not want to
import dlstore's names.
"""

from __future__ import annotations


class DlstoreError(Exception):
    """Base class of every error dlstore raises on purpose."""


class SourceError(DlstoreError, ValueError):
    """The image folder given to ``convert`` is unusable (missing, empty, ...)."""


class DecodeError(SourceError):
    """One source file could not be read or decoded; names the file and the reason."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class SourceChangedError(SourceError):
    """``resume``: source files the interrupted conversion already converted changed since (size,
    modification time or content); ``changed`` lists their origins (paths relative to the root)."""

    def __init__(self, message: str, changed: list[str]):
        super().__init__(message)
        self.changed = list(changed)


class ArgumentError(DlstoreError, ValueError):
    """An argument has a value dlstore cannot use; the message names it and what is valid."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument has a type dlstore cannot use; the message names it and what is accepted."""


class StoreNotFoundError(DlstoreError, FileNotFoundError):
    """Nothing exists at the path given as a store (or, for the tools, as a store or image folder)."""


class SampleIndexError(DlstoreError, IndexError):
    """A sample index (or range) outside a store or dataset."""


class SystemProbeError(DlstoreError, OSError):
    """A machine probe (page-cache residency, eviction) failed or is not supported on this system."""


class UsageError(DlstoreError, ValueError):
    """An API used in a way that cannot work (e.g. iterating the loader instead of the profiler)."""


class MeasurementError(DlstoreError, RuntimeError):
    """A measurement (bench, tune, profile) could not be taken; the message says why and what to change."""


class TransformSpecError(DlstoreError, ValueError):
    """A static transform spec is invalid, unsupported or random."""


class StoreExistsError(DlstoreError, FileExistsError):
    """The destination of a conversion exists and ``overwrite`` was not given."""


class NotAStoreError(StoreExistsError):
    """``overwrite`` was given, but the destination holds something dlstore did not write (a
    folder, a file, a link): nothing is replaced. Also raised when the destination is the
    source, lies inside it or contains it."""


class StoreBusyError(DlstoreError, RuntimeError):
    """The store is in use: another conversion to the same destination is running, or an LMDB
    environment is already open for writing in this process."""


class UnknownFormatError(DlstoreError, ValueError):
    """A format name or a path that matches no known store format."""


class WrongFormatError(UnknownFormatError):
    """A format-specific Dataset (``ShardsDataset``, ...) was given a store of another format."""


class StoreCorruptError(DlstoreError, ValueError):
    """A store's manifest or data is missing, damaged or inconsistent."""


class WriterKilledError(StoreCorruptError):
    """An interrupted conversion's staged HDF5 file whose writer was killed: HDF5 will not open it
    for writing again (its consistency flags), so ``--resume`` starts that conversion over."""


class ConversionInterrupted(DlstoreError, RuntimeError):
    """A conversion stopped before completion (signal, dead worker, I/O error)."""


class DistributedError(ConversionInterrupted):
    """Another rank of a distributed conversion failed (or could not be reached); this one stopped too."""


class DeviceMemoryError(DlstoreError, MemoryError):
    """A dataset does not fit in device memory; the message gives needed/free bytes and the options."""


class VariableShapeError(DlstoreError, ValueError):
    """An operation that stacks samples (e.g. ``GPUDataset``) got a variable-shape store."""


class StaticMismatchError(DlstoreError, ValueError):
    """A store was converted with other static transforms than the hybrid transform opening it."""


class StoreWriteError(DlstoreError, OSError):
    """Writing a store failed in the operating system (I/O error, file too large); names the path."""


class DiskFullError(StoreWriteError):
    """The filesystem holding a store being written is full (or the quota is used up); the
    message names the path, the free and needed bytes, and what to do."""


class WorkerError(DlstoreError, RuntimeError):
    """A loader worker process died (killed, crashed) while batches were being built."""


class SharedMemoryError(DlstoreError, MemoryError):
    """The shared memory (``/dev/shm``) cannot hold a loader's ring of batches; the message says how
    much it needs, how much is free, and what to do."""


class StateMismatchError(ArgumentError):
    """A loader state (``state_dict()``) loaded into a loader it does not fit: another dataset, batch
    size, ``drop_last``, sampler, back-end or seed; the message names each difference."""
