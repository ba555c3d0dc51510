"""Decoding in a pool of processes: ordered chunks, a bounded window in flight, a dead worker noticed.

The workers die with the process that started them (``dlstore.processes``: the kernel's
parent-death signal, and a thread that checks for the parent while the worker waits for a
task), so a conversion killed by SIGKILL, the OOM killer or an unhandled SIGTERM leaves no
process behind holding its lock, its files or its caller's pipes.
"""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
import pickle
import signal
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np

from ..errors import ConversionInterrupted, DecodeError, SourceError
from ..formats.encoding import encode
from ..formats.fields import RecordFields
from ..processes import Parent, parent_spec, watch
from ..sources.decode import pil_loader
from ..transforms.joint_static import apply_static_pair
from ..transforms.static import StaticSpec, apply_static_any
from .journal import fileprint

CHUNK = 8  # items per task: amortises inter-process overhead, keeps ordering latency low
CHUNK_IN_MEMORY = 64  # an in-memory item (dataset, array) costs far less than a file: bigger tasks


# --- decoding, in worker processes -------------------------------------------------------

# The item loader of this worker process (a source's ``loader(decode)``) and the function giving
# an item's file(s) to print (a file source's, ``journal.printed_files``; else None), set once by the pool's initializer: with
# ``fork`` they are inherited, not pickled, so a dataset is never copied per task.
_LOADER: Callable[[Any], tuple[Any, int]] | None = None
_WHERE: Callable[[Any], str] | None = None

Result = tuple[tuple[np.ndarray, int] | str, list[Any] | None]   # (record and label, or why not; file print)


def _init_worker(loader: Callable[[Any], tuple[Any, int]] | None, where: Callable[[Any], str] | None,
                 parent: tuple[int | None, bool]) -> None:
    global _LOADER, _WHERE
    watching = Parent(parent)    # (sets the parent-death signal first: a parent gone before shows below)
    if not watching.alive():
        os._exit(1)
    watch(watching)
    _LOADER, _WHERE = loader, where
    # Ctrl-C goes to the whole process group; the parent handles it and stops the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forked worker inherits the parent's Python SIGTERM handler (the CLI's); the pool stops
    # broken workers with SIGTERM, which must kill them, not raise inside them.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def decode_sample(path: str, spec: StaticSpec, decode: dict[str, Any] | None = None,
                  codec: tuple[str, int] = ("raw", 0)) -> np.ndarray:
    """Decode one file and apply the static spec: the stored uint8 CHW array.

    ``decode`` holds ``pil_loader`` options (``exif_transpose``, ``max_pixels``);
    ``codec`` is (encoding, quality): for "jpeg"/"png" the result is the encoded
    record (see dlstore.codecs).
    """
    return _process(pil_loader(path, **(decode or {})), path, spec, codec)


def _process(image: Any, where: str, spec: StaticSpec, codec: tuple[str, int]) -> np.ndarray:
    try:
        sample = apply_static_any(image, spec)
    except (OSError, ValueError, RuntimeError, TypeError) as exc:
        raise DecodeError(where, f"static transform failed ({type(exc).__name__}: {exc})") from exc
    encoding, quality = codec
    return sample if encoding == "raw" else encode(sample, encoding, quality=quality)


def _process_pair(image: Any, mask: np.ndarray, where: str, spec: StaticSpec, fields: RecordFields) -> np.ndarray:
    """The record of an image and its mask: both through the static stage as v2 runs it on
    ``(Image, Mask)``, the mask's planes after the image's channels (``formats.fields``)."""
    try:
        image, mask = apply_static_pair(image, mask, spec)
    except (OSError, ValueError, RuntimeError, TypeError) as exc:
        raise DecodeError(where, f"static transform failed ({type(exc).__name__}: {exc})") from exc
    top = int(mask.max()) if mask.size else 0
    if top > fields.mask_max():
        raise SourceError(f"{where}: its mask holds class {top}, which the store's {fields.mask_dtype} masks cannot "
                          "hold; convert with mask_dtype=\"uint16\" (--mask-dtype uint16)")
    return fields.pack(np.asarray(image), mask)


def _decode_chunk(keys: list[Any], spec: StaticSpec, codec: tuple[str, int],
                  loader: Callable[[Any], tuple[Any, int]] | None = None,
                  where: Callable[[Any], str] | None = None, fields: RecordFields | None = None) -> list[Result]:
    """Per item: (record, label), or the error text where it failed (the parent decides), and the
    print of its file (``journal.fileprint``, taken before the file is read; None without a file).
    With ``fields``, items are (image, mask) pairs, stored as one record with label -1."""
    load, where = loader or _LOADER, where or _WHERE
    out: list[Result] = []
    for key in keys:
        printed = None if where is None else fileprint(where(key))
        try:
            if fields is not None:
                image, mask = load(key)
                named = f"{key[1]} (the mask of {key[0]})" if isinstance(key, tuple) else f"item {key}"
                out.append(((_process_pair(image, mask, named, spec, fields), -1), printed))
                continue
            image, label = load(key)
            out.append(((_process(image, str(key), spec, codec), label), printed))
        except DecodeError as exc:
            out.append((exc.reason, printed))
    return out


