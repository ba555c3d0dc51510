"""dlstore bench: page-cache eviction and its verification, an end-to-end run, the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlstore.cli import main
from dlstore.conversion.job import disk_usage
from dlstore.errors import ArgumentError, SourceError
from dlstore.tools.bench import BenchReport, Variant, parse_variants, run_bench
from dlstore.tools.bench.options import WARM_RESIDENT_MIN
from dlstore.tools.bench.probes import (
    COLD_RESIDENT_MAX,
    disk_info,
    evict,
    resident_fraction,
    store_files,
)
from dlstore.tools.bench.reading import read_once

STATIC = "resize=32,center_crop=32"
ALL = ["imagefolder", "shards", "lmdb", "hdf5", "shards+jpeg"]


def _page_cache_works(folder: Path) -> bool:
    # tmpfs/ramfs keep files only in the page cache: nothing can be evicted there
    return disk_info(folder)["fstype"] not in ("tmpfs", "ramfs")


def _write_synced(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    return path


def test_eviction_is_verified_by_mincore(tmp_path):
    if not _page_cache_works(tmp_path):
        pytest.skip(f"{tmp_path} is on a memory filesystem")
    path = _write_synced(tmp_path / "data.bin", 8 << 20)
    with open(path, "rb") as f:          # make sure every page is cached, whatever the write did
        while f.read(1 << 20):
            pass
    assert resident_fraction(path) > 0.99
    after = evict(path)
    assert after < 0.05
    assert resident_fraction([path]) == pytest.approx(after)
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass
    assert resident_fraction(path) > 0.99


def test_resident_fraction_is_size_weighted_over_a_folder(tmp_path):
    if not _page_cache_works(tmp_path):
        pytest.skip(f"{tmp_path} is on a memory filesystem")
    big = _write_synced(tmp_path / "big.bin", 3 << 20)
    small = _write_synced(tmp_path / "sub" / "small.bin", 1 << 20) if (tmp_path / "sub").mkdir() is None else None
    (tmp_path / "empty.bin").touch()
    evict(tmp_path)
    with open(small, "rb") as f:
        f.read()
    # 1 MiB of 4 MiB resident; the empty file counts for nothing
    assert resident_fraction(tmp_path) == pytest.approx(0.25, abs=0.05)
    assert resident_fraction(big) < 0.05
    assert store_files(tmp_path) == sorted([big, small, tmp_path / "empty.bin"])


def test_disk_info_picks_the_longest_mount_point(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/root / ext4 rw 0 0\n"
                      f"/dev/fast {tmp_path} xfs rw,noatime 0 0\n"
                      f"/dev/other {tmp_path}x btrfs rw 0 0\n"
                      f"tmpfs /dev/shm tmpfs rw 0 0\n")
    info = disk_info(tmp_path / ".", mounts=mounts)
    assert (info["device"], info["mount_point"], info["fstype"]) == ("/dev/fast", str(tmp_path), "xfs")
    assert info["total_bytes"] > 0 and 0 <= info["free_bytes"] <= info["total_bytes"]
    spaced = tmp_path / "a b"
    spaced.mkdir()
    mounts.write_text(f"/dev/root / ext4 rw 0 0\n/dev/sp {str(spaced).replace(' ', chr(92) + '040')} ext4 rw 0 0\n")
    assert disk_info(spaced, mounts=mounts)["device"] == "/dev/sp"


def test_parse_variants():
    assert parse_variants("imagefolder, shards,lmdb+jpeg,shards") == [
        Variant("imagefolder"), Variant("shards"), Variant("lmdb", "jpeg")]
    assert Variant("hdf5", "png").name == "hdf5+png"
    with pytest.raises(ValueError, match="valid: imagefolder, shards, lmdb, hdf5"):
        parse_variants("shards,parquet")
    with pytest.raises(ValueError, match="encoding"):
        parse_variants("shards+webp")
    with pytest.raises(ValueError, match="imagefolder"):
        parse_variants("imagefolder+jpeg")


def test_refuses_a_static_spec_without_a_fixed_size(rgb_folder, tmp_path):
    with pytest.raises(ValueError, match="crop"):
        run_bench(rgb_folder, workdir=tmp_path, static="resize=32", progress=False)
    with pytest.raises(ValueError, match="workers"):
        run_bench(rgb_folder, workdir=tmp_path, static=STATIC, workers="0,x", progress=False)
    assert not list(tmp_path.iterdir())  # nothing written before the settings are checked


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """A small end-to-end run: every format, both cache states, workers 0, stores kept."""
    from dlstore.sources.demo import make_image_folder

    root = tmp_path_factory.mktemp("bench")
    src = make_image_folder(root / "src", classes=3, per_class=7, size=(40, 48))
    report = run_bench(src, workdir=root / "disk", formats=ALL, static=STATIC, workers=0, batch_size=2,
                       samples=18, repeats=2, disk_test_bytes=4 << 20, keep=True, progress=False)
    return report, report.write(root / "out"), root


@pytest.mark.slow
def test_report_files_are_well_formed(bench_run):
    report, written, _ = bench_run
    assert written["json"].name == "report.json" and written["md"].name == "report.md"
    payload = json.loads(written["json"].read_text())
    assert payload == json.loads(json.dumps(report.to_json()))
    for key in ("machine", "settings", "data", "disk", "stores", "reads", "recommendation", "notes"):
        assert key in payload
    machine = payload["machine"]
    assert machine["usable_cpus"] >= 1 and machine["ram_bytes"] > 0 and machine["torch"]
    assert machine["disk"]["fstype"] and machine["disk"]["total_bytes"] > 0
    assert payload["settings"]["formats"] == ALL
    # 18 of 21 images, spread over all three classes
    assert payload["data"]["samples"] == 18 and payload["data"]["classes"] == 3
    if "png" in written:
        assert written["png"].stat().st_size > 0
    else:
        assert any("matplotlib" in n for n in payload["notes"])
    md = written["md"].read_text()
    assert md.startswith("# dlstore bench")
    assert payload["recommendation"]["text"] in md
    for name in ALL:
        assert f"| {name} |" in md


@pytest.mark.slow
def test_store_sizes_are_their_disk_usage(bench_run):
    report, _, _ = bench_run
    n = report.data["samples"]
    for name, store in report.stores.items():
        assert store["bytes"] == disk_usage(Path(store["path"])) > 0
        assert store["bytes_per_sample"] == pytest.approx(store["bytes"] / n)
        if name == "imagefolder":
            assert store["bytes"] == report.data["bytes"] and store["convert"] is None
        else:
            assert store["convert"]["seconds"] > 0
            assert store["convert"]["images_per_s"] == pytest.approx(n / store["convert"]["seconds"])
    # JPEG-encoded samples are smaller than raw uint8 ones
    assert report.stores["shards+jpeg"]["bytes"] < report.stores["shards"]["bytes"]


@pytest.mark.slow
def test_read_measurements_are_positive_and_consistent(bench_run):
    report, _, _ = bench_run
    cells = {(r["format"], r["order"], r["workers"], r["cache"]) for r in report.reads}
    assert cells == {(f, o, 0, c) for f in ALL for o in ("random", "sequential") for c in ("cold", "warm")}
    disk_mb = report.disk["read_mb_s"]["median"]
    assert disk_mb > 0 and report.disk["write_mb_s"] > 0 and len(report.disk["read_mb_s"]["runs"]) == 3
    for r in report.reads:
        assert r["samples"] == report.data["samples"] and r["repeats"] == 2 and r["batches"] == 9
        sps = r["samples_per_s"]
        assert len(sps["runs"]) == 2 and 0 < sps["min"] <= sps["median"] <= sps["max"]
        per_sample = report.stores[r["format"]]["bytes_per_sample"]
        assert r["mb_per_s"]["median"] == pytest.approx(sps["median"] * per_sample / 1e6)
        steady = r["steady_samples_per_s"]  # after the first of 9 batches
        assert len(steady["runs"]) == 2 and steady["median"] > 0
        lat = r["batch_latency_ms"]
        assert 0 < lat["p50"] <= lat["p95"] <= lat["max"] and lat["batches"] == 18
        assert all(0.0 <= x <= 1.0 for x in r["resident_at_start"])
        if r["cache"] == "cold":
            assert r["disk_fraction"] == pytest.approx(r["mb_per_s"]["median"] / disk_mb)
        else:
            assert r["disk_fraction"] is None
        base = report.cell("imagefolder", r["order"], 0, r["cache"])
        assert r["vs_imagefolder"] == pytest.approx(sps["median"] / base["samples_per_s"]["median"])
    rec = report.recommendation
    assert rec["format"] in ALL[1:] and rec["cache"] == "cold" and rec["order"] == "random"
    best = max(report.cell(name, "random", 0, "cold")["samples_per_s"]["median"] for name in ALL[1:])
    assert rec["samples_per_s"] == best
    assert rec["format"] in rec["text"] and "ImageFolder" in rec["text"]
    assert rec["tied_with"] in ALL[1:] or rec["tied_with"] is None


@pytest.mark.slow
def test_cold_runs_really_were_cold_and_every_run_reports_its_measured_state(bench_run):
    """Cold is in bench's hands (it evicts its own files); whether a warm store stays cached
    depends on the machine's memory pressure (see the next test), so a warm run is held to what
    it reports: verified exactly when the residency it measured says so, and a note when not."""
    report, _, root = bench_run
    if not _page_cache_works(root):
        pytest.skip("memory filesystem")
    assert report.disk["cold_verified"]
    for r in report.reads:
        resident = r["resident_at_start"]
        assert len(resident) == r["repeats"] and all(0.0 <= x <= 1.0 for x in resident)
        if r["cache"] == "cold":
            assert max(resident) <= COLD_RESIDENT_MAX and r["verified"]
        else:
            assert r["verified"] == (min(resident) >= WARM_RESIDENT_MIN)
    unverified = [r for r in report.reads if not r["verified"]]
    assert any("did not start in the intended cache state" in n for n in report.notes) == bool(unverified)


def _store_and_files(rgb_folder, tmp_path):
    from dlstore import convert, open_dataset

    store = tmp_path / "s.shards"
    convert(rgb_folder, store, static=STATIC, workers=0, progress=False)
    return (lambda: open_dataset(store)), store_files(store)


def _one_run(opener, files, cache: str) -> dict:
    return read_once(opener, files, store=True, cache=cache, order="random", workers=0, batch_size=8, seed=0,
                      drop_caches=False)


def test_a_warm_run_starts_warm_whatever_was_reclaimed_before_it(rgb_folder, tmp_path):
    """Memory pressure reclaims a warmed store's pages between runs (a full test run on a loaded
    machine measured 10% resident at a warm run's start): bench warms each warm run itself."""
    if not _page_cache_works(tmp_path):
        pytest.skip(f"{tmp_path} is on a memory filesystem")
    opener, files = _store_and_files(rgb_folder, tmp_path)
    assert evict(files) <= COLD_RESIDENT_MAX        # what reclaim leaves of a store
    run = _one_run(opener, files, "warm")
    assert run["resident"] >= WARM_RESIDENT_MIN and run["samples"] == 24
    assert resident_fraction(files) >= WARM_RESIDENT_MIN


