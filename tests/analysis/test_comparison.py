"""Comparing two checkpoints for the app: pairs by key_map="auto", fingerprints, model
digests, progress in bytes and cancellation between pairs."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import inspector
from inspector.analysis.comparison import compare
from inspector.progress import Cancelled
from inspector.ui.views.compare import comparison_rows

WQ = "layers.0.attention.wq.weight"


def test_same_weights_in_another_layout(demo_dir: Path) -> None:
    flat, prefixed = inspector.open(demo_dir / "flat"), inspector.open(demo_dir / "prefixed")
    reports: list[tuple[int, int]] = []
    found = compare(flat, prefixed, on_progress=lambda d, t: reports.append((d, t)))
    assert found.same and found.fingerprints_equal and len(found.table) == 21
    assert found.counts["same"] == 21 and set(found.table["key_b"]) == {
        f"model.{e.key}" for e in flat.entries() if e.component == "model"
    }
    model_bytes = sum(e.nbytes for e in flat.entries() if e.component == "model")
    assert reports[0] == (0, 2 * model_bytes) and reports[-1] == (2 * model_bytes,) * 2
    assert len(reports) == 22  # the start, then one per pair


def test_other_values_differ_first_in_the_rows(demo_dir: Path) -> None:
    flat, fp8 = inspector.open(demo_dir / "flat"), inspector.open(demo_dir / "fp8")
    everything = compare(flat, fp8, model_only=False)
    assert not everything.same and not everything.fingerprints_equal
    assert len(everything.table) == len(flat.keys())
    row = everything.table.set_index("key").loc[WQ]
    assert row["status"] == "values"
    assert row["max_abs_diff"] == (flat.read(WQ) - fp8.read(WQ)).abs().max().item()
    rows = comparison_rows(everything)
    statuses = [r[0] for r in rows]
    assert statuses.index("same") > statuses.index("values")  # differences first
    assert all(s == "same" for s in statuses[statuses.index("same") :])


def test_cancel_stops_between_pairs(demo_dir: Path) -> None:
    flat, prefixed = inspector.open(demo_dir / "flat"), inspector.open(demo_dir / "prefixed")
    cancel = threading.Event()
    seen: list[int] = []

    def stop_after_three(done: int, total: int) -> None:
        seen.append(done)
        if len(seen) == 4:
            cancel.set()

    with pytest.raises(Cancelled):
        compare(flat, prefixed, on_progress=stop_after_three, cancel=cancel)
    assert len(seen) == 4  # the start and three pairs, then no further pair
