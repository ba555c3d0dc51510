"""Bad inputs, interrupted conversions, damaged stores, concurrency: every case has a clear outcome."""

from __future__ import annotations

import io
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.datasets.folder import pil_loader as tv_pil_loader
from torchvision.transforms import v2

import dlstore
from dlstore import verify
from dlstore.errors import (
    DecodeError,
    DlstoreError,
    SourceError,
    StoreBusyError,
    StoreCorruptError,
)
from dlstore.conversion.lock import DestinationLock
from dlstore.sources.demo import make_image_folder, synthetic_image


def _convert(src, dst, **kw):
    kw.setdefault("workers", 0)
    kw.setdefault("progress", False)
    return dlstore.convert(src, dst, **kw)


def _listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# --- bad source files -------------------------------------------------------------------

def _good(path: Path, cls=0, index=0, size=(20, 24)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(synthetic_image(cls, index, size)).save(path)


def _bad_files(root: Path) -> dict[str, str]:
    """Write one broken file of each kind; return {relative path: expected words in the reason}."""
    full = io.BytesIO()
    Image.fromarray(synthetic_image(0, 0, (64, 64))).save(full, format="JPEG")
    (root / "a").mkdir(parents=True, exist_ok=True)
    (root / "a" / "truncated.jpg").write_bytes(full.getvalue()[:400])
    (root / "a" / "empty.png").write_bytes(b"")
    (root / "a" / "text.jpg").write_text("this is a text file, not a JPEG")
    return {"a/empty.png": "cannot decode", "a/text.jpg": "cannot decode", "a/truncated.jpg": "cannot decode"}


@pytest.mark.parametrize("workers", [0, 2])
def test_each_bad_file_fails_the_conversion_naming_it(tmp_path, workers):
    src = tmp_path / "src"
    _good(src / "a" / "0.png")
    bad = _bad_files(src)
    for name in bad:  # each broken file alone, so each one is the first failure
        one = tmp_path / f"one-{Path(name).stem}"
        _good(one / "a" / "0.png")
        (one / "a" / Path(name).name).write_bytes((src / name).read_bytes())
        with pytest.raises(DecodeError) as info:
            _convert(one, tmp_path / "out.shards", workers=workers)
        assert str(one / name) in str(info.value)
        assert not (tmp_path / "out.shards").exists()
        assert not list(tmp_path.glob(".out.shards*"))  # no staging, no lock left


def test_skip_lists_every_bad_file_with_its_reason(tmp_path):
    src = tmp_path / "src"
    _good(src / "a" / "0.png")
    _good(src / "b" / "0.png", cls=1)
    bad = _bad_files(src)
    result = _convert(src, tmp_path / "out.shards", on_error="skip")
    assert result.count == 2
    assert {s["path"]: s["reason"] for s in result.skipped}.keys() == bad.keys()
    for entry in result.skipped:
        assert bad[entry["path"]] in entry["reason"]
    manifest = dlstore.open_dataset(tmp_path / "out.shards").manifest
    assert manifest["source"]["skipped"] == result.skipped
    assert dlstore.open_dataset(tmp_path / "out.shards").targets == [0, 1]


def test_odd_image_modes_convert_like_torchvision(tmp_path):
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    base = Image.fromarray(synthetic_image(2, 5, (30, 40)))
    base.convert("L").save(src / "gray.png")
    base.convert("CMYK").save(src / "cmyk.jpg")
    base.convert("RGBA").save(src / "rgba.png")
    pal = base.convert("P")
    pal.info["transparency"] = 0
    pal.save(src / "pal_transparent.png", transparency=0)
    base.save(src / "plain.webp", lossless=True)
    _convert(src.parent, tmp_path / "s.shards")
    ds = dlstore.open_dataset(tmp_path / "s.shards")
    files = sorted(os.listdir(src))
    for i, name in enumerate(files):
        expected = v2.PILToTensor()(tv_pil_loader(str(src / name)))
        assert torch.equal(ds[i][0], expected), name


def test_sixteen_bit_png_keeps_its_tones(tmp_path):
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    ramp = (np.arange(32 * 32, dtype=np.uint32).reshape(32, 32) * 64).astype(np.uint16)
    Image.fromarray(ramp).save(src / "deep.png")
    assert Image.open(src / "deep.png").mode.startswith("I;16")
    _convert(src.parent, tmp_path / "s.shards")
    image = dlstore.open_dataset(tmp_path / "s.shards")[0][0]
    assert torch.equal(image[0], torch.from_numpy((ramp >> 8).astype(np.uint8)))
    assert torch.equal(image[0], image[1]) and torch.equal(image[1], image[2])


def test_exif_orientation_is_opt_in(tmp_path):
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    img = Image.fromarray(synthetic_image(0, 1, (20, 30)))  # 20 high, 30 wide
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    img.save(src / "rotated.jpg", exif=exif.tobytes())
    _convert(src.parent, tmp_path / "raw.shards")
    _convert(src.parent, tmp_path / "exif.shards", exif_transpose=True)
    assert dlstore.open_dataset(tmp_path / "raw.shards")[0][0].shape == (3, 20, 30)  # as torchvision
    assert dlstore.open_dataset(tmp_path / "exif.shards")[0][0].shape == (3, 30, 20)
    assert dlstore.open_dataset(tmp_path / "exif.shards").manifest["source"]["decode"]["exif_transpose"]


def test_decompression_bomb_guard(tmp_path):
    src = tmp_path / "src" / "a"
    _good(src / "big.png", size=(50, 50))
    with pytest.raises(DecodeError, match=r"big.png.*2,500 pixels, over the limit of 1,000.*--max-pixels"):
        _convert(src.parent, tmp_path / "s.shards", max_pixels=1000)
    assert _convert(src.parent, tmp_path / "s.shards", max_pixels=2500).count == 1


def test_hidden_non_image_unicode_and_symlinked_files(tmp_path):
    src = tmp_path / "src"
    _good(src / "chats été" / "photo 1.png")
    _good(src / "chats été" / "ünï cödé.jpg", index=1)
    (src / "chats été" / "notes.txt").write_text("ignored")
    (src / "chats été" / ".DS_Store").write_bytes(b"\x00")
    _good(src / ".ipynb_checkpoints" / "x.png")
    _good(tmp_path / "elsewhere" / "linked.png", index=2)
    os.symlink(tmp_path / "elsewhere" / "linked.png", src / "chats été" / "z_link.png")
    result = _convert(src, tmp_path / "s.shards")
    assert result.count == 3 and result.classes == ["chats été"]


def test_empty_class_warns_and_keeps_index(tmp_path):
    src = tmp_path / "src"
    _good(src / "a" / "0.png")
    (src / "b").mkdir()
    _good(src / "c" / "0.png")
    messages = []
    _convert(src, tmp_path / "s.shards", log=messages.append)
    assert any("b" in m and "keep their label index" in m for m in messages)
    ds = dlstore.open_dataset(tmp_path / "s.shards")
    assert ds.classes == ["a", "b", "c"] and ds.targets == [0, 2]
    (src / "a" / "0.png").unlink()
    (src / "c" / "0.png").unlink()
    with pytest.raises(SourceError, match="none of the 3 class folders"):
        _convert(src, tmp_path / "t.shards")


# --- interrupted conversions ------------------------------------------------------------

@pytest.fixture(scope="module")
def slow_folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("slow") / "images", classes=4, per_class=60,
                             size=(240, 320))


