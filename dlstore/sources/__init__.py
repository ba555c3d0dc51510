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

A segmentation source (``scan_pairs``, ``read_pair_list``, ``MaskDatasetSource``) has the same
interface with ``fields = ("image", "mask")``: its loader's items are ``(image, mask)``, the mask a
(H, W) uint8 (or uint16) array of class indices (``load_mask``, ``items.to_mask``), and it has no
classes. ``PairSource.skipped`` lists the files a scan left out (``on_error="skip"``).

Mode, when not given: a folder is RGB (torchvision's loader); a list, a dataset or
arrays keep the one mode of their images (MNIST stays L) and become RGB when any
image is colour (``img.convert("RGB")``, as ImageFolder's loader makes them).

Nothing here knows about stores or transforms.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from ..errors import ArgumentError, ArgumentTypeError, SourceError
from .arrays import ArraySource
from .class_order import CLASS_ORDERS, check_class_order
from .dataset import DatasetSource
from .decode import DEFAULT_MAX_PIXELS, MODES, check_mode, load_mask, mask_from_pil, pil_loader
from .folder import IMG_EXTENSIONS, UNLABELLED, Source, find_classes, scan
from .items import check_pair, to_mask
from .listfile import LIST_SUFFIXES, read_list, read_pair_list
from .mask_dataset import MaskDatasetLoader, MaskDatasetSource
from .pairs import FIELDS, PairLoader, PairSource, scan_pairs

__all__ = ["CLASS_ORDERS", "DEFAULT_MAX_PIXELS", "FIELDS", "IMG_EXTENSIONS", "MODES", "UNLABELLED", "ArraySource",
           "DatasetSource", "MaskDatasetLoader", "MaskDatasetSource", "PairLoader", "PairSource", "Source",
           "check_class_order", "check_pair", "find_classes", "load_mask", "mask_from_pil", "open_source",
           "pil_loader", "read_list", "read_pair_list", "scan", "scan_pairs", "to_mask"]


def is_source(obj: Any) -> bool:
    """True for an object that already presents the source interface."""
    return all(hasattr(obj, name) for name in ("item_keys", "loader", "origin", "part", "fingerprint", "describe"))


def open_source(src: Any, *, root: str | os.PathLike | None = None, image_key: str | int | None = None,
                label_key: str | int | None = None, mode: str | None = None,
                class_order: str = "imagefolder", masks: str | os.PathLike | None = None,
                mask_key: str | int | None = None, on_error: str = "fail") -> Any:
    """The source ``src`` names: a folder, a CSV/JSON-lines list, ``(images, labels)``, or a dataset.

    ``mode``: ``"RGB"`` or ``"L"``, every image converted to it; None: chosen (see the module doc).
    ``class_order``: how a folder's classes are ordered (``class_order.CLASS_ORDERS``); the other
    sources have their own order, so only the default is accepted for them.

    Segmentation (items ``(image, mask)``): ``masks`` names the folder of masks paired with the
    folder ``src`` (``scan_pairs``; ``on_error="skip"`` leaves unpaired files out); ``mask_key`` makes
    a dataset ``src`` a ``MaskDatasetSource`` (the mask's key or position), as does a dataset whose
    item 0 is typed as a pair (``yields_masks``); a list with a mask column is read as pairs by
    ``read_list``.

    Raises:
        SourceError: a path that is neither a folder nor a list file.
        ArgumentTypeError: an object of another kind.
        ArgumentError: a mode a store cannot hold, or one that a source object was not built with;
            a class order for a source that is not a folder.
    """
    check_mode(mode)
    check_class_order(class_order)
    if masks is not None or mask_key is not None:
        return _open_pairs(src, masks=masks, image_key=image_key, mask_key=mask_key, mode=mode,
                           class_order=class_order, on_error=on_error)
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
        if yields_masks(src):
            return MaskDatasetSource(src, image_key=image_key, mask_key=label_key, mode=mode)
        return DatasetSource(src, image_key=image_key, label_key=label_key, mode=mode)
    raise ArgumentTypeError(
        f"cannot convert a {type(src).__name__}: give an image folder, a CSV/JSON-lines list of path,label "
        "(with root=), a map-style dataset yielding (image, target), or arrays (images, labels)")


def yields_masks(dataset: Any) -> bool:
    """Whether item 0 of ``dataset`` is an (image, mask) pair by its types: a ``tv_tensors.Mask``, or a
    PIL image as the target (``VOCSegmentation``, ``Cityscapes(target_type="semantic")``)."""
    from PIL import Image

    try:
        item = dataset[0] if len(dataset) else None
    except Exception:  # user code: the dataset source names the failure of item 0
        return False
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        return False
    tv_tensors = sys.modules.get("torchvision.tv_tensors")   # imported by whoever made a Mask
    return isinstance(item[1], Image.Image) or tv_tensors is not None and isinstance(item[1], tv_tensors.Mask)


def _open_pairs(src: Any, *, masks: Any, image_key: Any, mask_key: Any, mode: str | None, class_order: str,
                on_error: str) -> Any:
    """The segmentation source of ``open_source(src, masks=...)`` or ``open_source(dataset, mask_key=...)``."""
    if class_order != "imagefolder":
        raise ArgumentError(f"class_order={class_order!r}: a segmentation source has no classes to order")
    if masks is not None:
        if mask_key is not None or not isinstance(src, (str, os.PathLike)):
            raise ArgumentTypeError(f"masks= pairs a folder of images with a folder of masks; got a "
                                    f"{type(src).__name__}{' and mask_key=' if mask_key is not None else ''} (a "
                                    "dataset of pairs takes mask_key=, a list of image,mask rows neither)")
        return scan_pairs(src, masks, on_error=on_error, mode=mode)
    if isinstance(src, (str, bytes, dict, os.PathLike)) or not (hasattr(src, "__getitem__") and hasattr(src, "__len__")):
        raise ArgumentTypeError(f"mask_key= names the mask of a dataset's items; got a {type(src).__name__} (a folder "
                                "of images takes masks=MASKS_FOLDER)")
    return MaskDatasetSource(src, image_key=image_key, mask_key=mask_key, mode=mode)
