"""Reading stores: the map-style datasets, the batch loader, the GPU-resident dataset."""

from .dataset import HDF5Dataset, LMDBDataset, ShardsDataset, StoreDataset, open_dataset
from .gpu.dataset import GPUDataset
from .gpu.loader import GPULoader
from .loaders.factory import loader

__all__ = ["GPUDataset", "GPULoader", "HDF5Dataset", "LMDBDataset", "ShardsDataset", "StoreDataset", "loader",
           "open_dataset"]
