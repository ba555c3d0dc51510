"""Load and soak: readers in random order while another process overwrites the store, again and again.

For each format, two versions of one store are built from two list files of PNGs
(same count and shape): version A's sample ``i`` is random noise seeded by ``i``,
version B's is the same image XOR 0xFF; the labels differ too (A: ``i % 4`` in
classes ``a0..a3``, B: ``(i + 1) % 4`` in classes ``b0..b3``), so the class names
a reader got at open say which version it opened. Reference pixels are read back
from reference stores of each version (so JPEG-encoded stores are compared with
their own decoded pixels), and every sample's digest maps to (version, index).

Then, for ``--seconds`` per format, four reader processes read the store in random
order while a writer process replaces it with ``convert(..., overwrite=True)`` in a
loop, every third round through the CLI (``dlstore convert --overwrite``):

=============== ============================================== ==========================
reader          reads                                           reopens
=============== ============================================== ==========================
item            ``ds[i]``, random ``i``                         every 300 reads
batch           ``ds.get_batch(random indices)``                only after an error
loader-threads  ``dlstore.loader(shuffle=True, backend="threads", num_threads=2)``     every 2 epochs
loader-workers  ``dlstore.loader(shuffle=True, num_workers=1)`` every epoch
=============== ============================================== ==========================

(the ``batch`` reader opens with ``check="sample"``, the others with no check).
Every sample a reader gets is checked entirely: its pixels must be sample ``i`` of
A or B (``wrong`` otherwise: damaged pixels, another index, a wrong label), and
every sample of a batch must come from the version the reader opened (``mixed``
otherwise: a batch of A and B, or pixels of one store beside the manifest and
labels of another). A ``DlstoreError`` is an allowed outcome (the store was
replaced, or is missing between the two renames): counted by kind, then the
reader opens the store again. Any other exception, a reader or writer that dies
or exits non-zero, or one that makes no progress for ``--hang-seconds`` (its
stack is dumped, then it is killed) is a failure; so is a soak during which no
overwrite completed. Exit code 1 on any failure.

The versions follow ``--pattern`` (default ``ABBA``, repeated: A, B, B, A, A, B, ...),
not strict alternation: a store's folder or file gets a fresh inode, but ext4 hands
a freed inode out again at once, so the store written two rounds later typically
has the inode of the one a reader opened. With ``ABBA`` that store always holds
the other version, so a mix across it shows in the pixels (with ``AB`` it would
hold the same pixels and hide it).

    python benchmarks/soak.py [--seconds 20] [--formats shards,lmdb,hdf5,lmdb-jpeg] [--images 256]
                              [--out benchmarks/results/soak.json]
"""

from __future__ import annotations

import argparse
import csv
import faulthandler
import gc
import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, uptime, write_json  # noqa: E402

import dlstore  # noqa: E402
from dlstore.errors import DlstoreError  # noqa: E402

# name -> (store suffix, convert options); shards in many small files, so readers open files as they go
FORMATS = {
    "shards": (".shards", {}),
    "lmdb": (".lmdb", {}),
    "hdf5": (".h5", {}),
    "lmdb-jpeg": (".lmdb", {"encoding": "jpeg"}),
}
READERS = ("item", "batch", "loader-threads", "loader-workers")
CLASSES = 4
SIZE = 32
BATCH = 32
STATIC = f"center_crop={SIZE}"
CLI_EVERY = 8     # rounds 3, 11, 19, ... run `dlstore convert --overwrite` (a few seconds: the imports)
PAUSE_S = 0.1     # between two overwrites


def _labels(version: str, n: int) -> np.ndarray:
    i = np.arange(n)
    return i % CLASSES if version == "A" else (i + 1) % CLASSES


def make_sources(root: Path, n: int) -> dict[str, Path]:
    """PNGs of both versions and one list file per version: {"A": a.csv, "B": b.csv}."""
    lists = {}
    for version in "AB":
        folder = root / version.lower()
        folder.mkdir(parents=True)
        labels = _labels(version, n)
        rows = []
        for i in range(n):
            pixels = np.random.default_rng(i).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
            if version == "B":
                pixels ^= 0xFF
            Image.fromarray(pixels).save(folder / f"{i:05d}.png")
            rows.append((f"{version.lower()}/{i:05d}.png", f"{version.lower()}{labels[i]}"))
        lists[version] = root / f"{version.lower()}.csv"
        with open(lists[version], "w", newline="") as f:
            csv.writer(f).writerows(rows)
    return lists


