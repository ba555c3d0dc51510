"""A CSV or JSON-lines list of ``path,label`` rows as a source.

Paths are relative to ``root`` (default: the list file's folder); files are
decoded with ``pil_loader`` like an image folder's, in the order of the list.
Provenance is the path as listed.

Mode: ``mode="RGB"`` or ``"L"`` converts every file to it. By default the files'
headers are read (``Image.open(f).mode``: nothing is decoded) up to the first colour
file: any colour file makes the store RGB (``img.convert("RGB")``, as ImageFolder's
loader); a list of grayscale files only (``L``, ``LA``, 16-bit...) stays one channel.

* CSV (``.csv``, ``.tsv``, ``.txt``): ``path,label`` per row; a first row
  ``path,label`` (any names) whose label is not an integer is a header.
* JSON lines (``.jsonl``, ``.ndjson``, ``.json``): one object per line with
  ``"path"`` and ``"label"`` keys.

Paths: every listed path must lie inside the root. A relative path is taken from
the root; an absolute one is accepted when it lies under the root. Either is
refused, naming its line, when it leads outside the root (``../`` past the root,
an absolute path elsewhere). The check is on the path as written (``.`` and
``..`` resolved as text): a symlink inside the root that points elsewhere is
followed, as a folder source follows one.

Labels: all integers (class indices; classes named ``"0"``... up to the largest) or
all names (classes sorted, as ImageFolder sorts its folders); a list that mixes the
two is refused, naming the first line of each kind (a name that looks like a
number, such as ``"7"`` among ``"cat"``, cannot be told from an index: prefix it).
An empty or missing label everywhere means unlabelled (-1).

Target vectors: CSV rows ``path,t0,t1,...`` with K >= 2 numbers (JSON lines: a
``"label"`` list of numbers), the same K on every row: stored int64 when every value
is an integer, else float32 (``nan``/``inf`` allowed); no classes. A header row
(``path,a,b,...``) is skipped.

Segmentation pairs: ``image,mask`` rows (JSON lines: ``"path"`` or ``"image"``, and ``"mask"``),
both paths under the same rules (relative to the root, refused outside it), read by
``read_pair_list`` into a ``PairSource`` (items ``(image, mask)``; no labels). ``read_list``
reads a list as one when its header names a mask column (``image,mask``, ``path,mask``) or its
first JSON object has a ``"mask"`` key.
"""

from __future__ import annotations

import csv
import json
import os
import warnings
from pathlib import Path

import numpy as np
from PIL import Image

from ..errors import SourceError
from .decode import check_mode, storable_mode
from .folder import UNLABELLED, SampleList, Source
from .pairs import PairSource

LIST_SUFFIXES = (".csv", ".tsv", ".txt", ".jsonl", ".ndjson", ".json")


def _rows(path: Path):
    """(line number, path, label text or None) of every row."""
    suffix = path.suffix.lower()
    with open(path, newline="", encoding="utf-8") as f:
        if suffix in _JSON_SUFFIXES:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SourceError(f"{path}:{n}: not a JSON object ({exc})") from exc
                if not isinstance(row, dict) or not isinstance(row.get("path"), str):
                    raise SourceError(f"{path}:{n}: expected an object with a \"path\" string (and \"label\")")
                label = row.get("label")
                if isinstance(label, list):   # a target vector
                    yield n, row["path"], tuple(str(v) for v in label)
                    continue
                yield n, row["path"], None if label is None else str(label)
            return
        reader = csv.reader(f, delimiter="\t" if suffix == ".tsv" else ",")
        for n, row in enumerate(reader, 1):
            if not row or not "".join(row).strip():
                continue
            if len(row) > 2:   # path,t0,t1,...: a target vector
                values = tuple(field.strip() for field in row[1:])
                if n == 1 and row[0].strip().lower() in _HEADERS and not all(_is_number(v) for v in values):
                    continue  # header
                yield n, row[0].strip(), values
                continue
            label = row[1].strip() if len(row) == 2 else ""
            if n == 1 and label and not _is_int(label) and row[0].strip().lower() in _HEADERS:
                continue  # header
            yield n, row[0].strip(), label or None


_HEADERS = ("path", "file", "filename", "image")
_MASK_HEADERS = ("mask", "masks", "annotation", "segmentation")
_JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def read_list(list_file: str | os.PathLike, root: str | os.PathLike | None = None, *,
              mode: str | None = None) -> Source | PairSource:
    """The file list ``list_file`` as a source (raises SourceError naming the bad row).

    ``mode``: ``"RGB"`` or ``"L"``; None: chosen from the files (see the module doc).
    A list with a mask column (see the module doc) is read by ``read_pair_list``.
    """
    check_mode(mode)
    if _names_masks(Path(list_file)):
        return read_pair_list(list_file, root, mode=mode)
    source = _read_list(list_file, root)
    source.mode, source.mode_given = (mode, True) if mode is not None else (_choose_mode(source.samples), False)
    return source