def _start_convert(src, dst, *extra, hold=False, **popen):
    """``dlstore convert`` of ``src`` to the shards store ``dst`` in a subprocess. ``hold``: its writer
    stops at the first sample after the first checkpoint (progress.json) until a file ``gate`` appears
    next to ``dst``, so a signal sent once progress.json exists arrives mid-run however fast or loaded
    the machine is, not in a race with the end of the conversion."""
    args = ["convert", str(src), str(dst), "--static", "resize=48,center_crop=40", "--shard-size", "40000",
            "--quiet", *extra]
    progress, gate = dst.parent / f".{dst.name}.dlstore-tmp" / "progress.json", dst.parent / "gate"
    script = textwrap.dedent(f"""
        import os, time
        from dlstore.formats.shards import ShardWriter
        add = ShardWriter.add
        def held(*a, **k):
            while {hold!r} and os.path.exists({str(progress)!r}) and not os.path.exists({str(gate)!r}):
                time.sleep(0.01)
            return add(*a, **k)
        ShardWriter.add = held
        from dlstore.cli import main
        main({args!r}, prog_name="dlstore")
    """)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen)


def _wait_for(path: Path, proc, timeout=60.0):
    end = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"conversion ended before {path} appeared: {proc.communicate()}")
        if time.monotonic() > end:
            pytest.fail(f"{path} did not appear")
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_cleanly_and_resume_gives_the_same_store(slow_folder, tmp_path, sig):
    dst = tmp_path / "s.shards"
    proc = _start_convert(slow_folder, dst, "--workers", "2", hold=True)
    _wait_for(tmp_path / ".s.shards.dlstore-tmp" / "progress.json", proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "--resume" in err
    assert not dst.exists()
    staged = tmp_path / ".s.shards.dlstore-tmp"
    done = json.loads((staged / "progress.json").read_text())["source_pos"]
    assert 0 < done < 240

    resumed = _start_convert(slow_folder, dst, "--workers", "1", "--resume")
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    assert f"resuming after {done} of 240 files" in err
    assert not staged.exists()

    _convert(slow_folder, tmp_path / "clean.shards", static="resize=48,center_crop=40", shard_size=40000)
    assert _listing(dst) == _listing(tmp_path / "clean.shards")
    assert verify(dst, deep=True).ok


@pytest.mark.slow
def test_killed_worker_stops_the_conversion(slow_folder, tmp_path):
    dst = tmp_path / "s.shards"
    proc = _start_convert(slow_folder, dst, "--workers", "2", hold=True)
    _wait_for(tmp_path / ".s.shards.dlstore-tmp" / "progress.json", proc)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert children, "no worker processes found"
    os.kill(int(children[0]), signal.SIGKILL)
    (tmp_path / "gate").touch()     # the writer goes on, and meets the dead worker
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "worker process died" in err
    assert not dst.exists()


@pytest.mark.slow
def test_write_error_mid_conversion_leaves_no_store(slow_folder, tmp_path):
    dst = tmp_path / "s.shards"

    def limit_file_size():  # a file may not grow past 100 kB: the writer hits EFBIG, like a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    proc = _start_convert(slow_folder, dst, "--workers", "1", "--shard-size", "1MiB",
                          preexec_fn=limit_file_size)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "File too large" in err
    assert not dst.exists()


