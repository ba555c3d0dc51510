"""Where samples come from: an ImageFolder-exact folder scan, datasets, arrays, CSV lists; decoding with guards.

Every source presents the interface the conversion consumes, so ``conversion/``
stays generic::

    kind, root, classes (None: named from the labels), class_to_idx, empty_classes,
    class_order (a folder's: "imagefolder" | "natural", see class_order; absent or None: not a folder's),
    mode ("L" | "RGB": every image is converted to it), mode_given (else chosen, see below),
    channels, sample_shape (C, H, W when every image has it, else None),
    origin_kind ("path" | "index")
    len(source); source.item_keys(start) -> picklable per-item keys, in order
    source.loader(decode) -> picklable callable: key -> (image, label)
                             image: a PIL image or a uint8 (C, H, W) tensor, in ``mode``
    source.origin(key) -> provenance (path relative to root, or index)
    source.where(key) -> the item named in errors
    source.part(start, stop), source.fingerprint(), source.describe()

Mode, when not given: a folder is RGB (torchvision's loader); a list, a dataset or
arrays keep the one mode of their images (MNIST stays L) and become RGB when any
image is colour (``img.convert("RGB")``, as ImageFolder's loader makes them).

Nothing here knows about stores or transforms.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import ArgumentError, ArgumentTypeError, SourceError
from .arrays import ArraySource
from .class_order import CLASS_ORDERS, check_class_order
from .dataset import DatasetSource
from .decode import DEFAULT_MAX_PIXELS, MODES, check_mode, pil_loader
from .folder import IMG_EXTENSIONS, UNLABELLED, Source, find_classes, scan
from .listfile import LIST_SUFFIXES, read_list

__all__ = ["CLASS_ORDERS", "DEFAULT_MAX_PIXELS", "IMG_EXTENSIONS", "MODES", "UNLABELLED", "ArraySource",
           "DatasetSource", "Source", "check_class_order", "find_classes", "open_source", "pil_loader", "read_list",
           "scan"]


def is_source(obj: Any) -> bool:
    """True for an object that already presents the source interface."""
    return all(hasattr(obj, name) for name in ("item_keys", "loader", "origin", "part", "fingerprint", "describe"))


def open_source(src: Any, *, root: str | os.PathLike | None = None, image_key: str | int | None = None,
                label_key: str | int | None = None, mode: str | None = None,
                class_order: str = "imagefolder") -> Any:
    """The source ``src`` names: a folder, a CSV/JSON-lines list, ``(images, labels)``, or a dataset.

    ``mode``: ``"RGB"`` or ``"L"``, every image converted to it; None: chosen (see the module doc).
    ``class_order``: how a folder's classes are ordered (``class_order.CLASS_ORDERS``); the other
    sources have their own order, so only the default is accepted for them.

    Raises:
        SourceError: a path that is neither a folder nor a list file.
        ArgumentTypeError: an object of another kind.
        ArgumentError: a mode a store cannot hold, or one that a source object was not built with;
            a class order for a source that is not a folder.
    """
    check_mode(mode)
    check_class_order(class_order)
    if is_source(src):
        if mode is not None and getattr(src, "mode", None) != mode:
            raise ArgumentError(f"mode={mode!r} for a {type(src).__name__} source of mode "
                                f"{getattr(src, 'mode', None)!r}: give mode= to the source's constructor")
        if class_order != "imagefolder" and getattr(src, "class_order", None) != class_order:
            raise ArgumentError(f"class_order={class_order!r} for a {type(src).__name__} source ordered "
                                f"{getattr(src, 'class_order', None)!r}: give class_order= to scan()")
        return src
    is_path = isinstance(src, (str, os.PathLike))
    if class_order != "imagefolder" and (not is_path or Path(src).is_file()):   # (a missing folder: scan names it)
        kind = "list file" if is_path else type(src).__name__
        raise ArgumentError(f"class_order={class_order!r} orders the class folders of an image folder; a {kind} "
                            "keeps its own order (a list's class names sorted, a dataset's classes, arrays' "
                            "label values): convert a folder, or rename the classes at their source")
    if isinstance(src, (str, os.PathLike)):
        path = Path(src)
        if path.is_dir():
            if root is not None:
                raise SourceError(f"{src}: root= is for a list file; a folder is its own root")
            return scan(path, mode, class_order=class_order)
        if path.is_file() and path.suffix.lower() in LIST_SUFFIXES:
            return read_list(path, root, mode=mode)
        if path.is_file():
            raise SourceError(f"{src}: not a folder nor a list file ({', '.join(LIST_SUFFIXES)})")
        return scan(path, mode, class_order=class_order)  # raises SourceError naming the missing folder
    if isinstance(src, tuple) and len(src) == 2 and hasattr(src[0], "shape") and hasattr(src[0], "dtype"):
        return ArraySource(src[0], src[1], mode=mode)
    if hasattr(src, "shape") and hasattr(src, "dtype"):
        return ArraySource(src, mode=mode)
    if hasattr(src, "__getitem__") and hasattr(src, "__len__") and not isinstance(src, (str, bytes, dict)):
        return DatasetSource(src, image_key=image_key, label_key=label_key, mode=mode)
    raise ArgumentTypeError(
        f"cannot convert a {type(src).__name__}: give an image folder, a CSV/JSON-lines list of path,label "
        "(with root=), a map-style dataset yielding (image, target), or arrays (images, labels)")
