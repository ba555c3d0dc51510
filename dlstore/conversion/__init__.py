"""Source -> store.

* ``job``: one conversion job (what to decode, how to feed a Writer, the manifest);
* ``pool``: decoding in worker processes, in order, with a bounded window in flight;
* ``local``: ``convert`` itself: destination checks, lock, resume, publish;
* ``distributed``: every rank of a process group converts a part, rank 0 assembles.

Imports point one way: local -> distributed -> job -> pool.
"""

from .job import ConvertResult
from .local import convert

__all__ = ["ConvertResult", "convert"]