def test_second_conversion_to_the_same_destination_refuses(tmp_path):
    src = tmp_path / "src"
    _good(src / "a" / "0.png")
    lock = DestinationLock(tmp_path / "s.shards")
    lock.acquire()
    try:
        with pytest.raises(StoreBusyError, match="another conversion"):
            _convert(src, tmp_path / "s.shards")
    finally:
        lock.release()
    assert _convert(src, tmp_path / "s.shards").count == 1


@pytest.mark.slow
def test_resume_with_other_settings_is_refused(slow_folder, tmp_path):
    dst = tmp_path / "s.shards"
    proc = _start_convert(slow_folder, dst, "--workers", "1", hold=True)
    _wait_for(tmp_path / ".s.shards.dlstore-tmp" / "progress.json", proc)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    with pytest.raises(SourceError, match="other settings"):
        _convert(slow_folder, dst, static="resize=48,center_crop=32", shard_size=40000, resume=True)
    assert _convert(slow_folder, dst, static="resize=48,center_crop=32", shard_size=40000).count == 240


# --- damaged stores ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("small") / "images", classes=2, per_class=6,
                             size=(24, 30))


def _flip_byte_in(path: Path, needle: bytes) -> None:
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at >= 0, f"sample bytes not found in {path}"
    data[at + len(needle) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name, data_file", [("s.shards", "shard-00000.npy"), ("s.lmdb", "data.mdb"),
                                             ("s.h5", None)])
def test_verify_catches_one_flipped_byte(small_folder, tmp_path, name, data_file):
    dst = tmp_path / name
    _convert(small_folder, dst, static="resize=20,center_crop=16")
    assert verify(dst).ok
    sample = dlstore.open_dataset(dst)[3][0].numpy().tobytes()
    _flip_byte_in(dst / data_file if data_file else dst, sample)
    report = verify(dst)
    assert not report.ok
    assert "sha256 mismatch" in str(report)
    result = subprocess.run([sys.executable, "-m", "dlstore.cli", "verify", str(dst)], capture_output=True,
                            text=True)
    assert result.returncode == 1 and "PROBLEM" in result.stdout


