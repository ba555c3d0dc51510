"""The order of a folder's classes, which fixes every label: ImageFolder's, or timm's natural one.

==============  ==============================  ==========================================
class_order     rule                            ``c1 c10 c2 C3 b`` becomes
==============  ==============================  ==========================================
"imagefolder"   ``sorted(names)``: torchvision  ``C3 b c1 c10 c2`` (code points: capitals
                ``ImageFolder.find_classes``    first, digits one by one)
"natural"       ``sorted(names, key=natural_    ``b c1 c2 C3 c10`` (case ignored, digit
                key)``: timm's image-folder     runs compared by value)
                reader
==============  ==============================  ==========================================

A model trained with one order and fed labels of the other sees every class
permuted, silently; so a store records the order it was converted with, and
``open_dataset(path, class_to_idx=...)`` refuses a store whose labels differ
from the mapping the caller trained with.

Two sets of names have no natural order that a store could reproduce, and are
refused: names whose keys tie (``C3`` and ``c3``, ``c1`` and ``c01``), which timm
orders by Python's string hash (a different order in each process unless
``PYTHONHASHSEED`` is fixed); and a name timm's key cannot be computed for (a part
of only non-decimal digits such as ``²``, on which ``int()`` fails in timm too).

This module knows nothing about stores.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..errors import ArgumentError, ArgumentTypeError, SourceError

CLASS_ORDERS = ("imagefolder", "natural")
DESCRIPTIONS = {
    "imagefolder": "sorted names, as torchvision's ImageFolder: c1, c10, c2",
    "natural": "as timm's folder reader: case ignored, numbers by value: c1, c2, c10",
}

_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> list[Any]:
    """timm's ``timm.utils.misc.natural_key``, the same expression: text parts lower-cased, digit runs as ints.

    Raises ValueError where timm's does (a part that ``str.isdigit`` accepts and ``int`` refuses).
    """
    return [int(s) if s.isdigit() else s for s in _DIGITS.split(name.lower())]


def check_class_order(class_order: Any) -> str:
    """``class_order`` if it names a rule, else ArgumentError listing them."""
    if class_order not in CLASS_ORDERS:
        raise ArgumentError(f"class_order must be one of {', '.join(map(repr, CLASS_ORDERS))} "
                            f"(--class-order {' | '.join(CLASS_ORDERS)}), got {class_order!r}")
    return class_order


def order_classes(names: list[str], class_order: str, where: str = "") -> list[str]:
    """``names`` in ``class_order``.

    Raises:
        SourceError: ``"natural"`` and two names with the same key, or a name without one
            (see the module doc); names the folders and the fix.
    """
    if check_class_order(class_order) == "imagefolder":
        return sorted(names)
    keyed = []
    for name in names:
        try:
            keyed.append((natural_key(name), name))
        except ValueError:
            raise SourceError(
                f"{where}{name!r}: a class name timm's natural_key cannot order (int() refuses its digit "
                "characters; timm's reader fails on it too): rename the folder, or convert with "
                "class_order=\"imagefolder\" (--class-order imagefolder)") from None
    keyed.sort(key=lambda pair: pair[0])
    for (key, name), (next_key, other) in zip(keyed, keyed[1:]):
        if key == next_key:
            name, other = sorted((name, other))
            raise SourceError(
                f"{where}class folders {name!r} and {other!r} are equal in natural order (case and leading "
                "zeros ignored); timm orders such names by Python's string hash, differently in each process "
                "(unless PYTHONHASHSEED is fixed), "
                "so no store can match its labels: rename one of them, or convert with "
                "class_order=\"imagefolder\" (--class-order imagefolder)")
    return [name for _, name in keyed]


def check_class_to_idx(where: str, classes: list[str], given: Any, *, recorded: str | None,
                       source_root: str | None = None) -> None:
    """Refuse a caller's ``class_to_idx`` that differs from a store's labels (``classes`` in label order).

    Raises:
        ArgumentTypeError: ``given`` is not a mapping of names to ints.
        ArgumentError: it differs; names the first differing class (in the store's label order, then
            names of ``given`` that the store lacks) and the fix: the class order that gives ``given``,
            or a ``target_transform`` where no order does.
    """
    if not isinstance(given, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in given.items()):
        raise ArgumentTypeError(f"class_to_idx must map class names (str) to labels (int), as "
                                f"ImageFolder.class_to_idx, got {type(given).__name__} {given!r:.200}")
    ours = {name: i for i, name in enumerate(classes)}
    if dict(given) == ours:
        return
    first = next((f"class {n!r} is label {i} in the store but "
                  + (f"{given[n]} in the class_to_idx given" if n in given else "absent from the class_to_idx given")
                  for n, i in ours.items() if given.get(n) != i), None)
    if first is None:
        name = next(n for n in given if n not in ours)
        first = f"class {name!r} (label {given[name]} in the class_to_idx given) is not a class of the store"
    order = (f"converted in {recorded} order ({DESCRIPTIONS.get(recorded, 'a rule this dlstore does not know')})"
             if recorded else "converted without a recorded class order (an older dlstore: a folder's classes "
                              "were then in imagefolder order)")
    raise ArgumentError(f"{where}: {first}; the store was {order}. {_fix(classes, given, source_root)}")


def _fix(classes: list[str], given: Mapping[str, int], source_root: str | None) -> str:
    """What to do about a mismatch: the class order that yields ``given``, if one does."""
    for rule in CLASS_ORDERS:
        try:
            ordered = order_classes(classes, rule)
        except SourceError:
            continue   # no natural order for these names
        if {name: i for i, name in enumerate(ordered)} == dict(given):
            return (f"Convert {source_root or 'the source'} again with class_order=\"{rule}\" (--class-order "
                    f"{rule}): that order gives the class_to_idx given")
    return ("No class order that dlstore converts with gives the class_to_idx given; convert with the order you "
            "trained with, or map the labels: target_transform=lambda y: given[ds.classes[y]]")
