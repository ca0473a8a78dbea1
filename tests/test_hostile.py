"""Hostile and broken checkpoints (tests/hostile/): nothing from them runs, nothing crashes,
every error names the file and the key, and the undamaged rest opens, reads and exports.

Each case goes through ``inspector.open``, ``table``, ``scan``, reading every entry, ``diff``
and ``export`` (safetensors and pt, skipping and failing) inside the audit-hook guard,
with its time and memory measured.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import inspector
from inspector.errors import InspectorError
from tests.fixtures.damage import tree_hash
from tests.hostile import damage, paths, pickles
from tests.hostile.case import Case
from tests.hostile.guard import GuardViolation, guarded
from tests.hostile.pipeline import Probe, explore, export_options, usage
from tests.hostile.tally import TALLY

CASES = {**pickles.CASES, **paths.CASES, **damage.CASES}
SECONDS = 1.0  # to open, and to any error: a generous bound for files of a few MB
TRACED_BYTES = 64 << 20  # Python allocations of a whole case
RSS_BYTES = 256 << 20  # resident set growth of a whole case


def says_where(error: InspectorError, case: Case, key: str | None) -> None:
    """The message names the file, the key (when one is involved) and what is wrong."""
    text = str(error)
    assert case.file in text, f"{case.file!r} not named in: {text}"
    assert key is None or repr(key) in text, f"{key!r} not named in: {text}"
    assert case.says is None or case.says in text, f"{case.says!r} not said in: {text}"


def check_refused(case: Case, probe: Probe) -> None:
    _, error = probe.call("open", inspector.open, case.path)
    assert isinstance(error, case.error), error
    says_where(error, case, None)


def check_partial(case: Case, probe: Probe, out: Path) -> None:
    ck, errors = explore(probe, case.path)
    assert ck is not None, f"refused as a whole: {errors}"
    assert set(errors) == case.bad
    for key, error in errors.items():
        assert isinstance(error, case.error), error
        says_where(error, case, key)
    table = ck.table()
    assert set(table.key[table.error.notna()]) == case.bad
    if case.reference is not None:
        rows, error = probe.call(
            "diff with the genuine checkpoint",
            inspector.diff,
            ck,
            case.reference,
            key_map=None,
            exclude=sorted(case.bad),
            progress=False,
        )
        assert error is None and rows.status.eq("same").all(), rows[rows.status != "same"]
        assert set(rows.key) == set(ck.keys()) - case.bad
    _, error = probe.call("diff with itself", inspector.diff, ck, ck, progress=False)
    assert (error is None) == (not case.bad) and (error is None or error.key in case.bad)
    for fmt in ("safetensors", "pt"):
        check_exports(case, probe, out / fmt, fmt)


def check_exports(case: Case, probe: Probe, out: Path, fmt: str) -> None:
    """Skipping leaves out exactly the unreadable keys (and says so); failing names one of
    them and leaves no file behind."""
    ck = inspector.open(case.path)
    options = export_options(ck, fmt)
    target = out / ("skip.pt" if fmt == "pt" else "skip")
    result, error = probe.call(
        f"export {fmt}", inspector.export, case.path, target, on_error="skip", **options
    )
    assert error is None, error
    assert result.verification.ok, result.verification
    exportable = {
        k for k in case.bad - set(options["exclude"]) if fmt == "pt" or ck.entry(k).kind == "tensor"
    }
    unreadable = {k for k, why in result.skipped.items() if why.startswith("unreadable")}
    assert unreadable == exportable, result.skipped
    if exportable:
        failing = out / ("fail.pt" if fmt == "pt" else "fail")
        _, error = probe.call(
            f"export {fmt}, failing", inspector.export, case.path, failing, **options
        )
        assert error is not None and error.key in exportable, error
        assert not failing.exists() or not any(p.is_file() for p in failing.rglob("*"))
    assert not list(out.rglob("*.tmp"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name: str, genuine, tmp_path: Path) -> None:
    TALLY.cases += 1
    case = CASES[name](genuine, tmp_path / "case")
    before = tree_hash(case.path)
    probe = Probe()
    with usage() as used, guarded(tmp_path):
        if case.refused:
            check_refused(case, probe)
        else:
            check_partial(case, probe, tmp_path / "out")
    assert tree_hash(case.path) == before, "the source changed"
    assert case.marker is None or not case.marker.exists()
    assert case.victim is None or case.victim.is_dir()
    TALLY.measured(name, probe.slowest, used.traced_peak, used.rss_growth)
    assert probe.slowest_error[0] < SECONDS, probe.slowest_error
    assert used.traced_peak < TRACED_BYTES and used.rss_growth < RSS_BYTES, used


def test_case_names_cover_the_issue() -> None:
    """Every payload in every pickle location, every path escape, every kind of damage."""
    assert len(pickles.CASES) == 8 * 6
    assert {n.split("@")[1] for n in paths.CASES} == {
        "relative_path",
        "distcp",
        "weight_map",
        "shard",
    }
    assert len(CASES) == len(pickles.CASES) + len(paths.CASES) + len(damage.CASES)


# --- the guard itself must catch what it is there to catch ---------------------------------


def test_guard_stops_a_shell_command(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    with pytest.raises(GuardViolation, match=r"os\.system"), guarded(tmp_path):
        os.system(f"touch {marker}")
    assert not marker.exists()


def test_guard_stops_a_subprocess(tmp_path: Path) -> None:
    with pytest.raises(GuardViolation, match=r"subprocess\.Popen"), guarded(tmp_path):
        subprocess.run(["true"], check=False)


def test_guard_stops_code_from_a_string(tmp_path: Path) -> None:
    with pytest.raises(GuardViolation, match="compile"), guarded(tmp_path):
        eval("1 + 1")


def test_guard_stops_writes_outside_the_folder(tmp_path: Path) -> None:
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    with pytest.raises(GuardViolation, match="open for writing"), guarded(tmp_path / "in"):
        outside.write_text("x")
    assert not outside.exists()


def test_guard_stops_a_new_import(tmp_path: Path) -> None:
    sys.modules.pop("colorsys", None)
    with pytest.raises(GuardViolation, match="colorsys"), guarded(tmp_path):
        import colorsys  # noqa: F401


def test_guard_fails_even_when_the_violation_is_swallowed(tmp_path: Path) -> None:
    careless = contextlib.suppress(BaseException)  # what careless code under test might do
    with pytest.raises(GuardViolation, match=r"os\.system"), guarded(tmp_path), careless:
        os.system("true")


def test_guard_allows_reading_and_writing_inside(tmp_path: Path, genuine) -> None:
    with guarded(tmp_path):
        inspector.export(genuine.seed, tmp_path / "out", progress=False)
        assert inspector.open(tmp_path / "out").keys()
