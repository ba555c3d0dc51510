"""Bad input to every public entry point: only DlstoreError subclasses escape, with a useful message.

Two parts:

* a table of known-bad calls, each with the error class it must raise and a
  fragment the message must contain (the value, the path or the fix);
* a sweep that replaces each argument of the main entry points in turn by junk
  (None, -1, "x", 1.5, [], object()): each must raise a DlstoreError whose message
  names the argument (never a TypeError from deep inside numpy), except the values
  listed in ACCEPTED with the documented meaning they have (None: the default).
"""

from __future__ import annotations

import pytest
import torch

import dlstore
from dlstore import errors, tools
from dlstore import transforms as T
from dlstore.sources.demo import make_image_folder


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("errors")
    src = tmp / "src"
    make_image_folder(src, classes=2, per_class=3, size=(16, 16))
    store = tmp / "s.shards"
    dlstore.convert(src, store, static="center_crop=12", workers=0, progress=False)
    junk = tmp / "junk.bin"
    junk.write_bytes(b"hello, not a store")
    empty = tmp / "empty"
    empty.mkdir()
    return {"tmp": tmp, "src": src, "store": store, "junk": junk, "empty": empty}


def _ds(env):
    return dlstore.open_dataset(env["store"])


# (id, call(env), error class, fragment of the message)
CASES = [
    ("convert-missing-src", lambda e: dlstore.convert(e["tmp"] / "nope", e["tmp"] / "a.shards", progress=False),
     errors.SourceError, "nope"),
    ("convert-src-is-a-file", lambda e: dlstore.convert(e["junk"], e["tmp"] / "a.shards", progress=False),
     errors.SourceError, "junk.bin"),
    ("convert-empty-src", lambda e: dlstore.convert(e["empty"], e["tmp"] / "a.shards", progress=False),
     errors.SourceError, "no class folders"),
    ("convert-unknown-suffix", lambda e: dlstore.convert(e["src"], e["tmp"] / "a.zip", progress=False),
     errors.UnknownFormatError, "a.zip"),
    ("convert-unknown-format", lambda e: dlstore.convert(e["src"], e["tmp"] / "a.shards", store_format="zip",
                                                         progress=False), errors.UnknownFormatError, "zip"),
    ("convert-bad-static", lambda e: dlstore.convert(e["src"], e["tmp"] / "a.shards", static="resize=abc",
                                                     progress=False), errors.TransformSpecError, "resize=abc"),
    ("convert-random-static", lambda e: dlstore.convert(e["src"], e["tmp"] / "a.shards", static=[{"op": "random_crop"}],
                                                        progress=False), errors.TransformSpecError, "random_crop"),
    ("convert-negative-workers", lambda e: dlstore.convert(e["src"], e["tmp"] / "a.shards", workers=-3,
                                                           progress=False), errors.ArgumentError, "-3"),
    ("convert-str-workers", lambda e: dlstore.convert(e["src"], e["tmp"] / "a.shards", workers="two",
                                                      progress=False), errors.ArgumentError, "two"),
    ("convert-bad-on-error", lambda e: dlstore.convert(e["src"], e["tmp"] / "a.shards", on_error="ignore",
                                                       progress=False), errors.ArgumentError, "ignore"),
    ("convert-exists", lambda e: dlstore.convert(e["src"], e["store"], progress=False),
     errors.StoreExistsError, "overwrite"),
    ("convert-misspelt-option", lambda e: dlstore.convert(e["src"], e["tmp"] / "a.h5", compresion="gzip",
                                                          progress=False), errors.ArgumentError, "compresion"),
    ("convert-option-of-another-format", lambda e: dlstore.convert(e["src"], e["tmp"] / "a.shards", map_size=1 << 20,
                                                                   progress=False), errors.ArgumentError, "map_size"),
    ("convert-bad-compression", lambda e: dlstore.convert(e["src"], e["tmp"] / "a.h5", compression="zip",
                                                          progress=False), errors.ArgumentError, "zip"),
    ("convert-zero-shard-size", lambda e: dlstore.convert(e["src"], e["tmp"] / "a.shards", shard_size=0,
                                                          progress=False), errors.ArgumentError, "shard_size"),
    ("convert-bad-quality", lambda e: dlstore.convert(e["src"], e["tmp"] / "a.shards", encoding="jpeg", quality=101,
                                                      progress=False), errors.ArgumentError, "101"),
    ("open-missing", lambda e: dlstore.open_dataset(e["tmp"] / "nope"), errors.StoreNotFoundError, "nope"),
    ("open-junk-file", lambda e: dlstore.open_dataset(e["junk"]), errors.UnknownFormatError, "junk.bin"),
    ("open-empty-folder", lambda e: dlstore.open_dataset(e["empty"]), errors.UnknownFormatError, "empty"),
    ("open-none", lambda e: dlstore.open_dataset(None), errors.ArgumentTypeError, "NoneType"),
    ("open-with-another-formats-class", lambda e: dlstore.LMDBDataset(e["store"]), errors.WrongFormatError,
     "ShardsDataset"),
    ("open-unknown-reader-option", lambda e: dlstore.open_dataset(e["store"], reader_options={"readahed": True}),
     errors.ArgumentError, "readahed"),
    ("open-uncallable-transform", lambda e: dlstore.open_dataset(e["store"], transform="flip"),
     errors.ArgumentTypeError, "flip"),
    ("open-other-static", lambda e: dlstore.open_dataset(e["store"], transform=dlstore.HybridTransform("resize=4")),
     errors.StaticMismatchError, "center_crop"),
    ("index-out-of-range", lambda e: _ds(e)[100], errors.SampleIndexError, "100"),
    ("index-not-an-int", lambda e: _ds(e)["a"], errors.ArgumentTypeError, "'a'"),
    ("batch-index-out-of-range", lambda e: _ds(e).get_batch([0, 99]), errors.SampleIndexError, "99"),
    ("batch-float-indices", lambda e: _ds(e).get_batch([0.5]), errors.ArgumentTypeError, "float"),
    ("loader-not-a-store-dataset", lambda e: dlstore.loader([1, 2, 3], 2), errors.ArgumentTypeError, "list"),
    ("loader-zero-batch", lambda e: dlstore.loader(_ds(e), 0), errors.ArgumentError, "batch_size"),
    ("loader-negative-workers", lambda e: dlstore.loader(_ds(e), 2, num_workers=-1), errors.ArgumentError,
     "num_workers"),
    ("loader-gpu-option-on-store", lambda e: dlstore.loader(_ds(e), 2, channels_last=True), errors.ArgumentError,
     "GPUDataset"),
    ("loader-worker-option-on-gpu", lambda e: dlstore.loader(dlstore.GPUDataset(e["store"], "cpu"), 2, num_workers=2),
     errors.ArgumentError, "num_workers"),
    ("split-a-string", lambda e: dlstore.split_transforms("resize"), errors.ArgumentTypeError, "resize"),
    ("split-an-int", lambda e: dlstore.split_transforms(5), errors.ArgumentTypeError, "int"),
    ("hybrid-unknown-op", lambda e: dlstore.HybridTransform(static="crop=4"), errors.TransformSpecError, "crop"),
    ("gpu-missing-store", lambda e: dlstore.GPUDataset(e["tmp"] / "nope", "cpu"), errors.StoreNotFoundError, "nope"),
    ("gpu-unknown-device", lambda e: dlstore.GPUDataset(e["store"], "nodevice"), errors.ArgumentError, "nodevice"),
    ("gpu-int-dtype", lambda e: dlstore.GPUDataset(e["store"], "cpu", dtype=torch.int32), errors.ArgumentError,
     "int32"),
    ("gpu-not-a-source", lambda e: dlstore.GPUDataset(5, "cpu"), errors.ArgumentTypeError, "int"),
    ("gpu-bad-normalize", lambda e: dlstore.GPUDataset(e["store"], "cpu", normalize=(1, 2, 3)), errors.ArgumentError,
     "normalize"),
    ("gpu-zero-batch", lambda e: dlstore.loader(dlstore.GPUDataset(e["store"], "cpu"), 0), errors.ArgumentError,
     "batch_size"),
    ("gpu-bad-overflow", lambda e: dlstore.GPUDataset(e["store"], "cpu", on_overflow="spill"), errors.ArgumentError,
     "spill"),
    ("parse-static-interpolation", lambda e: T.parse_static("resize=1:zzz"), errors.TransformSpecError, "zzz"),
    ("batch-crop-size", lambda e: T.BatchRandomCrop(-1), errors.TransformSpecError, "-1"),
    ("batch-crop-padding", lambda e: T.BatchRandomCrop(4, padding="x"), errors.TransformSpecError, "'x'"),
    ("batch-crop-too-large", lambda e: T.BatchRandomCrop(40)(torch.zeros(2, 3, 8, 8, dtype=torch.uint8)),
     errors.TransformSpecError, "40x40"),
    ("batch-flip-p", lambda e: T.BatchRandomHorizontalFlip(2.0), errors.TransformSpecError, "2.0"),
    ("batch-normalize-zero-std", lambda e: T.BatchNormalize([1, 2], [0, 0]), errors.TransformSpecError, "0"),
    ("batch-rrc-scale", lambda e: T.BatchRandomResizedCrop(8, scale=(2, 1)), errors.TransformSpecError, "scale"),
    ("batch-cutout-size", lambda e: T.BatchCutout(-2), errors.TransformSpecError, "-2"),
    ("tune-zero-batch", lambda e: tools.tune(_ds(e), 0), errors.ArgumentError, "batch_size"),
    ("tune-negative-budget", lambda e: tools.tune(_ds(e), 2, budget=-1), errors.ArgumentError, "budget"),
    ("timed-dataset-workers", lambda e: tools.TimedDataset(_ds(e), max_workers=-1), errors.ArgumentError, "-1"),
    ("bench-unknown-format", lambda e: tools.run_bench(e["tmp"] / "bench", formats="zip"), errors.ArgumentError,
     "zip"),
]


