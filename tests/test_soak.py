"""benchmarks/soak.py, short: readers never see a mix, a wrong sample or a crash while the store is overwritten."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    """The benchmark script as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("soak", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("soak", None)


@pytest.mark.slow
def test_readers_during_overwrites_see_whole_versions_only(soak, tmp_path):
    out = tmp_path / "soak.json"
    code = soak.main(["--seconds", "3", "--images", "48", "--formats", "shards,lmdb,hdf5", "--hang-seconds", "20",
                      "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["failures"] == [] and code == 0, report["failures"]
    for fmt, result in report["results"].items():
        assert result["overwrites_during_reads"] >= 1, fmt
        seen = {v: sum(r["seen"][v] for r in result["readers"].values()) for v in "AB"}
        assert seen["A"] > 0 and seen["B"] > 0, (fmt, seen)
        for kind, r in result["readers"].items():
            assert r["mixed"] == 0 and r["wrong"] == 0 and not r["unexpected"] and not r["crash"], (fmt, kind, r)
