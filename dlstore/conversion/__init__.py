"""Source -> store.

* ``job``: one conversion job (what to decode, how to feed a Writer, the manifest);
* ``pool``: decoding in worker processes, in order, with a bounded window in flight;
* ``local``: ``convert`` itself: checks, resume, the run;
* ``distributed``: every rank of a process group converts a part, rank 0 assembles;
* ``destination``: the staging path, the lock, what may be replaced, the atomic publish.

Imports point one way: local -> distributed -> job -> pool, and each of them -> destination.
"""

from .job import ConvertResult
from .local import convert

__all__ = ["ConvertResult", "convert"]