def test_verify_deep_reports_missing_data(small_folder, tmp_path):
    dst = tmp_path / "s.shards"
    _convert(small_folder, dst, static="resize=20,center_crop=16", shard_size=16 * 16 * 3 * 5)
    (dst / "shard-00001.npy").unlink()
    report = verify(dst, deep=True)
    assert not report.ok and "shard-00001.npy" in str(report)


def test_manifest_from_a_newer_version_is_refused(small_folder, tmp_path):
    dst = tmp_path / "s.shards"
    _convert(small_folder, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["format_version"] = 99
    (dst / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreCorruptError, match="newer than this dlstore"):
        dlstore.open_dataset(dst)
    m["format_version"], m["dlstore_manifest"] = 1, 7
    (dst / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreCorruptError, match="upgrade dlstore"):
        dlstore.open_dataset(dst)


def test_huge_counts_in_a_crafted_manifest_are_refused(small_folder, tmp_path):
    dst = tmp_path / "s.shards"
    _convert(small_folder, dst, static="resize=20,center_crop=16")
    m = json.loads((dst / "manifest.json").read_text())
    m["sample"]["shape"] = [3, 10**9, 10**9]
    (dst / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreCorruptError, match="invalid sample shape"):
        dlstore.open_dataset(dst)


def test_reader_during_overwrite_keeps_the_old_version(small_folder, tmp_path):
    dst = tmp_path / "s.shards"
    _convert(small_folder, dst, static="resize=20,center_crop=16")
    old = dlstore.open_dataset(dst)
    before = [old[i][0].clone() for i in range(len(old))]
    _convert(small_folder, dst, static="resize=40,center_crop=16", overwrite=True)
    assert all(torch.equal(old[i][0], before[i]) for i in range(len(old)))
    new = dlstore.open_dataset(dst)
    assert not torch.equal(new[0][0], before[0])


# --- random damage never escapes as anything but a clear error ---------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, small_folder):
    root = tmp_path_factory.mktemp("pristine")
    _convert(small_folder, root / "fixed.shards", static="resize=20,center_crop=16")
    _convert(small_folder, root / "var.shards", static="resize=12")
    return root


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(store=st.sampled_from(["fixed.shards", "var.shards"]),
       target=st.integers(min_value=0, max_value=50),  # which of the store's files (modulo their count)
       damage=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=255)),
                       min_size=1, max_size=8),
       truncate=st.booleans())
def test_random_damage_raises_only_clear_errors(pristine, tmp_path_factory, store, target, damage, truncate):
    """Shards stores (pure Python reading, so in process; LMDB and HDF5: tests/formats/test_damage.py).

    Reading raises only DlstoreError subclasses; with check="sample" no sample reads back
    other than the pristine store's; and whenever a file's bytes changed, ``verify`` (and
    the CLI, exit 1) reports a problem naming that file."""
    import shutil

    work = tmp_path_factory.mktemp("damaged") / store
    shutil.copytree(pristine / store, work)
    files = sorted(work.iterdir())  # manifest (+ its .sha256), labels, crc32, index, shard / .bin data files
    path = files[target % len(files)]
    before = path.read_bytes()
    data = bytearray(before)
    for offset, value in damage:
        data[offset % len(data)] = value
    if truncate:
        data = data[: damage[0][0] % len(data)]
    path.write_bytes(bytes(data))
    ref = dlstore.open_dataset(pristine / store)
    for check in ("none", "sample"):
        try:
            ds = dlstore.open_dataset(work, check=check)
            for i in range(len(ds)):
                try:
                    x, y = ds[i]
                except DlstoreError:
                    continue
                if check == "sample":   # what reads back is the original sample, or nothing
                    rx, ry = ref[i]
                    assert len(ds) == len(ref) and x.shape == rx.shape and torch.equal(x, rx) and y == ry, \
                        (path.name, i)
        except DlstoreError:
            pass  # the clear, named error we promise (StoreCorruptError and friends)
    report = verify(work, deep=True)  # reports, never raises
    if bytes(data) != before:
        assert not report.ok, (path.name, str(report))
        assert any(path.name in f"{where}: {message}" for where, message in report.problems), \
            (path.name, str(report))


