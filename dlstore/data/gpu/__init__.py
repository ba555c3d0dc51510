"""A store resident in device memory: ``GPUDataset`` (``dataset.py``), preloaded in chunks
(``preload.py``) through its conversion (``convert.py``) and held padding (``padding.py``),
a rank's share of it (``partition.py``), and the transform steps its loader runs
(``steps.py``), which can run as one gather (``fused.py``). The loader's back-end
(``loaders/resident.py``) names the dataset through the ``Resident`` protocol (``resident.py``)."""

from .dataset import GPUDataset

__all__ = ["GPUDataset"]
