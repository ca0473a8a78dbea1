"""Run: the health of the training run a checkpoint was opened from (a layer x step heatmap of
a chosen metric and the findings), a tensor opened at any step, and two steps compared."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import ipywidgets as w

import inspector
from inspector.analysis.comparison import Comparison, compare
from inspector.analysis.health import METRICS, HealthReport, health
from inspector.checkpoint import Checkpoint
from inspector.formats.base import Step
from inspector.ui.views.plots import png
from inspector.ui.widgets.compare import comparison_html
from inspector.ui.widgets.errors import ErrorBox
from inspector.ui.widgets.jobs import JobBar
from inspector.ui.widgets.markup import badge, heading, note, table

FINDING_COLUMNS = ("severity", "step", "layer", "kind", "message")
ROWS_SHOWN = 200


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
        self.ck, self.steps, self.open_at = ck, steps, open_at
        self.storage_options = dict(storage_options or {}) or None
        self.report: HealthReport | None = None
        self.comparison: Comparison | None = None
        self.check_button = w.Button(description="Check run health", button_style="primary")
        self.metric = w.Dropdown(options=METRICS, value="update_ratio", description="Metric")
        self.job = JobBar(errors, "The run health check")
        self.heatmap = w.Image(format="png", layout=w.Layout(display="none", width="560px"))
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
