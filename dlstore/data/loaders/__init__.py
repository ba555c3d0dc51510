"""The back-ends of ``dlstore.loader`` (``factory.py`` picks one): loader threads
(``threads.py``), worker processes writing into a shared-memory ring (``shm_ring.py``, kept
alive only while their parent lives: ``dlstore.processes``), and the host/device stages of
``loader(device=...)`` (``device.py``)."""

from .factory import loader

__all__ = ["loader"]