def _options(fmt: str, n: int) -> dict:
    options = dict(FORMATS[fmt][1])
    if fmt == "shards":
        options["shard_size"] = max(1, n // 12) * 3 * SIZE * SIZE   # ~12 data files
    return options


def _digest(sample) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(sample).tobytes(), digest_size=16).digest()


def references(fmt: str, lists: dict[str, Path], work: Path, n: int) -> dict:
    """Every sample of both versions as the format reads it back: digest -> (version, index)."""
    lookup, classes = {}, {}
    for version, src in lists.items():
        path = work / f"ref-{version}{FORMATS[fmt][0]}"
        dlstore.convert(src, path, static=STATIC, workers=0, progress=False, **_options(fmt, n))
        ds = dlstore.open_dataset(path)
        images, labels = ds.read_batch(np.arange(n))
        if not np.array_equal(labels.numpy(), _labels(version, n)):
            raise RuntimeError(f"{path}: labels differ from the list file")
        for i in range(n):
            lookup[_digest(images[i].numpy())] = (version, i)
        classes[tuple(ds.classes)] = version
        del ds
    if len(lookup) != 2 * n:
        raise RuntimeError(f"{fmt}: {2 * n - len(lookup)} samples are not told apart by their pixels")
    return {"lookup": lookup, "classes": classes, "labels": {v: _labels(v, n).tolist() for v in "AB"}}


# --- readers ---------------------------------------------------------------------------------

def _error_kind(exc: BaseException) -> str:
    text = str(exc)
    for words, kind in (("was replaced", "replaced"), ("no such store", "no such store"),
                        ("crc32", "checksum"), ("sha256", "checksum"), ("does not exist", "missing"),
                        ("missing", "missing")):
        if words in text.lower():
            return f"{type(exc).__name__}: {kind}"
    return f"{type(exc).__name__}: {text[:80]}"


class _Checker:
    """Checks batches against the references; counts what it saw."""

    def __init__(self, ref: dict):
        self.ref = ref
        self.stats = {"reads": 0, "batches": 0, "seen": {"A": 0, "B": 0}, "mixed": 0, "wrong": 0, "opens": 0,
                      "errors": Counter(), "unexpected": Counter(), "examples": []}

    def note(self, kind: str, text: str) -> None:
        if len(self.stats["examples"]) < 5:
            self.stats["examples"].append(f"{kind}: {text}")

    def check(self, images, labels, opened: str, indices=None) -> None:
        versions = set()
        labels = [int(v) for v in labels]
        for b in range(len(images)):
            hit = self.ref["lookup"].get(_digest(images[b].numpy()))
            if hit is None:
                self.stats["wrong"] += 1
                self.note("wrong", f"pixels of no sample of A or B (index {None if indices is None else indices[b]})")
                continue
            version, i = hit
            versions.add(version)
            self.stats["seen"][version] += 1
            if indices is not None and i != int(indices[b]):
                self.stats["wrong"] += 1
                self.note("wrong", f"asked for sample {int(indices[b])}, got sample {i} of {version}")
            elif version == opened and labels[b] != self.ref["labels"][opened][i]:
                self.stats["wrong"] += 1
                self.note("wrong", f"sample {i} of {version}: label {labels[b]}, expected "
                                   f"{self.ref['labels'][opened][i]}")
        if versions - {opened}:
            self.stats["mixed"] += 1
            self.note("mixed", f"opened {opened} (manifest and labels), got pixels of {sorted(versions)} in a "
                               f"batch of {len(images)}")
        self.stats["reads"] += len(images)
        self.stats["batches"] += 1


