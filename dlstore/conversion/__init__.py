"""Source -> store.

* ``job``: one conversion job (what to decode, how to feed a Writer, the manifest);
* ``pool``: decoding in worker processes, in order, with a bounded window in flight;
* ``local``: ``convert`` itself: checks, the run;
* ``checkpoint``: what an interrupted run keeps for ``--resume``, and how a resume checks it;
* ``distributed``: every rank of a process group converts a part, rank 0 assembles;
* ``destination``: the staging path, what may be replaced, the atomic publish;
* ``lock``: one conversion to a destination at a time, released with its holder;
* ``journal``: the prints of the source files converted, which a resume checks.

Imports point one way: local -> checkpoint, distributed -> job -> pool -> journal, and each of them ->
destination, lock.
"""

from .job import ConvertResult
from .local import convert

__all__ = ["ConvertResult", "convert"]
