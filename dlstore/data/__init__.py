"""Reading stores: the map-style datasets, the batch loader, the GPU-resident dataset."""

from .dataset import HDF5Dataset, LMDBDataset, ShardsDataset, StoreDataset, open_dataset
from .gpu import GPUDataset
from .gpu_loader import GPULoader
from .loading import loader

__all__ = ["GPUDataset", "GPULoader", "HDF5Dataset", "LMDBDataset", "ShardsDataset", "StoreDataset", "loader",
           "open_dataset"]
