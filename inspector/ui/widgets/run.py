"""Run: the health of the training run a checkpoint was opened from (a layer x step heatmap of
a chosen metric, whose cells open their tensor at their step, and the findings), a tensor
opened at any step, and two steps compared."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import ipywidgets as w

import inspector
from inspector.analysis.comparison import Comparison, compare
from inspector.analysis.health import METRICS, HealthReport, ParamHealth, health
from inspector.checkpoint import Checkpoint
from inspector.formats.base import Step
from inspector.ui.views.plots import bounded_label, png
from inspector.ui.widgets.compare import comparison_html
from inspector.ui.widgets.errors import ErrorBox
from inspector.ui.widgets.jobs import JobBar
from inspector.ui.widgets.markup import badge, heading, note, table

FINDING_COLUMNS = ("severity", "step", "layer", "kind", "message")
ROWS_SHOWN = 200
CELL_GROUPS = 200  # heatmap rows given clickable cells
CELL_WIDTH = "64px"


def cell_parameters(report: HealthReport, metric: str) -> dict[tuple[str, str], str]:
    """(group, step name) -> the parameter its heatmap cell opens: of the group's parameters
    at that step, the one with the largest ``metric`` (the one that drives the cell)."""
    best: dict[tuple[str, str], ParamHealth] = {}
    for row in report.rows:
        cell = (row.group, row.step_name)
        if cell not in best or _value(row, metric) > _value(best[cell], metric):
            best[cell] = row
    return {cell: row.key for cell, row in best.items()}


def _value(row: ParamHealth, metric: str) -> float:
    value = getattr(row, metric)
    return -math.inf if value is None or math.isnan(value) else float(value)


def _colours(values: list[list[float]]) -> list[list[str]]:
    """viridis colours of the values (a log scale when all are positive); grey for none."""
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm, Normalize, to_hex

    seen = [v for row in values for v in row if math.isfinite(v)]
    positive = bool(seen) and min(seen) > 0 and max(seen) > min(seen)
    norm = (LogNorm if positive else Normalize)(min(seen, default=0), max(seen, default=1))
    cmap = colormaps["viridis"]
    return [
        [to_hex(cmap(norm(v))) if math.isfinite(v) else "#dddddd" for v in row] for row in values
    ]


def findings_html(report: HealthReport) -> str:
    """The verdict and every finding, in step order."""
    if report.ok:
        return f"<div>{badge('healthy', 'ok')} {len(report.steps)} steps: nothing looks wrong</div>"
    tone = "bad" if report.has_errors else "warn"
    rows = [
        [f.severity, f.step_name, "" if f.layer is None else str(f.layer), f.kind, f.message]
        for f in report.findings
    ]
    return (
        f"<div>{badge(f'{len(rows)} findings', tone)}</div>"
        + heading("findings, by step")
        + table(FINDING_COLUMNS, rows[:ROWS_SHOWN], more=max(0, len(rows) - ROWS_SHOWN))
    )


class RunPanel(w.VBox):
    """Check the run's health (a worker reads every step once); choose a metric for the
    heatmap, a parameter and a step to open, or two steps to compare."""

    def __init__(
        self,
        ck: Checkpoint,
        steps: tuple[Step, ...],
        errors: ErrorBox,
        open_at: Callable[[Step, str], None],
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.ck, self.steps, self.open_at, self.errors = ck, steps, open_at, errors
        self.storage_options = dict(storage_options or {}) or None
        self.report: HealthReport | None = None
        self.comparison: Comparison | None = None
        self.check_button = w.Button(description="Check run health", button_style="primary")
        self.metric = w.Dropdown(options=METRICS, value="update_ratio", description="Metric")
        self.job = JobBar(errors, "The run health check")
        self.heatmap = w.Image(format="png", layout=w.Layout(display="none", width="560px"))
        self.cells = w.GridBox(layout=w.Layout(display="none"))
        self.findings = w.HTML(note(f"{len(steps)} saved steps: press Check run health."))
        options = [(s.name, s) for s in steps]
        self.parameter = w.Dropdown(description="Parameter", options=[])
        self.step = w.Dropdown(description="Step", options=options)
        self.open_button = w.Button(description="Open at step", icon="folder-open")
        self.step_a = w.Dropdown(description="Compare", options=options)
        self.step_b = w.Dropdown(description="with", options=options, value=steps[-1])
        self.compare_button = w.Button(description="Compare steps", icon="clone")
        self.compared = w.HTML()
        self.check_button.on_click(errors.guard("The run health check")(lambda _: self.start()))
        self.metric.observe(lambda _: self._draw(), names="value")
        self.open_button.on_click(errors.guard("Opening the step")(lambda _: self.open_chosen()))
        self.compare_button.on_click(errors.guard("The comparison")(lambda _: self.compare()))
        super().__init__(
            [
                w.HBox([self.check_button, self.metric]),
                self.job,
                self.heatmap,
                self.cells,
                w.HBox([self.parameter, self.step, self.open_button]),
                self.findings,
                w.HBox([self.step_a, self.step_b, self.compare_button]),
                self.compared,
            ]
        )

    def start(self) -> None:
        self.job.run(
            lambda report, cancel: health(
                self.ck,
                storage_options=self.storage_options,
                on_progress=report.phase("reading steps"),
                cancel=cancel,
            ),
            self.show,
        )

    def show(self, report: HealthReport) -> None:
        self.report = report
        self.parameter.options = list(dict.fromkeys(r.key for r in report.rows))
        self.findings.value = findings_html(report)
        self._draw()

    def _draw(self) -> None:
        if self.report is None:
            return
        self.heatmap.value = png(self.report.plot(self.metric.value))
        self.heatmap.layout.display = ""
        self._draw_cells(self.report, self.metric.value)

    def _draw_cells(self, report: HealthReport, metric: str) -> None:
        """The heatmap as a grid of buttons, one per (group, step): a click opens the tensor."""
        groups, names, values = report.grid(metric)
        groups, values = groups[:CELL_GROUPS], values[:CELL_GROUPS]
        colours, keys = _colours(values), cell_parameters(report, metric)
        steps = {s.name: s for s in self.steps}
        children: list[w.Widget] = [w.Label("click a cell to open it")]
        children += [w.Label(bounded_label(n)) for n in names]
        for group, row, shades in zip(groups, values, colours, strict=True):
            children.append(w.Label(bounded_label(group)))
            children += [
                self._cell(keys.get((group, name)), steps[name], f"{group}, {metric}", value, shade)
                for name, value, shade in zip(names, row, shades, strict=True)
            ]
        for old in self.cells.children:  # the last metric's cells, freed in the kernel
            old.close()
        self.cells.children = children
        self.cells.layout = w.Layout(
            grid_template_columns=f"auto repeat({len(names)}, {CELL_WIDTH})", grid_gap="1px"
        )

    def _cell(self, key: str | None, step: Step, what: str, value: float, shade: str) -> w.Button:
        """One cell: ``value`` on its colour (``what``: the group and metric, for its tooltip);
        a click opens ``key`` at ``step``."""
        shown = f"{value:.2g}" if math.isfinite(value) else "-"
        button = w.Button(
            description=shown,
            tooltip=f"{what} at {step.name} = {shown}; click to open {key}",
            disabled=key is None,
            layout=w.Layout(width=CELL_WIDTH, height="22px", padding="0"),
            style={"button_color": shade, "font_size": "10px"},
        )
        if key is not None:
            button.on_click(
                self.errors.guard("Opening the cell")(lambda _: self.open_cell(step, key))
            )
        return button

    def open_cell(self, step: Step, key: str) -> None:
        """Open the parameter ``key`` at ``step`` (a heatmap cell's click), and show both in
        the pickers."""
        self.parameter.value, self.step.value = key, step
        self.open_at(step, key)

    def open_chosen(self) -> None:
        """Open the chosen parameter at the chosen step (the app opens that step)."""
        if self.parameter.value is None:
            raise ValueError("no parameter chosen: check the run's health first")
        self.open_at(self.step.value, self.parameter.value)

    def compare(self) -> None:
        a, b = (
            inspector.open(s.location, self.storage_options)
            for s in (self.step_a.value, self.step_b.value)
        )
        self.compared.value = note(
            f"comparing {self.step_a.value.name} with {self.step_b.value.name} ..."
        )
        self.job.run(
            lambda report, cancel: compare(
                a, b, on_progress=report.phase("comparing"), cancel=cancel
            ),
            self._compared,
        )

    def _compared(self, found: Comparison) -> None:
        self.comparison = found
        self.compared.value = comparison_html(found)

    def wait(self, timeout: float | None = None) -> None:
        self.job.wait(timeout)