def test_a_cold_run_reports_the_residency_it_measured(rgb_folder, tmp_path):
    """Pages a live process maps cannot be evicted (another job reading the store): the cold run
    says so with the fraction it measured, rather than taking the eviction on trust."""
    import mmap

    if not _page_cache_works(tmp_path):
        pytest.skip(f"{tmp_path} is on a memory filesystem")
    opener, files = _store_and_files(rgb_folder, tmp_path)
    assert _one_run(opener, files, "cold")["resident"] <= COLD_RESIDENT_MAX
    maps = []
    for f in files:
        if f.stat().st_size:
            with open(f, "rb") as fh:
                m = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
            sum(m[i] for i in range(0, len(m), mmap.PAGESIZE))   # fault every page in
            maps.append(m)
    try:
        assert _one_run(opener, files, "cold")["resident"] >= WARM_RESIDENT_MIN
    finally:
        for m in maps:
            m.close()


@pytest.mark.slow
def test_table_lists_every_cell(bench_run):
    report, _, _ = bench_run
    table = report.table()
    assert len([line for line in table.splitlines() if line.startswith(("imagefolder ", "shards", "lmdb", "hdf5"))]) \
        == len(report.stores) + len(report.reads)
    assert report.recommendation["text"] in table


def test_worker_processes_and_removal(rgb_folder, tmp_path):
    """Real DataLoader workers behind the timing gate; the work folder is removed unless kept."""
    report = run_bench(rgb_folder, workdir=tmp_path, formats="imagefolder,lmdb", static=STATIC, workers="1",
                       cache="cold", orders="random", batch_size=8, samples=16, repeats=1,
                       disk_test_bytes=1 << 20, progress=False)
    assert isinstance(report, BenchReport)
    assert [(r["format"], r["workers"]) for r in report.reads] == [("imagefolder", 1), ("lmdb", 1)]
    assert all(r["samples"] == 16 and r["startup_s"]["median"] > 0 for r in report.reads)
    assert not list(tmp_path.iterdir())
    # backend="auto": the store's batches came from worker processes (the ring, or DataLoader's where
    # /dev/shm cannot hold it), and the header says which; ImageFolder is always torch's DataLoader
    built = report.cell("lmdb", "random", 1, "cold")["backend"]
    assert built in ("ring", "dataloader") and report.cell("imagefolder", "random", 1, "cold")["backend"] is None
    assert report.settings["backend"] == "auto" and f"backend auto ({built} at num_workers=1)" in report.table()