@pytest.mark.parametrize("call, error, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_dlstore_error(env, call, error, fragment):
    with pytest.raises(errors.DlstoreError) as info:
        call(env)
    assert isinstance(info.value, error), f"{type(info.value).__name__}: {info.value}"
    assert fragment in str(info.value)


def test_every_error_class_is_a_dlstore_error_and_a_builtin():
    """Users can catch DlstoreError for everything, or the builtin they already catch."""
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, Exception)]
    assert len(classes) > 10
    for cls in classes:
        assert issubclass(cls, errors.DlstoreError), cls
        if cls is not errors.DlstoreError:
            builtin = [b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (object, BaseException,
                                                                                         Exception)]
            assert builtin, f"{cls.__name__} refines no builtin error type"
    # every class is exported: docstrings name them under Raises, so users must be able to catch them
    assert {c.__name__ for c in classes} <= set(dlstore.__all__)
    assert all(getattr(dlstore, c.__name__) is c for c in classes)


# The junk values, by the name a test id shows.
JUNK_BY_ID = {"None": None, "-1": -1, "'x'": "x", "1.5": 1.5, "[]": [], "object()": object()}

# Junk the API accepts, and why (documented in the entry point's docstring): everything else
# in JUNK_BY_ID must be refused with a DlstoreError naming the argument.
ACCEPTED = {
    ("convert", "store_format", "None"): "the format from dst's suffix",
    ("convert", "static", "None"): "no static ops",
    ("convert", "static", "[]"): "an empty list of op dicts: no static ops",
    ("convert", "workers", "None"): "one decode process per usable CPU",
    ("convert", "shard_size", "None"): "the default, 1 GiB a data file",
    ("convert", "max_pixels", "None"): "no decompression-bomb limit",
    ("open_dataset", "transform", "None"): "no transform",
    ("open_dataset", "target_transform", "None"): "no transform",
    ("open_dataset", "batch_transform", "None"): "no transform",
    ("open_dataset", "reader_options", "None"): "the format's defaults",
    ("loader", "seed", "None"): "a GPUDataset draws a seed; a StoreDataset reads it only when distributed",
    ("loader", "seed", "-1"): "any int seeds torch's generators, negative ones too",
    ("GPUDataset", "normalize", "None"): "no normalisation",
    ("GPUDataset", "chunk_size", "None"): "a chunk size chosen from the memory",
    ("GPUDataset", "max_memory", "None"): "what the device has free",
}