def _mp_context() -> multiprocessing.context.BaseContext:
    # fork starts workers in milliseconds and shares the imported torchvision; spawn elsewhere.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def usable_workers(loader: Any, workers: int, log: Callable[[str], None]) -> int:
    """``workers``, or 0 when the loader cannot reach worker processes (with a warning).

    Workers started by ``fork`` inherit the loader; by ``spawn`` they get a pickled copy,
    and a dataset holding a lambda or an open file cannot be pickled: such a source is
    decoded in this process instead of failing (or hanging) in the pool.
    """
    if workers <= 1 or _mp_context().get_start_method() == "fork":
        return workers
    try:
        pickle.dumps(loader)
    except Exception as exc:  # noqa: BLE001 - pickling user objects fails in many ways
        log(f"warning: the source cannot be sent to worker processes ({type(exc).__name__}: {exc}); "
            "decoding in this process instead (workers=0). Make the dataset picklable to use workers.")
        return 0
    return workers


def decode_in_order(keys: Iterable[Any], loader: Callable[[Any], tuple[Any, int]], spec: StaticSpec,
                    codec: tuple[str, int], workers: int, chunk_size: int = CHUNK,
                    where: Callable[[Any], str] | None = None,
                    fields: RecordFields | None = None) -> Iterator[Result]:
    """Yield load + static results, with their files' prints where ``where`` gives each item's file,
    in the order of ``keys`` (consumed lazily: no list of all chunks); ``fields``: items are
    (image, mask) pairs stored as one record (``_process_pair``)."""
    source = iter(keys)
    chunks = iter(lambda: list(itertools.islice(source, chunk_size)), [])
    # Import the decode-side torchvision kernels once here: forked workers share them instead
    # of each paying the import (seconds) on its first file.
    import torchvision.transforms.v2.functional  # noqa: F401
    if workers <= 1:
        for chunk in chunks:
            yield from _decode_chunk(chunk, spec, codec, loader, where, fields)
        return
    window = 4 * workers
    ctx = _mp_context()
    # (the workers start in this thread, at the first submit: the parent-death signal is tied to it)
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                               initargs=(loader, where, parent_spec(ctx)))
    pending: collections.deque = collections.deque()
    broken = False
    try:
        todo = iter(chunks)
        for chunk in todo:
            pending.append(pool.submit(_decode_chunk, chunk, spec, codec, fields=fields))
            if len(pending) >= window:
                break
        while pending:
            results = _result(pending.popleft(), pool)
            next_chunk = next(todo, None)
            if next_chunk is not None:
                pending.append(pool.submit(_decode_chunk, next_chunk, spec, codec, fields=fields))
            yield from results
    except BrokenProcessPool as exc:
        broken = True
        raise ConversionInterrupted(
            "a decode worker process died (killed, or out of memory); nothing was written to the "
            "destination") from exc
    finally:
        for fut in pending:
            fut.cancel()
        if broken:
            _abandon(pool)
        else:
            # (the caller closes this generator in its own thread: a finaliser in the pool's
            # manager thread could not wait for that thread)
            pool.shutdown(wait=True, cancel_futures=True)


def _result(future: Any, pool: ProcessPoolExecutor) -> list[Result]:
    """``future.result()``, but a dead worker is noticed even when the pool does not notice.

    CPython's pool can block for ever when a worker is killed in the middle of sending a
    result (its manager thread waits for the rest of the message); so wait in slices and
    check the workers' exit codes in between.
    """
    while True:
        try:
            return future.result(timeout=2.0)
        except FuturesTimeout:
            workers = list(getattr(pool, "_processes", {}).values())
            if any(p.exitcode is not None for p in workers):
                raise BrokenProcessPool("a worker process exited while its task was pending") from None


def _abandon(pool: ProcessPoolExecutor) -> None:
    """Stop a broken pool without waiting on anything a dead worker left half-done."""
    for process in list(getattr(pool, "_processes", {}).values()):
        process.kill()
    # With every worker gone, closing our copy of the result pipe's write end gives a manager
    # thread stuck on a half-sent result EOF, so it can finish and be joined.
    writer = getattr(getattr(pool, "_result_queue", None), "_writer", None)
    if writer is not None:
        writer.close()
    pool.shutdown(wait=True, cancel_futures=True)
