"""Which leading ops of a read-time pipeline a store's static stage already applied, and the errors
of a pipeline whose deterministic ops differ from it (never run silently on processed samples)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ArgumentError, StaticMismatchError
from .recognise import conversion, short_repr, static_of
from .static import StaticSpec, describe, parse_static

STATIC_MISMATCH = ("error", "allow")
ALLOW = "pass static_mismatch='allow' (open_dataset / the dataset / plan)"


def check_mismatch_argument(value: Any) -> str:
    if value not in STATIC_MISMATCH:
        raise ArgumentError(f"static_mismatch must be one of {', '.join(map(repr, STATIC_MISMATCH))}, got {value!r}")
    return value


def leading_static(ops: Sequence[Any]) -> tuple[StaticSpec, int]:
    """(the spec of the leading run of static ops, the number of ops it spans): uint8 conversions
    among them are passed over, the first op with no static equivalent ends it."""
    spec: StaticSpec = []
    end = 0
    for k, op in enumerate(ops):
        if conversion(op) == "uint8":
            continue
        more = static_of(op)
        if more is None:
            break
        spec += more
        end = k + 1
    return spec, end


def match_static(ops: Sequence[Any], stored: StaticSpec, where: Any) -> tuple[int, StaticMismatchError | None]:
    """(how many leading ops of ``ops`` the store's ``stored`` static stage already applied, or the
    error of a pipeline whose leading deterministic ops differ from it).

    The ops taken are those whose static specs make ``stored``, and the uint8 conversions right
    after them. A pipeline whose first op has no static equivalent (a random crop, a float
    conversion) takes none and is no mismatch: it is the dynamic part, or meant for a store
    downscaled by ``resize_max``.
    """
    matched: StaticSpec = []
    taken = 0
    differing: Any = None       # the op where the pipeline leaves the store's spec, if any
    for k, op in enumerate(ops):
        if len(matched) == len(stored):
            break
        if conversion(op) == "uint8":
            continue
        spec = static_of(op)
        if spec is None or spec != stored[len(matched):len(matched) + len(spec)]:
            differing = op
            break
        matched += spec
        taken = k + 1
    if not matched and (differing is None or static_of(differing) is None):
        return 0, None
    if differing is not None or len(matched) < len(stored):
        return 0, _mismatch(where, stored, ops, matched, differing)
    while taken < len(ops) and conversion(ops[taken]) == "uint8":
        taken += 1                # a trailing PILToTensor of the static part is a no-op too
    return taken, None


def _fix(stored: StaticSpec, ops: Sequence[Any]) -> str:
    theirs, end = leading_static(ops)
    rest = [type(op).__name__ for op in ops[end:] if conversion(op) != "uint8"]
    rest_text = f"[{', '.join(rest)}]" if rest else "no transform"
    return (f"To read this store, pass the pipeline's ops after its static ones ({rest_text}); for the pipeline's "
            f"own pixels, convert a store with static={describe(theirs)!r} (dlstore.split_transforms(pipeline) "
            f"gives it) and open that; to run the transform as given on the stored samples anyway, {ALLOW}, or "
            f"open it with dlstore.HybridTransform({describe(stored)!r}, transform).")


def _mismatch(where: Any, stored: StaticSpec, ops: Sequence[Any], matched: StaticSpec,
              differing: Any) -> StaticMismatchError:
    head = f"{where}: the store was converted with static transforms {describe(stored)!r}; "
    fix = _fix(stored, ops)
    theirs = static_of(differing) if differing is not None else None
    expected = stored[len(matched)] if len(matched) < len(stored) else None
    if theirs and expected is not None and _same_geometry(theirs[0], expected):
        return StaticMismatchError(
            f"{head}the transform's {short_repr(differing)} does what the store's {describe([expected])!r} already did, with "
            f"other settings (store: {expected}, transform: {theirs[0]}). Run as given it would do it a second "
            f"time to the stored samples. {fix}")
    if not matched:
        return StaticMismatchError(
            f"{head}the transform begins with {short_repr(differing)} ({describe(theirs or [])}), a deterministic op that "
            f"differs from them. Run as given it would {_verb(theirs)} the stored samples, which already went "
            f"through {describe(stored)!r}, not the original images. {fix}")
    missing = describe(stored[len(matched):])
    instead = f"then has {short_repr(differing)} where" if differing is not None else "then ends where"
    return StaticMismatchError(
        f"{head}the transform begins with only {describe(matched)!r} of them, {instead} the store has "
        f"{missing!r}. Run as given it would apply {describe(matched)!r} a second time to the stored samples; "
        f"skipping that would not give the pipeline's pixels either (the stored samples also went through "
        f"{missing!r}). {fix}")


def _verb(spec: StaticSpec | None) -> str:
    kind = spec[0]["op"] if spec else ""
    return {"resize": "resize", "resize_max": "downscale", "center_crop": "crop", "pad": "pad",
            "grayscale": "convert"}.get(kind, "transform")


# The fields of a static op that say where pixels go; an op equal in these does what the
# other did (interpolation and antialias only change how the new pixels are computed).
_GEOMETRY = {"resize": ("size", "max_size"), "resize_max": ("size",), "pad": ("padding",)}


def _same_geometry(op: dict[str, Any], other: dict[str, Any]) -> bool:
    keys = _GEOMETRY.get(op["op"])
    return keys is not None and op["op"] == other["op"] and all(op[k] == other[k] for k in keys)


def hybrid_mismatch(where: Any, stored: Any, wanted: StaticSpec) -> StaticMismatchError | None:
    """The error of a hybrid whose static part ``wanted`` is not the store's ``stored``, or None."""
    stored = parse_static(stored or [])
    if stored == wanted:
        return None
    detail = ""
    if describe(stored) == describe(wanted):  # differ in a field describe() leaves out
        detail = f"\n  store:     {stored}\n  transform: {wanted}"
    if not wanted and [op["op"] for op in stored] == ["resize_max"]:
        fix = (f"The store holds every image downscaled (resize_max): open it with "
               f"dlstore.split_transforms(pipeline, resize_max={stored[0]['size']}), or with the pipeline itself "
               f"(transform=pipeline), whose random crop then reads the downscaled images")
    else:
        fix = (f"Convert again with dlstore.convert(src, {str(where)!r}, static=hybrid, overwrite=True), or open "
               f"it with a hybrid whose static part is {describe(stored)!r}")
    return StaticMismatchError(
        f"{where}: the store was converted with static transforms {describe(stored)!r}, but the hybrid "
        f"transform's static part is {describe(wanted)!r}{detail}. Training on it would not see the data "
        f"the pipeline describes. {fix}; to run its dynamic part on the stored samples anyway, {ALLOW}.")