# Junk that must be refused and is not: known bugs, reported; strict, so a fix shows here.
BUGS: dict = {}   # (entry, argument, junk id) -> why a junk value is still accepted (a strict xfail)

# Arguments that are paths: a message may name them by their value instead ("x: no such store",
# "cannot convert a NoneType: give an image folder, ...").
PATHS = {("convert", "src"), ("convert", "dst"), ("open_dataset", "path"), ("GPUDataset", "source")}


def _names_value(message: str, value) -> bool:
    if isinstance(value, str):   # the path first, as dlstore's errors name a file
        return message.startswith(f"{value}:") or repr(value) in message
    return type(value).__name__.lower() in message


def _cases(entry: str, names: list[str]) -> list:
    cases = []
    for name in names:
        for vid in JUNK_BY_ID:
            key = (entry, name, vid)
            marks = [pytest.mark.xfail(strict=True, reason=BUGS[key])] if key in BUGS else []
            cases.append(pytest.param(name, vid, id=f"{name}={vid}", marks=marks))
    return cases


def _check(entry: str, name: str, vid: str, call):
    """Call with argument ``name`` set to junk ``vid``: accepted where ACCEPTED says so (returning
    what ``call`` returns), else a DlstoreError whose message names the argument."""
    value = JUNK_BY_ID[vid]
    if (entry, name, vid) in ACCEPTED:
        return call(value)
    with pytest.raises(Exception) as info:
        call(value)
    exc = info.value
    assert isinstance(exc, errors.DlstoreError), f"{entry}({name}={vid}) raised {type(exc).__name__}: {exc}"
    message = str(exc).lower()
    named = name in message or name.replace("_", " ") in message
    if (entry, name) in PATHS:
        named = named or _names_value(message, value)
    assert named, f"{entry}({name}={vid}): the message does not name the argument: {exc}"
    return None


