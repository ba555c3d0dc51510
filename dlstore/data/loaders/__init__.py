"""``dlstore.loader`` and its :class:`~dlstore.data.loaders.loader.Loader` (``loader.py``), and the back-end
strategies behind it, one module each: loader threads (``threads.py``), worker processes writing into a
shared-memory ring (``shm_ring.py``, kept alive only while their parent lives: ``dlstore.processes``), a
torch DataLoader (``dataloader.py``), a GPUDataset's device (``resident.py``), and the device stage of
``loader(device=...)`` (``device.py``)."""

from .loader import Loader, loader

__all__ = ["Loader", "loader"]