def test_verify_cli_names_a_damaged_manifest(small_folder, tmp_path):
    dst = tmp_path / "s.shards"
    _convert(small_folder, dst, static="resize=20,center_crop=16")
    text = (dst / "manifest.json").read_text()
    (dst / "manifest.json").write_text(text.replace('"root": "', '"root": "X', 1))  # still valid JSON
    result = subprocess.run([sys.executable, "-m", "dlstore.cli", "verify", str(dst)], capture_output=True, check=False,
                            text=True)
    assert result.returncode == 1 and "manifest.json" in result.stdout and "sha256 mismatch" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("sig, via", [(signal.SIGINT, "api"), (signal.SIGKILL, "api"), (signal.SIGTERM, "api"),
                                      (signal.SIGTERM, "handler"), (signal.SIGTERM, "cli")],
                         ids=["SIGINT", "SIGKILL", "SIGTERM", "handler-SIGTERM", "cli-SIGTERM"])
@pytest.mark.parametrize("name, progress, files", [
    ("s.lmdb", ".s.lmdb.dlstore-tmp/progress.json", ["data.mdb", "data.mdb.sha256", "lock.mdb"]),
    ("s.h5", ".s.h5.dlstore-tmp.progress.json", None),
    ("s.shards", ".s.shards.dlstore-tmp/progress.json", None),
])
def test_conversions_resume_from_their_last_written_block(slow_folder, tmp_path, name, progress, files, sig, via):
    """Interrupted (Ctrl-C), killed (SIGKILL: the OOM killer, kill -9) or terminated (SIGTERM: what
    SLURM and Kubernetes send before SIGKILL), then --resume. ``dlstore.convert`` installs no signal
    handler, so SIGTERM ends a script as SIGKILL does (Python's default), unless the script makes it
    Ctrl-C (``signal.signal(SIGTERM, signal.default_int_handler)``, as docs/robustness.md shows); the
    CLI does that itself. A killed HDF5 writer leaves a file HDF5 will not open for writing again: that conversion
    starts over, saying so, and gives the same store; LMDB and shards continue from their last unit."""
    dst = tmp_path / name
    unit = "shard_size" if name.endswith(".shards") else "batch_bytes"
    options = {"static": "resize=48,center_crop=40", unit: 30_000}  # a unit per ~6 samples
    # The conversion (workers=1: decoding in this process) holds at its first image after the first
    # checkpoint until the gate file exists, which it never does: the interrupt arrives mid-run
    # however fast or loaded the machine is, not in a race with the end of the conversion.
    # Through the CLI the same call is made, with the unit size the CLI has no option for (LMDB, HDF5).
    run = (f"dlstore.convert({str(slow_folder)!r}, {str(dst)!r}, workers=1, progress=False, "
           f"static={options['static']!r}, {unit}={options[unit]})")
    if via == "handler":
        run = "import signal\nsignal.signal(signal.SIGTERM, signal.default_int_handler)\n" + run
    if via == "cli":
        run = (f"convert = dlstore.conversion.convert\n"
               f"dlstore.conversion.convert = lambda *a, **k: convert(*a, **{{**k, {unit!r}: {options[unit]}}})\n"
               f"from dlstore.cli import main\n"
               f"main(['convert', {str(slow_folder)!r}, {str(dst)!r}, '--workers', '1', '--quiet', "
               f"'--static', {options['static']!r}], prog_name='dlstore')")
    script = textwrap.dedent(f"""
        import os, time
        import PIL.Image
        import dlstore
        opened = PIL.Image.open
        def gated(*args, **kwargs):
            while os.path.exists({str(tmp_path / progress)!r}) and not os.path.exists({str(tmp_path / "gate")!r}):
                time.sleep(0.01)
            return opened(*args, **kwargs)
        PIL.Image.open = gated
    """) + run + "\n"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(tmp_path / progress, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    killed = sig == signal.SIGKILL or (sig == signal.SIGTERM and via == "api")
    # the signal's exit, no cleanup; Python's exit on an uncaught KeyboardInterrupt; the CLI's
    assert proc.returncode == (130 if via == "cli" else -signal.SIGINT if via == "handler" else -sig), err
    assert not dst.exists() and (tmp_path / progress).is_file()
    done = json.loads((tmp_path / progress).read_text())["source_pos"]
    assert 0 < done < 240
    messages = []
    _convert(slow_folder, dst, resume=True, log=messages.append, **options)
    if killed and name == "s.h5":
        assert any("cannot be resumed" in m and "starting over" in m for m in messages), messages
        assert not any("resuming after" in m for m in messages)
    else:
        assert any(f"resuming after {done} of 240" in m for m in messages), messages
    _convert(slow_folder, tmp_path / ("clean-" + name), **options)
    resumed, clean = dlstore.open_dataset(dst), dlstore.open_dataset(tmp_path / ("clean-" + name))
    assert resumed.manifest["checksums"] == clean.manifest["checksums"]
    assert resumed.targets == clean.targets
    assert all(torch.equal(resumed[i][0], clean[i][0]) for i in range(len(clean)))
    if files:
        assert sorted(p.name for p in dst.iterdir()) == files
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, "clean-" + name])  # no staging left
    assert verify(dst, deep=True).ok