def _reader(k: int, kind: str, path: str, ref: dict, progress, stop, out: str, loader_options: dict) -> None:
    stack_file = open(out + ".stack", "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    import torch

    torch.set_num_threads(1)
    checker = _Checker(ref)
    rng = np.random.default_rng(k)
    ds = None
    opened = None
    reads_since_open = epochs = 0
    start = time.monotonic()
    while not stop.is_set():
        try:
            if ds is None:
                ds = dlstore.open_dataset(path, check="sample" if kind == "batch" else "none")
                opened = ref["classes"].get(tuple(ds.classes))
                checker.stats["opens"] += 1
                reads_since_open = epochs = 0
                if opened is None:
                    checker.stats["wrong"] += 1
                    checker.note("wrong", f"classes {ds.classes} are neither version's")
                    ds = None
                    continue
            n = len(ds)
            if kind == "item":
                i = int(rng.integers(n))
                image, label = ds[i]
                checker.check(image[None], [label], opened, [i])
                reads_since_open += 1
                if reads_since_open >= 300:
                    ds = None
            elif kind == "batch":
                idx = rng.choice(n, BATCH, replace=False)
                images, labels = ds.get_batch(idx)
                checker.check(images, labels, opened, idx)
            else:
                if kind == "loader-threads":
                    batches = dlstore.loader(ds, BATCH, shuffle=True, backend="threads", num_threads=2)
                else:
                    batches = dlstore.loader(ds, BATCH, shuffle=True, num_workers=1, backend="dataloader",
                                             multiprocessing_context="fork", **loader_options)
                for images, labels in batches:
                    checker.check(images, labels, opened)
                    progress[k] = time.monotonic()
                    if stop.is_set():
                        break
                del batches
                epochs += 1
                if epochs >= (2 if kind == "loader-threads" else 4):   # workers open the store at each epoch
                    ds = None
        except DlstoreError as exc:
            checker.stats["errors"][_error_kind(exc)] += 1
            ds = None
            failed = True
        except Exception as exc:  # noqa: BLE001 - anything but a DlstoreError is a failure, counted and shown
            checker.stats["unexpected"][f"{type(exc).__name__}: {str(exc)[:120]}"] += 1
            checker.note("unexpected", traceback.format_exc(limit=6))
            ds = None
            failed = True
        else:
            failed = False
        if failed and kind.startswith("loader"):
            batches = None
            gc.collect()   # a failed loader's iterator (in a cycle) goes now, not in a worker forked later
        progress[k] = time.monotonic()
    stats = checker.stats
    stats["seconds"] = time.monotonic() - start
    stats["errors"], stats["unexpected"] = dict(stats["errors"]), dict(stats["unexpected"])
    write_json(out, stats)


# --- the writer ------------------------------------------------------------------------------

def _writer(fmt: str, lists: dict[str, Path], root: Path, dst: str, n: int, pattern: str, done, stop,
            out: str) -> None:
    faulthandler.register(signal.SIGUSR1, file=open(out + ".stack", "w"), all_threads=True)
    options = _options(fmt, n)
    rounds = []
    r = 1
    while not stop.is_set():
        version = pattern[r % len(pattern)]
        cli = r % CLI_EVERY == 3
        start = time.monotonic()
        entry = {"round": r, "version": version, "method": "cli" if cli else "python", "start": start}
        try:
            if cli:
                cmd = [sys.executable, "-m", "dlstore", "convert", str(lists[version]), dst, "--root", str(root),
                       "--static", STATIC, "--workers", "0", "--overwrite", "--quiet"]
                if "shard_size" in options:
                    cmd += ["--shard-size", str(options["shard_size"])]
                if "encoding" in options:
                    cmd += ["--encoding", options["encoding"]]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if proc.returncode != 0:
                    entry["error"] = f"exit code {proc.returncode}: {proc.stderr.strip()[-500:]}"
            else:
                dlstore.convert(lists[version], dst, root=root, static=STATIC, workers=0, overwrite=True,
                                progress=False, **options)
        except Exception as exc:  # noqa: BLE001 - a failed overwrite is a failure of the soak, reported
            entry["error"] = f"{type(exc).__name__}: {exc}"
        entry["seconds"] = time.monotonic() - start
        rounds.append(entry)
        if "error" not in entry:
            with done.get_lock():
                done.value += 1
        r += 1
        stop.wait(PAUSE_S)                          # readers read between two replacements
    write_json(out, {"rounds": rounds})


# --- one format --------------------------------------------------------------------------------

def soak(fmt: str, work: Path, lists: dict[str, Path], *, n: int, seconds: float, hang_seconds: float,
         pattern: str, loader_workers: str = "auto") -> dict:
    """Readers against a store being overwritten, for ``seconds``; the counts and the failures.

    ``loader_workers``: "auto" reads with ``dlstore.loader``'s own choice for ``num_workers=1``;
    "dataloader" forces the torch DataLoader (``backend="dataloader"``).
    """
    loader_options = {"backend": "dataloader"} if loader_workers == "dataloader" else {}
    ref = references(fmt, lists, work, n)
    dst = str(work / f"soak-{fmt}{FORMATS[fmt][0]}")
    dlstore.convert(lists[pattern[0]], dst, root=lists["A"].parent, static=STATIC, workers=0, progress=False,
                    **_options(fmt, n))
    ctx = mp.get_context("fork")   # nothing of the store is open here: the references are closed
    progress = ctx.Array("d", [0.0] * len(READERS), lock=False)
    done = ctx.Value("i", 0)
    stop = ctx.Event()
    outs = [str(work / f"{fmt}-reader-{k}.json") for k in range(len(READERS))]
    readers = [ctx.Process(target=_reader, args=(k, kind, dst, ref, progress, stop, outs[k],
                                                             loader_options))
               for k, kind in enumerate(READERS)]
    for p in readers:
        p.start()
    writer_out = str(work / f"{fmt}-writer.json")
    writer = ctx.Process(target=_writer, args=(fmt, lists, lists["A"].parent, dst, n, pattern, done, stop,
                                               writer_out))
    hangs = {}
    began = time.monotonic()
    while time.monotonic() - began < hang_seconds and not all(progress[k] > 0 or not readers[k].is_alive()
                                                              for k in range(len(READERS))):
        time.sleep(0.1)                             # every reader has read once: now overwrite
    started = time.monotonic()
    writer.start()
    deadline = started + seconds
    while True:
        now = time.monotonic()
        for k, p in enumerate(readers):
            if p.is_alive() and k not in hangs and now - max(progress[k], began) > hang_seconds:
                hangs[k] = f"hang: no progress for {now - max(progress[k], began):.0f} s"
                os.kill(p.pid, signal.SIGUSR1)     # its stack, to <out>.stack
                time.sleep(1)
                p.kill()
        # at least two overwrites while the readers run, however slow the machine (bounded)
        if now >= deadline and (done.value >= 2 or now >= deadline + 120):
            break
        if not any(p.is_alive() for p in readers):
            break
        time.sleep(0.2)
    overwrites_during_reads = done.value
    stop.set()
    reads_end = time.monotonic()
    for k, p in enumerate(readers):
        p.join(timeout=hang_seconds)
        if p.is_alive():
            hangs[k] = f"hang: did not stop within {hang_seconds:.0f} s"
            os.kill(p.pid, signal.SIGUSR1)
            time.sleep(1)
            p.kill()
            p.join()
    writer.join(timeout=300)
    writer_hang = writer.is_alive()
    if writer_hang:
        os.kill(writer.pid, signal.SIGUSR1)
        time.sleep(1)
        writer.kill()
        writer.join()

    failures = []
    result = {"format": fmt, "images": n, "seconds": reads_end - started, "readers": {},
              "overwrites_during_reads": overwrites_during_reads}
    for k, kind in enumerate(READERS):
        p = readers[k]
        stats = _read_json(outs[k])
        stack = _read_text(outs[k] + ".stack")
        if stats is None:
            stats = {"reads": 0, "batches": 0, "seen": {"A": 0, "B": 0}, "mixed": 0, "wrong": 0, "errors": {},
                     "unexpected": {}, "examples": [], "opens": 0, "seconds": 0.0}
        crash = hangs.get(k)
        if crash is None and p.exitcode != 0:
            crash = f"exit code {p.exitcode}" + (f" (signal {-p.exitcode})" if p.exitcode < 0 else "")
        stats["crash"] = crash
        if stack:
            stats["stack"] = stack
        stats["samples_per_s"] = stats["reads"] / stats["seconds"] if stats["seconds"] else 0.0
        result["readers"][kind] = stats
        for what in ("mixed", "wrong"):
            if stats[what]:
                failures.append(f"{kind}: {stats[what]} {what}")
        for text, count in stats["unexpected"].items():
            failures.append(f"{kind}: {count}x unexpected {text}")
        if crash:
            failures.append(f"{kind}: {crash}" + (f"\n{stack}" if stack else ""))
    rounds = (_read_json(writer_out) or {}).get("rounds", [])
    for entry in rounds:
        entry["start"] -= started
    result["writer"] = {"rounds": rounds, "exitcode": writer.exitcode, "hang": writer_hang}
    for entry in rounds:
        if "error" in entry:
            failures.append(f"writer round {entry['round']} ({entry['method']}): {entry['error']}")
    if writer_hang or writer.exitcode != 0:
        failures.append(f"writer: {'hang' if writer_hang else f'exit code {writer.exitcode}'}")
    if overwrites_during_reads == 0:
        failures.append("no overwrite completed while the readers ran: nothing was tested")
    result["failures"] = failures
    return result


def _read_json(path: str) -> dict | None:
    import json

    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def print_table(result: dict, log=print) -> None:
    rounds = result["writer"]["rounds"]
    ok = [r for r in rounds if "error" not in r]
    methods = Counter(r["method"] for r in ok)
    mean = sum(r["seconds"] for r in ok) / len(ok) if ok else 0.0
    log(f"\n{result['format']}: {result['images']} samples of 3x{SIZE}x{SIZE}, {result['seconds']:.1f} s of reads, "
        f"{len(ok)} overwrites ({methods['python']} convert(), {methods['cli']} CLI; "
        f"{len(rounds) - len(ok)} failed; {mean:.2f} s each), {result['overwrites_during_reads']} "
        f"done while the readers ran")
    log(f"{'reader':15} {'reads':>7} {'batches':>7} {'A':>6} {'B':>6} {'opens':>5} {'clear err':>9} "
        f"{'mixed':>5} {'wrong':>5} {'other':>5} {'crash':>5} {'samples/s':>9}")
    errors = Counter()
    for kind, s in result["readers"].items():
        errors.update({f"{kind}: {k}": v for k, v in s["errors"].items()})
        log(f"{kind:15} {s['reads']:7,} {s['batches']:7,} {s['seen']['A']:6,} {s['seen']['B']:6,} {s['opens']:5} "
            f"{sum(s['errors'].values()):9} {s['mixed']:5} {s['wrong']:5} {sum(s['unexpected'].values()):5} "
            f"{int(bool(s['crash'])):5} {s['samples_per_s']:9,.0f}")
    for text, count in sorted(errors.items()):
        log(f"  clear error  {count:5}x {text}")
    for failure in result["failures"]:
        log(f"  FAILURE  {failure}")
    for kind, s in result["readers"].items():
        for example in s["examples"]:
            log(f"  {kind}: {example}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="reading time per format")
    parser.add_argument("--formats", default="shards,lmdb,hdf5,lmdb-jpeg")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--hang-seconds", type=float, default=30.0)
    parser.add_argument("--pattern", default="ABBA", help="versions of successive stores, repeated")
    parser.add_argument("--loader-workers", choices=("auto", "dataloader"), default="auto",
                        help="the loader-workers reader: dlstore.loader's choice, or the torch DataLoader")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "soak.json"))
    args = parser.parse_args(argv)
    fmts = args.formats.split(",")
    unknown = sorted(set(fmts) - set(FORMATS))
    if unknown or set(args.pattern) != {"A", "B"}:
        parser.error(f"formats: {', '.join(FORMATS)} (got {unknown}); pattern: A and B only, both")

    load_before = uptime()
    results = {}
    with tempfile.TemporaryDirectory(prefix="dlstore-soak-") as tmp:
        tmp = Path(tmp)
        lists = make_sources(tmp / "src", args.images)
        for fmt in fmts:
            work = tmp / fmt
            work.mkdir()
            results[fmt] = soak(fmt, work, lists, n=args.images, seconds=args.seconds,
                                hang_seconds=args.hang_seconds, pattern=args.pattern,
                                loader_workers=args.loader_workers)
            print_table(results[fmt])
    load_after = uptime()
    failed = [f"{fmt}: {f}" for fmt, r in results.items() for f in r["failures"]]
    print(f"\nuptime before: {load_before}")
    print(f"uptime after:  {load_after}")
    print(f"verdict: {'FAIL, ' + str(len(failed)) + ' failure(s)' if failed else 'OK'} "
          "(mixed, wrong, other exceptions, crashes, hangs, failed overwrites)")
    if args.out:
        path = write_json(args.out, {"machine": machine_info(), "images": args.images, "seconds": args.seconds,
                                     "pattern": args.pattern, "loader_workers": args.loader_workers,
                                     "readers": list(READERS), "batch": BATCH,
                                     "uptime_before": load_before, "uptime_after": load_after,
                                     "ok": not failed, "failures": failed, "results": results})
        print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
