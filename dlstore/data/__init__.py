"""Reading stores: the map-style datasets, the one Loader, the GPU-resident dataset."""

from .dataset import StoreDataset
from .gpu.dataset import GPUDataset
from .loaders.loader import Loader, loader
from .order import BlockShuffleSampler
from .stores import HDF5Dataset, LMDBDataset, ShardsDataset, open_dataset

__all__ = ["BlockShuffleSampler", "GPUDataset", "HDF5Dataset", "LMDBDataset", "Loader", "ShardsDataset",
           "StoreDataset", "loader", "open_dataset"]
