"""A store resident in device memory: ``GPUDataset`` (``dataset.py``), preloaded in chunks
(``preload.py``), a rank's share of it (``partition.py``), and its loader (``loader.py``),
whose crop + flip can run as one gather (``fused.py``)."""

from .dataset import GPUDataset
from .loader import GPULoader

__all__ = ["GPUDataset", "GPULoader"]
