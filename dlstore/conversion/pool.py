"""Decoding in a pool of processes: ordered chunks, a bounded window in flight, a dead worker noticed."""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import signal
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np

from ..errors import ConversionInterrupted, DecodeError
from ..formats.encoding import encode
from ..sources.decode import pil_loader
from ..transforms.static import StaticSpec, apply_static

_CHUNK = 8  # files per task: amortises inter-process overhead, keeps ordering latency low


# --- decoding, in worker processes -------------------------------------------------------

def _init_worker() -> None:
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
    img = pil_loader(path, **(decode or {}))
    try:
        sample = apply_static(img, spec)
    except (OSError, ValueError) as exc:
        raise DecodeError(path, f"static transform failed ({type(exc).__name__}: {exc})") from exc
    encoding, quality = codec
    return sample if encoding == "raw" else encode(sample, encoding, quality=quality)


def _decode_chunk(paths: list[str], spec: StaticSpec, decode: dict[str, Any],
                  codec: tuple[str, int]) -> list[np.ndarray | str]:
    """Decoded arrays, or the error text for files that failed (the parent decides what to do)."""
    out: list[np.ndarray | str] = []
    for path in paths:
        try:
            out.append(decode_sample(path, spec, decode, codec))
        except DecodeError as exc:
            out.append(exc.reason)
    return out


def _mp_context() -> multiprocessing.context.BaseContext:
    # fork starts workers in milliseconds and shares the imported torchvision; spawn elsewhere.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def _decoded(paths: Iterable[str], spec: StaticSpec, decode: dict[str, Any], codec: tuple[str, int],
             workers: int) -> Iterator[np.ndarray | str]:
    """Yield decode results in the order of ``paths`` (consumed lazily: no list of all chunks)."""
    source = iter(paths)
    chunks = iter(lambda: list(itertools.islice(source, _CHUNK)), [])
    # Import the decode-side torchvision kernels once here: forked workers share them instead
    # of each paying the import (seconds) on its first file.
    import torchvision.transforms.v2.functional  # noqa: F401
    if workers <= 1:
        for chunk in chunks:
            yield from _decode_chunk(chunk, spec, decode, codec)
        return
    window = 4 * workers
    pool = ProcessPoolExecutor(workers, mp_context=_mp_context(), initializer=_init_worker)
    pending: collections.deque = collections.deque()
    broken = False
    try:
        todo = iter(chunks)
        for chunk in todo:
            pending.append(pool.submit(_decode_chunk, chunk, spec, decode, codec))
            if len(pending) >= window:
                break
        while pending:
            results = _result(pending.popleft(), pool)
            next_chunk = next(todo, None)
            if next_chunk is not None:
                pending.append(pool.submit(_decode_chunk, next_chunk, spec, decode, codec))
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
            pool.shutdown(wait=True, cancel_futures=True)


def _result(future: Any, pool: ProcessPoolExecutor) -> list[np.ndarray | str]:
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