@pytest.mark.parametrize("backend, workers", [("dataloader", "0"), ("threads", "0"), ("ring", "1")])
def test_the_stores_are_read_with_the_backend_asked_for(rgb_folder, tmp_path, backend, workers):
    report = run_bench(rgb_folder, workdir=tmp_path, formats="imagefolder,shards", static=STATIC, workers=workers,
                       backend=backend, cache="warm", orders="random", batch_size=8, samples=16, repeats=1,
                       disk_test_bytes=1 << 20, progress=False)
    assert {r["format"]: r["backend"] for r in report.reads} == {"imagefolder": None, "shards": backend}
    assert report.settings["backend"] == backend and f"backend={backend!r}" in report.settings["reader"]["stores"]
    header = next(line for line in report.table().splitlines() if line.startswith("settings"))
    assert f"stores read with backend {backend}," in header
    assert json.loads(json.dumps(report.to_json()))["settings"]["backend"] == backend


@pytest.mark.parametrize("options, said", [
    ({"backend": "threads", "workers": "0,2"}, "measure it with workers=0 (--num-workers 0), got 0,2"),
    ({"backend": "ring", "workers": "0,2"}, "measure workers=2 (--num-workers 2), got 0,2"),
    ({"backend": "ring", "workers": 0}, "measure workers=2 (--num-workers 2), got 0"),
    ({"backend": "resident"}, "backend must be one of 'auto', 'threads', 'ring', 'dataloader'"),
])
def test_a_backend_the_worker_counts_cannot_use_is_refused_before_anything_is_written(rgb_folder, tmp_path,
                                                                                        options, said):
    with pytest.raises(ArgumentError) as caught:
        run_bench(rgb_folder, workdir=tmp_path, static=STATIC, progress=False, **options)
    assert said in str(caught.value)
    assert not list(tmp_path.iterdir())


