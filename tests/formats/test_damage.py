"""Random damage to LMDB and HDF5 stores: a clear error or a report, never a crash.

LMDB and HDF5 are C libraries: a damaged page may crash the process instead of
raising. So each case runs in its own process, forked from a helper that has
imported dlstore once (a fresh interpreter per case would spend seconds
importing torch): a crash or a hang kills only that case's process, and the
test sees it as such.

Damage anywhere in the data file (not only metadata): random byte changes,
truncation, zeroed 4 KiB pages. For each case:

* the process must not crash nor hang (60 s);
* opening (with ``check="open"``, and again with ``check="sample"``) and reading
  every sample raises only DlstoreError subclasses, and never returns pixels that
  differ from the original (with ``check="sample"`` HDF5 may hang in its own
  metadata code, as without a check: tolerated there, counted, never a crash);
* whenever the file's bytes differ from the original, ``verify(deep=True)``
  reports a problem naming the file (the whole-file seal covers bytes that no
  sample checksum reaches), so pixels that read back damaged never pass
  unreported.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _helpers import ask, forked_helper

import dlstore
from dlstore.sources.demo import make_image_folder

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CASES_PER_FORMAT = 30
PAGE = 4096

# Run in the helper process (``_helpers.forked_helper``), one forked process per case.
HELPER = r"""
import numpy as np
import dlstore
from dlstore.errors import DlstoreError

def case(job):
    path, pristine, check = job["path"], job["pristine"], job["check"]
    res = {"open": None, "read_errors": 0, "wrong": 0, "foreign": None}
    ref = dlstore.open_dataset(pristine)
    try:
        ds = dlstore.open_dataset(path, check=check)
        if len(ds) != len(ref):
            res["wrong"] += 1
        for i in range(min(len(ds), len(ref))):
            try:
                x, y = ds[i]
            except DlstoreError:
                res["read_errors"] += 1
                continue
            rx, ry = ref[i]
            if y != ry or tuple(x.shape) != tuple(rx.shape) or not bool((x == rx).all()):
                res["wrong"] += 1
    except DlstoreError as exc:
        res["open"] = f"{type(exc).__name__}: {exc}"[:300]
    except Exception as exc:
        res["foreign"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        report = dlstore.verify(path, deep=True)
        res["verify_ok"] = report.ok
        res["problems"] = [f"{w}: {m}"[:300] for w, m in report.problems]
    except Exception as exc:
        res["foreign"] = f"verify raised {type(exc).__name__}: {exc}"[:300]
    return res
"""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("damage")
    src = make_image_folder(root / "images", classes=2, per_class=6, size=(24, 30))
    stores = {}
    for name in ("s.lmdb", "s.h5"):
        stores[name] = root / name
        dlstore.convert(src, root / name, static="resize=20,center_crop=16", workers=0, progress=False)
    return stores


@pytest.fixture(scope="module")
def helper():
    with forked_helper(HELPER) as proc:
        yield proc


def _run(helper, path: Path, pristine: Path, check: str) -> dict:
    return ask(helper, {"path": str(path), "pristine": str(pristine), "check": check})


damage = st.one_of(
    st.tuples(st.just("bytes"), st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
                                         min_size=1, max_size=8)),
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True)),
    st.tuples(st.just("zero_page"), st.floats(0, 1, exclude_max=True)),
)


def _damage(path: Path, what) -> None:
    data = bytearray(path.read_bytes())
    kind, arg = what
    if kind == "bytes":
        for where, value in arg:
            data[int(where * len(data))] = value
    elif kind == "truncate":
        del data[int(arg * len(data)):]
    else:
        start = int(arg * len(data)) // PAGE * PAGE
        data[start:start + PAGE] = bytes(len(data[start:start + PAGE]))
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("check", ["open", "sample"])
@pytest.mark.parametrize("name, data_file", [("s.lmdb", "data.mdb"), ("s.h5", None)])
def test_random_damage_is_a_clear_error_or_reported_never_a_crash(pristine, helper, tmp_path_factory, name,
                                                                  data_file, check):
    """check="open": the seal stops every damaged file before the library sees it. check="sample":
    the file reaches the library; every sample read must still be the original or a DlstoreError.
    HDF5 itself may hang in its metadata code on such a file (seen: a zeroed metadata page), which
    only the seal (check="open") prevents: a hang is tolerated there, a crash never."""
    outcomes = []

    @settings(max_examples=CASES_PER_FORMAT, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(what=damage)
    def case(what):
        work = tmp_path_factory.mktemp("damaged") / name
        if pristine[name].is_dir():
            shutil.copytree(pristine[name], work)
        else:
            shutil.copy2(pristine[name], work)
        target = work / data_file if data_file else work
        before = target.read_bytes()
        _damage(target, what)
        changed = target.read_bytes() != before
        res = _run(helper, work, pristine[name], check)
        outcomes.append({"damage": what[0], "changed": changed, **res})
        if res["status"] == "hang" and check == "sample" and name == "s.h5":
            shutil.rmtree(work.parent)
            return
        assert res["status"] == "exit", (what, res)
        assert res["foreign"] is None, (what, res)
        if changed:
            assert res["verify_ok"] is False, (what, res)
            assert any(target.name in p for p in res["problems"]), (what, res)
            assert res["wrong"] == 0, (f"check={check!r} let damaged pixels through", what, res)
        shutil.rmtree(work.parent)

    case()
    summary = {k: sum(1 for o in outcomes if cond(o)) for k, cond in {
        "cases": lambda o: True,
        "changed": lambda o: o["changed"],
        "error_at_open": lambda o: o.get("open"),
        "error_at_read": lambda o: o.get("read_errors"),
        "wrong_pixels_read": lambda o: o.get("wrong"),
        "reported_by_verify": lambda o: o.get("verify_ok") is False,
        "hangs": lambda o: o["status"] == "hang",
    }.items()}
    print(f"\n{name} check={check} damage summary: {json.dumps(summary)}")