def read_pair_list(list_file: str | os.PathLike, root: str | os.PathLike | None = None, *,
                   mode: str | None = None) -> PairSource:
    """A list of ``image,mask`` rows as a segmentation source, in the order of the list.

    CSV/TSV rows ``image,mask`` (a first row ``image,mask`` of names is a header); JSON lines
    ``{"image": ..., "mask": ...}`` (or ``"path"`` for the image). Both paths follow the list's path
    rules (see the module doc): relative to ``root`` (default: the list's folder), refused outside it.

    Args:
        list_file: the list.
        root: the folder the paths are relative to.
        mode: ``"RGB"`` or ``"L"``, what every image is converted to; None: chosen from the images'
            headers as ``read_list`` chooses. Masks are never converted.

    Raises:
        SourceError: naming the list and line of a row without two paths, or of a path outside the root.
    """
    check_mode(mode)
    list_path, root_str = _list_and_root(list_file, root)
    base = os.path.abspath(root_str)
    rows = []
    try:
        for n, image, mask in _pair_rows(list_path):
            rows.append((_inside(list_path, n, image, root_str, base), _inside(list_path, n, mask, root_str, base)))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise SourceError(f"{list_path}: not a UTF-8 CSV/TSV or JSON-lines list of image,mask rows ({exc})") from None
    if not rows:
        raise SourceError(f"{list_file}: lists no pair")
    images = SampleList.build(root_str, ((os.path.join(root_str, image), UNLABELLED) for image, _ in rows))
    masks = SampleList.build(root_str, ((os.path.join(root_str, mask), UNLABELLED) for _, mask in rows))
    source = PairSource(root_str, root_str, images, masks, kind="pair list", list_file=os.path.abspath(list_path))
    source.mode, source.mode_given = (mode, True) if mode is not None else (_choose_mode(source.images), False)
    return source


def _pair_rows(path: Path):
    """(line number, image path, mask path) of every row of a pair list."""
    with open(path, newline="", encoding="utf-8") as f:
        if path.suffix.lower() in _JSON_SUFFIXES:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SourceError(f"{path}:{n}: not a JSON object ({exc})") from exc
                image = row.get("image", row.get("path")) if isinstance(row, dict) else None
                if not isinstance(image, str) or not isinstance(row.get("mask"), str):
                    raise SourceError(f"{path}:{n}: expected an object with \"image\" (or \"path\") and \"mask\" "
                                      "strings")
                yield n, image, row["mask"]
            return
        for n, row in enumerate(csv.reader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ","), 1):
            if not row or not "".join(row).strip():
                continue
            if len(row) != 2:
                raise SourceError(f"{path}:{n}: {len(row)} column(s), expected two: image,mask")
            if n == 1 and _is_mask_header(row):
                continue
            yield n, row[0].strip(), row[1].strip()


def _is_mask_header(row: list[str]) -> bool:
    return len(row) == 2 and row[0].strip().lower() in _HEADERS and row[1].strip().lower() in _MASK_HEADERS


