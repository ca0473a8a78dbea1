"""The Run tab, headless: the health of a real AdamW run (injected spike and frozen layer),
its heatmap, a parameter opened at another step, and two steps compared."""

from __future__ import annotations

from pathlib import Path

from inspector.ui.widgets import Inspector
from inspector.ui.widgets.app import RUN_TAB, TABS
from tests.conftest import FAULTS
from tests.ui.test_widgets import errors_shown

PNG = b"\x89PNG"
KEY = "layers.1.attention.wq.weight"


def test_run_tab_health_open_and_compare(faulty_run: Path) -> None:
    app = Inspector(faulty_run)
    app.header.wait()
    assert app.run is not None and app.tabs.titles == (*TABS, RUN_TAB)
    app.run.check_button.click()
    app.run.wait()
    report = app.run.report
    assert report is not None and errors_shown(app) == ""
    assert "update-outlier" in app.run.findings.value and "frozen" in app.run.findings.value
    assert bytes(app.run.heatmap.value).startswith(PNG)
    first = bytes(app.run.heatmap.value)
    app.run.metric.value = "l2"
    assert bytes(app.run.heatmap.value).startswith(PNG) and bytes(app.run.heatmap.value) != first
    spiked = {f.key for f in report.findings if f.layer == FAULTS.spike_layer}
    assert KEY in spiked and KEY in app.run.parameter.options

    app.run.parameter.value = KEY
    app.run.step.value = app.run.step.options[1][1]  # step-20
    app.run.open_button.click()
    assert errors_shown(app) == "" and app.ck.location.endswith("step-20")
    assert app.tree.selected == KEY
    assert app.run is not None and [s.opened for s in app.run.steps] == [False, True, False, False]

    app.run.step_a.value, app.run.step_b.value = app.run.steps[1], app.run.steps[2]
    app.run.compare_button.click()
    app.run.wait()
    found = app.run.comparison
    assert found is not None and not found.same
    row = found.table.set_index("key").loc[KEY]
    step_20 = app.ck.read(KEY)
    app.open_at(app.run.steps[2], KEY)
    assert app.ck.location.endswith("step-30") and app.tree.selected == KEY
    diff = (app.ck.read(KEY) - step_20).abs().max()  # float32, as the diff computes it
    assert row["status"] == "values" and row["max_abs_diff"] == float(diff)
    app.close()


def test_no_run_tab_for_a_lone_checkpoint(faulty_run: Path) -> None:
    app = Inspector(faulty_run / "step-10")
    app.header.wait()
    assert app.run is None and app.tabs.titles == TABS
    app.close()