CONVERT_ARGS = ["src", "dst", "store_format", "static", "workers", "on_error", "encoding", "quality",
                "shard_size", "max_pixels"]


@pytest.mark.parametrize("name, vid", _cases("convert", CONVERT_ARGS))
def test_convert_junk_arguments(env, name, vid, tmp_path):
    dst = tmp_path / "s.shards"

    def call(value):
        kwargs = {"src": env["src"], "dst": dst, "workers": 0, "static": "center_crop=12", "progress": False}
        return dlstore.convert(**dict(kwargs, **{name: value}))

    result = _check("convert", name, vid, call)
    if result is None:   # refused: nothing written
        assert not dst.exists() and not any(tmp_path.iterdir())
    else:
        assert result.count == 6 and dlstore.open_dataset(dst)[5][1] == 1


@pytest.mark.parametrize("name, vid", _cases("open_dataset", ["path", "transform", "target_transform",
                                                              "batch_transform", "reader_options"]))
def test_open_dataset_junk_arguments(env, name, vid):
    result = _check("open_dataset", name, vid,
                    lambda value: dlstore.open_dataset(**dict({"path": env["store"]}, **{name: value}))[0])
    if result is not None:
        assert result[0].shape == (3, 12, 12)


@pytest.mark.parametrize("name, vid", _cases("loader", ["dataset", "batch_size", "shuffle", "num_workers",
                                                        "drop_last", "seed"]))
def test_loader_junk_arguments(env, name, vid):
    def call(value):
        return next(iter(dlstore.loader(**dict({"dataset": _ds(env), "batch_size": 2}, **{name: value}))))

    result = _check("loader", name, vid, call)
    if result is not None:
        assert result[0].shape == (2, 3, 12, 12)


@pytest.mark.parametrize("name, vid", _cases("GPUDataset", ["source", "device", "dtype", "normalize",
                                                            "chunk_size", "max_memory", "on_overflow"]))
def test_gpu_dataset_junk_arguments(env, name, vid):
    result = _check("GPUDataset", name, vid,
                    lambda value: dlstore.GPUDataset(**dict({"source": env["store"], "device": "cpu"}, **{name: value})))
    if result is not None:
        assert len(result) == 6 and result[0][0].shape == (3, 12, 12)