def _names_masks(path: Path) -> bool:
    """Whether the list's first row says it holds masks: a ``x,mask`` header, a JSON ``"mask"`` key."""
    if not path.is_file():
        return False   # _read_list names it
    try:
        with open(path, newline="", encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
    except (OSError, UnicodeDecodeError):
        return False   # _read_list reports it
    if path.suffix.lower() in _JSON_SUFFIXES:
        try:
            row = json.loads(first)
        except json.JSONDecodeError:
            return False
        return isinstance(row, dict) and "mask" in row
    row = next(csv.reader([first], delimiter="\t" if path.suffix.lower() == ".tsv" else ","), [])
    return _is_mask_header(row)


def _header_mode(path: str) -> str | None:
    """The storable mode of a file from its header (PIL opens lazily); None if it cannot be opened."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                return storable_mode(img.mode)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return None  # the conversion names (or skips) this file


def _choose_mode(samples: SampleList) -> str:
    """RGB at the first colour file; L when every file that opens is grayscale."""
    return "RGB" if any(_header_mode(path) == "RGB" for path, _ in samples) else "L"


def _list_and_root(list_file: str | os.PathLike, root: str | os.PathLike | None) -> tuple[Path, str]:
    list_path = Path(list_file)
    if not list_path.is_file():
        raise SourceError(f"{list_file}: no such list file")
    root_str = str(Path(root) if root is not None else list_path.parent)
    if not Path(root_str).is_dir():
        raise SourceError(f"{root_str}: the root of {list_file} is not a folder (give --root DIR)")
    return list_path, root_str


def _read_list(list_file: str | os.PathLike, root: str | os.PathLike | None) -> Source:
    list_path, root_str = _list_and_root(list_file, root)
    rows = []
    try:
        base = os.path.abspath(root_str)
        for n, listed, label in _rows(list_path):
            rows.append((_inside(list_path, n, listed, root_str, base), label, n))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise SourceError(f"{list_path}: not a UTF-8 CSV/TSV or JSON-lines list of path,label rows ({exc})") from None
    if not rows:
        raise SourceError(f"{list_file}: lists no file")
    if any(isinstance(label, tuple) for _, label, _ in rows):
        return _vector_list(list_path, root_str, rows)
    _check_label_kinds(list_path, rows)
    rows = [(rel, label) for rel, label, _ in rows]
    texts = {label for _, label in rows}
    if texts == {None}:
        classes, to_int = [], lambda text: UNLABELLED
    elif None in texts:
        missing = next(rel for rel, label in rows if label is None)
        raise SourceError(f"{list_file}: {missing} has no label but others have; label every row or none")
    elif all(_is_int(t) for t in texts):
        top = max(int(t) for t in texts)
        if min(int(t) for t in texts) < 0:
            raise SourceError(f"{list_file}: negative label {min(int(t) for t in texts)}; labels are class "
                              "indices 0.. (or class names)")
        classes, to_int = [str(k) for k in range(top + 1)], int
    else:
        classes = sorted(texts)
        index = {c: i for i, c in enumerate(classes)}
        to_int = index.__getitem__
    samples = SampleList.build(root_str, ((os.path.join(root_str, rel), to_int(label)) for rel, label in rows))
    return Source(root_str, classes, {c: i for i, c in enumerate(classes)}, samples, [], kind="list",
                  list_file=os.path.abspath(list_path))


def _inside(list_path: Path, n: int, listed: str, root: str, base: str) -> str:
    """``listed`` as a path relative to ``root`` (whose absolute path is ``base``), or SourceError naming
    line ``n`` if it leads outside it. Text only (no system call): lists hold millions of rows."""
    if not listed:
        raise SourceError(f"{list_path}:{n}: empty path")
    if ".." not in listed and not os.path.isabs(listed):   # the common row: inside, as it stands
        return listed
    norm = os.path.normpath(listed)
    if os.path.isabs(norm):
        inside = norm.startswith(os.path.join(base, ""))
        rel = os.path.relpath(norm, base) if inside else norm
    else:
        inside = norm != os.pardir and not norm.startswith(os.pardir + os.sep)
        rel = listed
    if not inside:
        raise SourceError(f"{list_path}:{n}: path {listed!r} leads outside the root {root}; list paths inside "
                          "it (relative to it, or absolute under it), or give the folder that holds them all "
                          "as the root (--root, root=)")
    return rel


def _check_label_kinds(list_path: Path, rows: list[tuple[str, str | tuple[str, ...] | None, int]]) -> None:
    """SourceError if some labels are class indices and others class names, naming the first line of each."""
    seen: dict[str, int] = {}   # each label's first line (one int() try per distinct label, not per row)
    for _, label, n in rows:
        if isinstance(label, str) and label not in seen:
            seen[label] = n
    first: dict[bool, tuple[int, str]] = {}
    for label, n in seen.items():   # in line order
        first.setdefault(_is_int(label), (n, label))
    if len(first) == 2:
        (n_int, index), (n_name, name) = first[True], first[False]
        raise SourceError(f"{list_path}: labels mix class indices (line {n_int}: {index!r}) and class names "
                          f"(line {n_name}: {name!r}); use one kind: all integers 0.. or all names (prefix "
                          "names that look like numbers, e.g. 'c7')")


def _vector_list(list_path: Path, root_str: str, rows: list[tuple[str, tuple[str, ...] | str | None, int]]) -> Source:
    """A list of ``path,t0,t1,...`` rows: a source of (N, K) int64 or float32 target vectors."""
    first = rows[0][1]
    width = len(first) if isinstance(first, tuple) else 1
    for rel, values, n in rows:
        if not isinstance(values, tuple) or len(values) != width:
            got = len(values) if isinstance(values, tuple) else (0 if values is None else 1)
            raise SourceError(f"{list_path}:{n}: {rel} has {got} target value(s), the first row {width}; every "
                              "row needs the same number of values (path,t0,t1,...)")
        bad = next((v for v in values if not _is_number(v)), None)
        if bad is not None:
            raise SourceError(f"{list_path}:{n}: {rel} has the target value {bad!r}, not a number")
    texts = [v for _, values, _ in rows for v in values]
    if all(_is_int(t) for t in texts):
        targets = np.array([[int(v) for v in values] for _, values, _ in rows], dtype=np.int64)
    else:
        targets = np.array([[float(v) for v in values] for _, values, _ in rows], dtype=np.float32)
    # the label of each path is its row in `targets` (FileLoader hands out targets[row])
    samples = SampleList.build(root_str, ((os.path.join(root_str, rel), k) for k, (rel, _, _) in enumerate(rows)))
    return Source(root_str, [], {}, samples, [], kind="list", list_file=os.path.abspath(list_path), targets=targets)
