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
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import formats
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
    count: int = 0
    checked: list[str] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, where: str, message: str) -> None:
        self.problems.append((where, message))

    def __str__(self) -> str:
        lines = [f"{self.path}: {self.format or 'unknown format'}, {self.count} samples"]
        lines += [f"  ok       {c}" for c in self.checked]
        lines += [f"  PROBLEM  {where}: {message}" for where, message in self.problems]
        lines.append("verdict: OK" if self.ok else f"verdict: {len(self.problems)} problem(s)")
        return "\n".join(lines)


def verify(path: str | os.PathLike, *, deep: bool = False) -> VerifyReport:
    """Check the store at ``path``; never raises for a damaged store, reports instead."""
    report = VerifyReport(Path(path))
    try:
        report.format = formats.detect_format(path)
        module = formats.get_format(report.format)
    except (DlstoreError, OSError, ValueError) as exc:
        report.problem("open", str(exc))
        return report
    if not _check_seal(module, Path(path), report):
        # A file that is not what was written may crash or hang LMDB/HDF5 (both seen with
        # damaged metadata pages): it is reported, not handed to the library.
        report.problem("open", f"{path}: not opened: the data file differs from its seal, and LMDB/HDF5 may "
                               "crash or hang on damaged pages; convert again or restore a copy")
        return report
    if hasattr(module, "check_manifest_seal"):   # shards: the manifest is the one file without a digest in it
        _check_seal_of(module.check_manifest_seal(path), report)
    try:
        reader = module.Reader(Path(path))
    except (DlstoreError, OSError, ValueError) as exc:
        report.problem("open", str(exc))
        return report
    manifest = reader.manifest
    report.count = manifest["count"]
    _enable_sums(reader, manifest, report)
    _check_labels(reader, manifest, report)
    _check_targets(reader, manifest, report)
    if report.format == "shards":
        _check_files(Path(path), manifest, report)
        if deep:
            _check_samples(reader, manifest, report, digest=False, decode=True)
    else:
        _check_samples(reader, manifest, report, digest=True, decode=deep)
    return report


def _check_seal(module: Any, path: Path, report: VerifyReport) -> bool:
    """LMDB/HDF5: the whole data file against its seal (bytes no sample checksum covers).

    False if the file differs from its seal."""
    if not hasattr(module, "check_seal"):
        return True
    return _check_seal_of(module.check_seal(path), report)


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


def _enable_sums(reader: Any, manifest: dict[str, Any], report: VerifyReport) -> None:
    """Check each sample read below against its recorded CRC32 (stores that have the sums)."""
    if "sample_sums" not in manifest["layout"]:
        report.checked.append("per-sample CRC32: none (converted before dlstore recorded them)")
        return
    try:
        reader.enable_sample_check()
    except (DlstoreError, OSError, ValueError) as exc:
        report.problem("sample sums", str(exc))
        return
    if report.format != "shards":   # shards: crc32.npy is one of the files whose sha256 is checked
        digest = hashlib.sha256(np.asarray(reader.sums.sums, dtype="<u4").tobytes()).hexdigest()
        if manifest["checksums"]["files"].get("crc32") != digest:
            report.problem("crc32", "sha256 mismatch: the per-sample sums changed since conversion")


def _check_targets(reader: Any, manifest: dict[str, Any], report: VerifyReport) -> None:
    """Target vectors (LMDB, HDF5) against the sha256 recorded at conversion; shards: targets.npy is
    one of the files whose sha256 is checked."""
    targets = getattr(reader, "targets", None)
    if targets is None or "targets" not in manifest:
        return
    if report.format == "shards":
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
                   decode: bool) -> None:
    """Read every sample; check its shape; recompute the per-record checksums if asked.

    With ``decode``, encoded (JPEG/PNG) samples are also decoded and their shape checked.
    """
    shape = manifest["sample"]["shape"]
    encoded = manifest["sample"]["encoding"] != "raw"
    decoded_shape = manifest["sample"].get("decoded_shape")
    samples = hashlib.sha256()
    shapes = []
    bad_before = len(report.problems)
    for i in range(manifest["count"]):
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
