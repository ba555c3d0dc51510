"""The store's self-description: build, serialise and validate the manifest.

Every format stores the same JSON document in its native place (shards:
``manifest.json``; LMDB: key ``__dlstore__``; HDF5: root attribute ``dlstore``)::

    {
      "dlstore_manifest": 1,            # version of this document's schema
      "format": "shards",               # which Reader reads the data
      "format_version": 1,              # version of that format's on-disk layout
      "count": 1281167,                 # number of samples
      "sample": {"dtype": "uint8", "layout": "CHW", "encoding": "raw",
                 "shape": [3, 224, 224]},           # null shape: variable-shape store
                 # encoded stores ("jpeg"/"png") add "decoded_shape" and "quality"
      "classes": ["n01440764", ...],    # label i is classes[i]; [] when unlabelled (-1)
      "class_order": "imagefolder",     # only in stores of a labelled folder: the rule that ordered
                                        # its class folders, "imagefolder" (sorted names) or "natural"
                                        # (timm's); see sources.class_order. Absent: not recorded (other
                                        # sources, and folders converted before it was recorded)
      "targets": {"dtype": "float32", "shape": [K]},  # only in stores of target vectors
                                        # (N, K) int64 or float32; see formats.targets
      "fields": {"image": {...}, "mask": {...}},  # only in segmentation stores, whose records hold
                                        # the mask's planes after the image (formats.fields); their
                                        # manifests are version 2, which older dlstores refuse
      "static": [{"op": "resize", ...}], # canonical static spec that produced the samples
      "source": {"kind": "folder", "root": "/data/train", "files": 1281167,
                 "skipped": [{"path": "n01/x.JPEG", "reason": "..."}]},
                 # kind: folder | list (+ "list": the CSV/JSON-lines file) | dataset (+ "type")
                 # | arrays (+ "shape", "layout"); skipped items of datasets/arrays: {"index": i, ...}
                 # "mode": "RGB" | "L" (every image converted to it), "mode_given": bool (False:
                 # chosen, see dlstore.sources); optional: no reader needs them (the sample shape
                 # holds the channels), so a manifest without them opens too
      "checksums": {"algorithm": "sha256", "files": {"shard-00000.npy": "ab12..."}},
      "layout": {...}                   # format-specific: file list, counts, ...
                                        # "provenance": {"kind": "path" | "index", where it is kept}
    }

Provenance (where each sample came from, ``sources.origins``) is kept as plain
arrays in each format's native place: shards ``provenance-{indices | offsets,
blob}.npy``; HDF5 group ``/provenance``; LMDB keys ``__provenance_{name}__``.

Nothing in it depends on when or with how many workers the store was written,
so converting the same folder twice gives the same bytes.

Validation is cheap (no data is read) and runs on every open; checksums are
checked by ``dlstore verify``. Integer fields are range-checked before anything
uses them to size an allocation.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import StoreCorruptError
from .fields import check as check_fields

MANIFEST_VERSION = 2
PLAIN_VERSION = 1   # what a manifest without 'fields' is written as, so 0.3.0 still reads it
MAX_COUNT = 2**40  # far above any real dataset; bounds what a damaged manifest can ask for
MAX_DIM = 2**20


def make_manifest(
    *,
    format: str,
    format_version: int,
    count: int,
    shape: tuple[int, int, int] | None,
    classes: list[str],
    static: list[dict[str, Any]],
    source: dict[str, Any],
    checksums: dict[str, str],
    layout: dict[str, Any],
    encoding: str = "raw",
    decoded_shape: tuple[int, int, int] | None = None,
    quality: int | None = None,
    targets: dict[str, Any] | None = None,
    class_order: str | None = None,
    fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A manifest (``dumps`` writes it): one keyword per field it records, hence many."""
    sample: dict[str, Any] = {"dtype": "uint8", "layout": "CHW", "encoding": encoding,
                              "shape": None if shape is None else list(shape)}
    if encoding != "raw":
        sample["decoded_shape"] = None if decoded_shape is None else list(decoded_shape)
        sample["quality"] = quality
    manifest = {
        "dlstore_manifest": PLAIN_VERSION if fields is None else MANIFEST_VERSION,
        "format": format,
        "format_version": format_version,
        "count": count,
        "sample": sample,
        "classes": list(classes),
        "static": static,
        "source": source,
        "checksums": {"algorithm": "sha256", "files": dict(checksums)},
        "layout": layout,
    }
    if targets is not None:   # absent otherwise: a store of int labels keeps its manifest as it was
        manifest["targets"] = dict(targets)
    if class_order is not None:
        manifest["class_order"] = class_order
    if fields is not None:
        manifest["fields"] = dict(fields)
    return manifest


