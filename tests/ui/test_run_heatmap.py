"""The Run tab's heatmap cells, headless: one button per layer and step, coloured and labelled
by the metric; a click opens, in the app, the layer's parameter that drives the cell at that
step."""

from __future__ import annotations

from pathlib import Path

import ipywidgets as w

import inspector
from inspector.analysis.health import health
from inspector.ui.widgets import Inspector
from inspector.ui.widgets.run import RunPanel, cell_parameters
from tests.conftest import FAULTS
from tests.ui.test_widgets import errors_shown

KEYS = ["layers.*.attention.wq.weight", "layers.*.feed_forward.w2.weight"]


def _cell(panel: RunPanel, group: str, step_name: str) -> w.Button:
    cells = list(panel.cells.children)
    width = 1 + len(panel.steps)
    names = [c.value for c in cells[1:width]]
    row = next(i for i in range(width, len(cells), width) if cells[i].value == group)
    button = cells[row + 1 + names.index(step_name)]
    assert isinstance(button, w.Button)
    return button


def test_cells_show_the_metric_and_open_their_tensor_at_their_step(faulty_run: Path) -> None:
    app = Inspector(faulty_run)
    app.header.wait()
    assert app.run is not None
    report = health(faulty_run, keys=KEYS)
    app.run.show(report)
    groups, names, grid = report.grid("update_ratio")
    assert len(app.run.cells.children) == (1 + len(names)) * (1 + len(groups))
    group = f"layer {FAULTS.spike_layer}"
    spiked = _cell(app.run, group, "step-30")
    assert spiked.description == f"{grid[groups.index(group)][2]:.2g}"
    assert spiked.style.button_color != _cell(app.run, "layer 0", "step-30").style.button_color
    assert _cell(app.run, group, "step-10").description == "-"  # no update into the first step
    app.run.metric.value = "l2"
    groups, _, norms = report.grid("l2")
    cell = _cell(app.run, "layer 0", "step-10")
    assert cell.description == f"{norms[groups.index('layer 0')][0]:.2g}"
    assert "l2" in cell.tooltip and "layers.0." in cell.tooltip
    app.run.metric.value = "update_ratio"
    assert spiked.comm is None  # the cells of a metric shown before are closed
    spiked = _cell(app.run, group, "step-30")

    # the layer's parameter with the larger update ratio at step-30, as torch computes it
    ratios = {}
    for key in ("attention.wq.weight", "feed_forward.w2.weight"):
        name = f"layers.{FAULTS.spike_layer}.{key}"
        before, after = (inspector.open(faulty_run / s).read(name) for s in ("step-20", "step-30"))
        ratios[name] = float((after - before).norm() / before.norm())
    expected = max(ratios, key=lambda k: ratios[k])
    assert cell_parameters(report, "update_ratio")[(group, "step-30")] == expected

    spiked.click()
    assert errors_shown(app) == ""
    assert app.ck.location.endswith("step-30") and app.tree.selected == expected
    assert app.tensor.entry is not None and app.tensor.entry.key == expected  # the tensor view
    app.close()
