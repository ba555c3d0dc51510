"""Tools to pick and prove a set-up on a given machine: bench, tune, profile, verify.

``dlstore.tools.bench``, ``dlstore.tools.tuning``, ``dlstore.tools.profiling`` and
``dlstore.tools.verification`` are imported on first use; the names below are
the ones a user calls.
"""

from .._system import (
    CpuInfo,
    cpu_info,
    usable_cpus,
)
from .bench import BenchReport, run_bench
from .bench.probes import (
    disk_info,
    evict,
    resident_fraction,
)
from .profiling import LoaderReport, profile_loader, synthetic_step
from .timed_dataset import TimedDataset
from .timeline import Timeline
from .train_profile import TrainingProfile, profile_training, training_step
from .tuning import TuneResult, loader_kwargs, measure_throughput, tune
from .verification import VerifyReport, verify

__all__ = [
    "BenchReport",
    "CpuInfo",
    "LoaderReport",
    "TimedDataset",
    "Timeline",
    "TrainingProfile",
    "TuneResult",
    "VerifyReport",
    "cpu_info",
    "disk_info",
    "evict",
    "loader_kwargs",
    "measure_throughput",
    "profile_loader",
    "profile_training",
    "resident_fraction",
    "run_bench",
    "synthetic_step",
    "training_step",
    "tune",
    "usable_cpus",
    "verify",
]