@pytest.mark.slow
def test_hdf5_resume_while_another_process_holds_the_staged_file_keeps_it(slow_folder, tmp_path):
    """Only a killed writer's file starts over: a staged file another process has open (HDF5's file
    lock) is an error naming it, the partial work kept, and --resume continues once it is closed."""
    dst, progress = tmp_path / "s.h5", tmp_path / ".s.h5.dlstore-tmp.progress.json"
    staged = tmp_path / ".s.h5.dlstore-tmp"
    options = dict(static="resize=48,center_crop=40", batch_bytes=30_000)
    script = textwrap.dedent(f"""
        import os, time
        import PIL.Image
        import dlstore
        opened = PIL.Image.open
        def gated(*args, **kwargs):
            while os.path.exists({str(progress)!r}):
                time.sleep(0.01)
            return opened(*args, **kwargs)
        PIL.Image.open = gated
        dlstore.convert({str(slow_folder)!r}, {str(dst)!r}, workers=1, progress=False,
                        static={options['static']!r}, batch_bytes={options['batch_bytes']})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(progress, proc)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    inode = staged.stat().st_ino
    viewer = subprocess.Popen([sys.executable, "-c", f"import h5py, time; f = h5py.File({str(staged)!r}, 'r'); "
                               "print('open', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert viewer.stdout.readline().strip() == "open"
        messages = []
        with pytest.raises(StoreCorruptError, match="cannot be reopened") as info:
            _convert(slow_folder, dst, resume=True, log=messages.append, **options)
        assert str(staged) in str(info.value)
        assert not any("starting over" in m for m in messages), messages
        assert staged.stat().st_ino == inode and progress.is_file()        # the partial work kept
    finally:
        viewer.kill()
        viewer.wait()
    done = json.loads(progress.read_text())["source_pos"]
    messages = []
    _convert(slow_folder, dst, resume=True, log=messages.append, **options)
    assert any(f"resuming after {done} of 240" in m for m in messages), messages
    _convert(slow_folder, tmp_path / "clean.h5", **options)
    assert dlstore.open_dataset(dst).manifest["checksums"] == dlstore.open_dataset(tmp_path / "clean.h5").manifest[
        "checksums"]


def test_one_damaged_shard_fails_only_its_samples(small_folder, tmp_path):
    dst = tmp_path / "s.shards"
    _convert(small_folder, dst, static="resize=20,center_crop=16", shard_size=16 * 16 * 3 * 4)  # 4, 4, 4
    data = (dst / "shard-00002.npy").read_bytes()
    (dst / "shard-00002.npy").write_bytes(data[: len(data) // 2])
    ds = dlstore.open_dataset(dst)
    assert ds[0][0].shape == (3, 16, 16) and ds[7][0].shape == (3, 16, 16)
    with pytest.raises(StoreCorruptError, match="shard-00002.npy"):
        ds[8]
    report = verify(dst, deep=True)
    assert [where for where, _ in report.problems if where.startswith("sample")] == ["sample 8", "sample 9",
                                                                                     "sample 10", "sample 11"]


def test_manifest_counts_beyond_a_shard_are_refused(small_folder, tmp_path):
    dst = tmp_path / "s.shards"
    _convert(small_folder, dst, static="resize=20,center_crop=16")
    m = json.loads((dst / "manifest.json").read_text())
    m["layout"]["per_shard"] = 4  # the single shard holds 12
    (dst / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreCorruptError, match="out of range"):
        dlstore.open_dataset(dst)
    assert not verify(dst, deep=True).ok
