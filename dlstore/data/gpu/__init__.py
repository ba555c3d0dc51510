"""A store resident in device memory: ``GPUDataset`` (``dataset.py``), preloaded in chunks
(``preload.py``) through its conversion (``convert.py``) and held padding (``padding.py``),
a rank's share of it (``partition.py``), and its loader (``loader.py``), whose transform
steps (``steps.py``) can run as one gather (``fused.py``). The loader's side names the
dataset through the ``Resident`` protocol (``resident.py``), so neither imports the other."""

from .dataset import GPUDataset
from .loader import GPULoader

__all__ = ["GPUDataset", "GPULoader"]
