"""Reading stores: the map-style datasets, the batch loader, the GPU-resident dataset."""

from .dataset import StoreDataset
from .gpu.dataset import GPUDataset
from .gpu.loader import GPULoader
from .loaders.factory import loader
from .order import BlockShuffleSampler
from .stores import HDF5Dataset, LMDBDataset, ShardsDataset, open_dataset

__all__ = ["BlockShuffleSampler", "GPUDataset", "GPULoader", "HDF5Dataset", "LMDBDataset", "ShardsDataset",
           "StoreDataset", "loader", "open_dataset"]