def test_a_store_as_src_says_what_bench_takes_from_python_too(rgb_folder, tmp_path):
    """run_bench given a store (or nothing) says what the CLI says, before writing anything."""
    from dlstore import convert

    store = tmp_path / "s.lmdb"
    convert(rgb_folder, store, static=STATIC, workers=0, progress=False)
    disk = tmp_path / "disk"
    with pytest.raises(ArgumentError) as caught:
        run_bench(store, workdir=disk, static=STATIC, batch_size=16, progress=False)
    said = str(caught.value)
    assert said.startswith(f"{store} is a dlstore lmdb store; bench takes an image folder")
    assert f"pass the folder it was converted from ({Path(rgb_folder).resolve()})" in said
    assert f"dlstore profile {store} -b 16" in said
    with pytest.raises(SourceError, match="no such folder; bench takes an image folder"):
        run_bench(tmp_path / "missing", workdir=disk, static=STATIC, progress=False)
    assert not disk.exists()


def test_cli_bench(rgb_folder, tmp_path):
    out = tmp_path / "report"
    result = CliRunner().invoke(main, [
        "bench", str(rgb_folder), "--dir", str(tmp_path / "disk"), "--formats", "imagefolder,shards",
        "--static", STATIC, "--num-workers", "0", "--cache", "warm", "--order", "random", "--samples", "8",
        "--batch-size", "4", "--repeats", "1", "--disk-test-size", "1MiB", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert (out / "report.json").is_file() and (out / "report.md").is_file()
    payload = json.loads((out / "report.json").read_text())
    # what is recommended is the structure, not a race: the only store measured is named, the
    # text printed is the one saved, and its ratio is to the ImageFolder cell measured beside it
    recommendation = payload["recommendation"]
    assert recommendation["format"] == "shards" and recommendation["text"] in result.output
    assert recommendation["text"].startswith("Recommendation: shards is the fastest format")
    imagefolder = next(r for r in payload["reads"] if r["format"] == "imagefolder")
    assert recommendation["vs_imagefolder"] == pytest.approx(
        recommendation["samples_per_s"] / imagefolder["samples_per_s"]["median"])
    assert [r["format"] for r in payload["reads"]] == ["imagefolder", "shards"]
    assert not list((tmp_path / "disk").iterdir())


def test_cli_bench_reports_bad_settings(tmp_path):
    result = CliRunner().invoke(main, ["bench", "--dir", str(tmp_path), "--formats", "shards,zarr"])
    assert result.exit_code == 2
    assert "unknown format 'zarr'" in result.output
    result = CliRunner().invoke(main, ["bench", "--dir", str(tmp_path), "--backend", "threads", "--num-workers", "0,2"])
    assert result.exit_code == 2 and result.output.count("error: ") == 1
    assert "--backend threads builds batches in threads of this process" in result.output
    assert "measure it with --num-workers 0, got 0,2" in result.output
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_plot_when_matplotlib_is_installed(bench_run, tmp_path):
    pytest.importorskip("matplotlib", exc_type=ImportError)   # installed but built for a newer numpy: skip too
    report, _, _ = bench_run
    written = report.write(tmp_path)
    assert written["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_folder_has_exactly_the_samples_asked_for(tmp_path):
    report = run_bench(workdir=tmp_path, formats="shards", static=STATIC, workers=0, cache="warm",
                       orders="sequential", batch_size=8, samples=11, repeats=1, disk_test_bytes=1 << 20,
                       progress=False)
    assert report.data["samples"] == 11 and report.data["classes"] == 8
    assert report.reads[0]["samples"] == 11 and report.reads[0]["batches"] == 2
    assert report.reads[0]["steady_samples_per_s"] is None  # too few batches for a steady rate
    assert report.recommendation["format"] == "shards" and report.recommendation["vs_imagefolder"] is None


def test_flat_source_folder_is_read_as_one_class(tmp_path):
    import shutil

    from dlstore.sources.demo import make_image_folder

    labelled = make_image_folder(tmp_path / "labelled", classes=2, per_class=3, size=(36, 36))
    flat = tmp_path / "flat"
    flat.mkdir()
    for f in store_files(labelled):
        shutil.copyfile(f, flat / f"{f.parent.name}-{f.name}")
    report = run_bench(flat, workdir=tmp_path / "disk", formats="imagefolder,shards", static=STATIC, workers=0,
                       cache="warm", orders="random", batch_size=4, samples=0, repeats=1,
                       disk_test_bytes=1 << 20, progress=False)
    assert (report.data["samples"], report.data["classes"]) == (6, 1)
    assert report.data["source"] == str(flat.resolve())
    assert {r["format"]: r["samples"] for r in report.reads} == {"imagefolder": 6, "shards": 6}