def dumps(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False)


def loads(text: str | bytes, where: str, *, format: str | None = None,
          max_format_version: int | None = None) -> dict[str, Any]:
    """Parse and validate a manifest read from ``where`` (named in errors)."""
    try:
        manifest = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StoreCorruptError(f"{where}: manifest is not valid JSON ({exc})") from exc
    validate(manifest, where, format=format, max_format_version=max_format_version)
    return manifest


def _require(cond: bool, where: str, problem: str) -> None:
    if not cond:
        raise StoreCorruptError(f"{where}: {problem}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate(m: Any, where: str, *, format: str | None = None, max_format_version: int | None = None) -> None:
    """Check a manifest's structure and ranges; raise StoreCorruptError naming the problem."""
    _require(isinstance(m, dict), where, "manifest is not a JSON object")
    version = m.get("dlstore_manifest")
    _require(_is_int(version), where, "not a dlstore manifest (no 'dlstore_manifest' version)")
    _require(version <= MANIFEST_VERSION, where,
             f"manifest version {version} is newer than this dlstore understands "
             f"({MANIFEST_VERSION}); upgrade dlstore")
    _require(isinstance(m.get("format"), str), where, "manifest has no 'format'")
    if format is not None:
        _require(m["format"] == format, where, f"manifest says format {m['format']!r}, expected {format!r}")
    fv = m.get("format_version")
    _require(_is_int(fv) and fv >= 1, where, "manifest has no valid 'format_version'")
    if max_format_version is not None:
        _require(fv <= max_format_version, where,
                 f"{m['format']} layout version {fv} is newer than this dlstore reads "
                 f"({max_format_version}); upgrade dlstore")
    count = m.get("count")
    _require(_is_int(count) and 0 <= count <= MAX_COUNT, where, f"invalid sample count {count!r}")
    sample = m.get("sample")
    _require(isinstance(sample, dict), where, "manifest has no 'sample' spec")
    _require(sample.get("dtype") == "uint8" and sample.get("layout") == "CHW", where,
             f"unsupported sample spec {sample!r} (expected uint8 CHW)")
    _require(sample.get("encoding") in ("raw", "jpeg", "png"), where,
             f"unknown sample encoding {sample.get('encoding')!r} (raw, jpeg, png); upgrade dlstore?")
    for key in ("shape", "decoded_shape"):
        shape = sample.get(key)
        if shape is not None:
            _require(isinstance(shape, list) and len(shape) == 3
                     and all(_is_int(d) and 0 < d <= MAX_DIM for d in shape)
                     and (shape[0] in (1, 3) or "fields" in m), where, f"invalid sample {key} {shape!r}")
    _require(sample["encoding"] == "raw" or sample.get("shape") is None, where,
             "an encoded store must have variable-length records (shape null)")
    classes = m.get("classes")
    _require(isinstance(classes, list) and all(isinstance(c, str) for c in classes), where,
             "'classes' must be a list of names")
    # Any name: reading needs only 'classes'; a rule a newer dlstore adds must not make a store unreadable.
    _require(isinstance(m.get("class_order", ""), str), where, "'class_order' must be a string")
    if "targets" in m:
        targets = m["targets"]
        _require(isinstance(targets, dict) and targets.get("dtype") in ("int64", "float32")
                 and isinstance(targets.get("shape"), list) and len(targets["shape"]) == 1
                 and _is_int(targets["shape"][0]) and 0 < targets["shape"][0] <= MAX_DIM, where,
                 f"invalid 'targets' {targets!r} (expected dtype int64 or float32 and shape [K])")
    if "fields" in m:
        check_fields(m, where)
    _require(isinstance(m.get("static"), list), where, "'static' must be a list")
    _require(isinstance(m.get("source"), dict), where, "'source' must be an object")
    checksums = m.get("checksums")
    _require(isinstance(checksums, dict) and isinstance(checksums.get("files"), dict), where,
             "'checksums' must hold a 'files' object")
    _require(isinstance(m.get("layout"), dict), where, "'layout' must be an object")
