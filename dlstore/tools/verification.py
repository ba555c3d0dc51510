"""``dlstore verify``: check a store's manifest, data checksums and (deep) every sample.

Opening a store runs only cheap checks (manifest structure, counts, file
sizes). ``verify`` reads everything: it recomputes the checksums the
manifest records and, with ``deep``, re-reads every sample and checks its shape.
It reports every problem it finds with its location instead of stopping at the
first.

What the checksums cover (recorded by each Writer, recomputed here):

* shards: sha256 of each file named in ``checksums.files`` (shards, data files,
  ``index.npy``, ``labels.npy``);
* every format, per sample (stores that have them): the CRC32 recorded for each
  sample at conversion, checked as each sample is read (``deep`` for shards);
* LMDB / HDF5: ``samples`` = sha256 of every sample's CHW bytes in sample order,
  ``labels`` = sha256 of the int64 little-endian labels, ``shapes`` (variable
  shape stores) = sha256 of the int64 (N, 3) shapes; and the whole data file
  against its seal (``data.mdb.sha256``; the HDF5 user block), which covers
  the bytes no sample reaches (see ``formats.integrity``). The seal is checked
  before the file is handed to LMDB or HDF5.

An LMDB or HDF5 file that differs from its seal is damaged, and damaged metadata
pages can crash or hang those libraries: ``verify`` reports it without opening it.
``deep`` then reads it anyway, in a child process (killed with its parent, or when it
stops making progress), to name every sample that fails its CRC32; a crash or a
hang there is reported as such.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import formats
from ..processes import Parent, parent_spec
from ..errors import DlstoreError, StoreCorruptError
from ..formats import encoding
from ..formats.checks import safe_member
from ..formats.synced import sha256_file
from ..formats.targets import digest as targets_digest


@dataclass
class VerifyReport:
    """Result of ``verify``; ``ok`` is True when no problem was found."""

    path: Path
    format: str | None = None
    count: int | None = None   # None: the store was not opened
    checked: list[str] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, where: str, message: str) -> None:
        self.problems.append((where, message))

    def __str__(self) -> str:
        counted = "not opened" if self.count is None else f"{self.count} samples"
        lines = [f"{self.path}: {self.format or 'unknown format'}, {counted}"]
        lines += [f"  ok       {c}" for c in self.checked]
        lines += [f"  PROBLEM  {where}: {message}" for where, message in self.problems]
        lines.append("verdict: OK" if self.ok else f"verdict: {len(self.problems)} problem(s)")
        return "\n".join(lines)


def verify(path: str | os.PathLike, *, deep: bool = False) -> VerifyReport:
    """Check the store at ``path``; never raises for a damaged store, reports instead."""
    report = VerifyReport(Path(path))
    try:
        report.format = formats.detect_format(path)
        fmt = formats.get_format(report.format)
    except (DlstoreError, OSError, ValueError) as exc:
        report.problem("open", str(exc))
        return report
    if not _check_seal(fmt, Path(path), report):
        # A file that is not what was written may crash or hang LMDB/HDF5 (both seen with
        # damaged metadata pages): it is not handed to the library here; deep reads it apart.
        if deep:
            _verify_apart(Path(path), report)
        else:
            report.problem("open", f"{path}: damaged, so not opened (the data file differs from its seal, and "
                                   "LMDB/HDF5 may crash or hang on damaged pages); dlstore verify --deep reads it "
                                   "in a separate process to name the damaged samples; convert again or restore "
                                   "a copy")
        return report
    manifest_seal = fmt.check_manifest_seal(path)   # a manifest that is no part of a sealed data file
    if manifest_seal is not None:
        _check_seal_of(manifest_seal, report)
    _verify_opened(fmt, Path(path), report, deep)
    return report


def _verify_opened(fmt: Any, path: Path, report: VerifyReport, deep: bool,
                   tick: Callable[[], None] | None = None) -> None:
    """Everything after the seal: open the store, check labels, targets, files, samples."""
    try:
        reader = fmt.Reader(path)
    except (DlstoreError, OSError, ValueError) as exc:
        report.problem("open", str(exc))
        return
    manifest = reader.manifest
    report.count = manifest["count"]
    _enable_sums(reader, manifest, report, fmt)
    _check_labels(reader, manifest, report)
    _check_targets(reader, manifest, report, fmt)
    if fmt.file_checksums:
        _check_files(path, manifest, report)
        if deep:
            _check_samples(reader, manifest, report, digest=False, decode=True, tick=tick)
    else:
        _check_samples(reader, manifest, report, digest=True, decode=deep, tick=tick)


# A child reading a damaged store reports progress at least this often while it reads (every
# HEARTBEAT_S); one silent for STALL_S is hung (a hang in LMDB/HDF5 never ends), not slow: no
# single sample takes that long to read.
HEARTBEAT_S = 1.0
STALL_S = 20.0


def _verify_apart(path: Path, report: VerifyReport) -> None:
    """Run ``_verify_opened`` on a damaged store in a child process; merge what it finds, or say how it died."""
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_apart_child, args=(report.format, path, send, parent_spec(ctx)), daemon=True)
    child.start()
    send.close()
    found = None
    try:
        while found is None and receive.poll(STALL_S):
            message = receive.recv()
            if message != "reading":
                found = message
    except EOFError:   # it died before it sent its findings
        pass
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receive.close()
    if found is not None:
        report.count, checked, problems = found
        report.checked += checked
        report.problems += [tuple(p) for p in problems]
        return
    if child.exitcode == -signal.SIGKILL:
        how = f"hung (silent for {STALL_S:.0f} s, killed)"
    elif child.exitcode is not None and child.exitcode < 0:
        how = f"crashed ({signal.Signals(-child.exitcode).name})"
    else:
        how = f"failed (exit status {child.exitcode})"
    library = formats.get_format(report.format).library
    report.problem("open", f"{path}: damaged: {library} {how} reading it in a separate process, so the damaged "
                           "samples cannot be named; convert again or restore a copy")


def _apart_child(fmt: str, path: Path, send: Any, spec: tuple[int | None, bool]) -> None:
    Parent(spec)   # dies with the verifying process
    last = [time.monotonic()]

    def reading() -> None:
        if time.monotonic() - last[0] >= HEARTBEAT_S:
            send.send("reading")
            last[0] = time.monotonic()

    report = VerifyReport(path, format=fmt)
    try:
        _verify_opened(formats.get_format(fmt), path, report, deep=True, tick=reading)
    except Exception as exc:   # noqa: BLE001 - anything a damaged file makes the library raise is a finding
        report.problem("open", f"{path}: damaged: reading it raised {type(exc).__name__}: {exc}")
    send.send((report.count, report.checked, report.problems))


def _check_seal(fmt: Any, path: Path, report: VerifyReport) -> bool:
    """The whole data file against its seal (bytes no sample checksum covers), where the format
    seals one (LMDB, HDF5). False if the file differs from its seal."""
    seal = fmt.check_seal(path)
    return True if seal is None else _check_seal_of(seal, report)


def _check_seal_of(checked: tuple[Path, str | None], report: VerifyReport) -> bool:
    data, problem = checked
    if problem is None:
        report.checked.append(f"seal: sha256 of {data.name} matches")
    elif problem == "unsealed":
        report.checked.append(f"seal: none ({data.name} was written before dlstore sealed stores; "
                              "only its samples, labels and shapes are checked)")
    else:
        report.problem(str(data), problem)
        return False
    return True


def _enable_sums(reader: Any, manifest: dict[str, Any], report: VerifyReport, fmt: Any) -> None:
    """Check each sample read below against its recorded CRC32 (stores that have the sums)."""
    if "sample_sums" not in manifest["layout"]:
        report.checked.append("per-sample CRC32: none (converted before dlstore recorded them)")
        return
    try:
        reader.enable_sample_check()
    except (DlstoreError, OSError, ValueError) as exc:
        report.problem("sample sums", str(exc))
        return
    if not fmt.file_checksums:   # else the sums' file is one of the files whose sha256 is checked
        digest = hashlib.sha256(np.asarray(reader.sums.sums, dtype="<u4").tobytes()).hexdigest()
        if manifest["checksums"]["files"].get("crc32") != digest:
            report.problem("crc32", "sha256 mismatch: the per-sample sums changed since conversion")


def _check_targets(reader: Any, manifest: dict[str, Any], report: VerifyReport, fmt: Any) -> None:
    """Target vectors (LMDB, HDF5) against the sha256 recorded at conversion; a format with
    ``file_checksums`` (shards: targets.npy) has them checked with the files."""
    targets = getattr(reader, "targets", None)
    if targets is None or "targets" not in manifest:
        return
    if fmt.file_checksums:
        report.checked.append(f"targets: {targets.shape} {targets.dtype} (targets.npy checked with the files)")
        return
    expected = manifest["checksums"]["files"].get("targets")
    if expected is None:
        report.problem("targets", "the manifest records no sha256 of the target vectors")
    elif targets_digest(targets) != expected:
        report.problem("targets", "sha256 mismatch: the target vectors changed since conversion")
    else:
        report.checked.append(f"targets: sha256 of {targets.shape} {targets.dtype} matches")


def _check_labels(reader: Any, manifest: dict[str, Any], report: VerifyReport) -> None:
    labels = np.asarray(reader.labels)
    n_classes = len(manifest["classes"])
    bad = np.nonzero((labels < 0) | (labels >= n_classes))[0] if n_classes else np.nonzero(labels != -1)[0]
    if len(bad):
        report.problem(f"labels[{int(bad[0])}]",
                       f"{len(bad)} label(s) out of range for {n_classes} classes (first: {int(labels[bad[0]])})")
    else:
        report.checked.append(f"labels: {len(labels)} in range for {n_classes} classes")


def _check_files(path: Path, manifest: dict[str, Any], report: VerifyReport) -> None:
    expected = manifest["checksums"]["files"]
    bad_before = len(report.problems)
    for name, digest in sorted(expected.items()):
        try:
            member = safe_member(path, name)
            actual = sha256_file(member)
        except StoreCorruptError as exc:
            report.problem(name, str(exc))
            continue
        except OSError as exc:
            report.problem(name, f"unreadable ({exc})")
            continue
        if actual != digest:
            report.problem(name, f"sha256 mismatch: data changed since conversion (expected {digest[:16]}..., "
                                 f"got {actual[:16]}...)")
    if len(report.problems) == bad_before:
        report.checked.append(f"checksums: {len(expected)} file(s) match")



def _check_samples(reader: Any, manifest: dict[str, Any], report: VerifyReport, *, digest: bool,
                   decode: bool, tick: Callable[[], None] | None = None) -> None:
    """Read every sample; check its shape; recompute the per-record checksums if asked.

    With ``decode``, encoded (JPEG/PNG) samples are also decoded and their shape checked. ``tick``
    is called before each sample is read.
    """
    shape = manifest["sample"]["shape"]
    encoded = manifest["sample"]["encoding"] != "raw"
    decoded_shape = manifest["sample"].get("decoded_shape")
    samples = hashlib.sha256()
    shapes = []
    bad_before = len(report.problems)
    for i in range(manifest["count"]):
        if tick is not None:
            tick()
        try:
            sample = np.ascontiguousarray(reader.get(i))
        except (DlstoreError, OSError, ValueError, KeyError, IndexError) as exc:
            report.problem(f"sample {i}", f"unreadable ({exc})")
            continue
        if sample.dtype != np.uint8 or sample.ndim != 3 or (shape is not None and list(sample.shape) != shape):
            report.problem(f"sample {i}", f"holds {sample.dtype} {tuple(sample.shape)}, manifest says uint8 "
                                          f"{tuple(shape) if shape else '(C, H, W)'}")
        shapes.append(sample.shape)
        if digest:
            samples.update(memoryview(sample).cast("B"))
        if encoded and decode:
            try:
                image = encoding.decode(sample, where=f"sample {i}")
            except StoreCorruptError as exc:
                report.problem(f"sample {i}", str(exc))
                continue
            if decoded_shape is not None and list(image.shape) != decoded_shape:
                report.problem(f"sample {i}", f"decodes to {tuple(image.shape)}, manifest says {tuple(decoded_shape)}")
    if len(report.problems) == bad_before:
        what = "read back and decoded" if encoded and decode else "read back with the recorded shape"
        report.checked.append(f"samples: {manifest['count']} {what}")
    if not digest:
        return
    expected = manifest["checksums"]["files"]
    actual = {"samples": samples.hexdigest(),
              "labels": hashlib.sha256(np.asarray(reader.labels, dtype="<i8").tobytes()).hexdigest()}
    if shape is None:
        actual["shapes"] = hashlib.sha256(np.asarray(shapes, dtype="<i8").reshape(-1, 3).tobytes()).hexdigest()
    for name, value in actual.items():
        if name not in expected:
            report.problem(name, "the manifest records no checksum for it")
        elif expected[name] != value:
            report.problem(name, "sha256 mismatch: data changed since conversion")
        else:
            report.checked.append(f"checksum of {name} matches")
