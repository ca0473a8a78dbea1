"""Audit: the header's quick audit at once; a full one (every CRC-32, optionally NaN / Inf)
in a worker thread; every finding by key and file."""

from __future__ import annotations

from collections.abc import Callable

import ipywidgets as w

from inspector.analysis.audit import AuditReport, audit
from inspector.checkpoint import Checkpoint
from inspector.ui.views.findings import audit_finding
from inspector.ui.views.health import COLUMNS, keys_named, problem_rows
from inspector.ui.widgets.errors import ErrorBox
from inspector.ui.widgets.jobs import JobBar
from inspector.ui.widgets.markup import badge, esc, heading, note, table

ROWS_SHOWN = 200
TONES = {"ok": "ok", "warn": "warn", "bad": "bad", "info": "info"}


def report_html(report: AuditReport) -> str:
    """The verdict, what was checked, the keys named and every problem, gravest first."""
    found = audit_finding(report)
    checked = report.checked.text() if report.checked else "nothing (no checkpoint opens)"
    rows = problem_rows(report)
    named = keys_named(report)
    parts = [
        f"<div>{badge('ok' if report.ok else 'problems', TONES[found.tone])} "
        f"<b>{esc(found.title)}</b></div>",
        note(f"checked: {checked}"),
    ]
    if named:
        shown = ", ".join(named[:10]) + (
            f" and {len(named) - 10:,} more" if len(named) > 10 else ""
        )
        parts.append(f"<div>keys with errors: <code>{esc(shown)}</code></div>")
    if rows:
        parts.append(heading(f"findings ({len(rows):,}), errors first"))
        parts.append(table(COLUMNS, rows[:ROWS_SHOWN], more=max(0, len(rows) - ROWS_SHOWN)))
    return "".join(parts)


class AuditPanel(w.VBox):
    """The audit report; Audit reads every record to check its CRC-32 (Cancel stops it)."""

    def __init__(
        self, ck: Checkpoint, errors: ErrorBox, on_report: Callable[[AuditReport], None]
    ) -> None:
        self.ck, self.on_report = ck, on_report
        self.report: AuditReport | None = None
        self.values = w.Checkbox(
            value=False,
            description="also count NaN / Inf (reads every tensor)",
            indent=False,
            layout=w.Layout(width="360px"),
        )
        self.audit_button = w.Button(
            description="Audit with CRC-32 checks", button_style="primary", icon="check"
        )
        self.audit_button.layout.width = "240px"
        self.job = JobBar(errors, "The audit")
        self.result = w.HTML(note("The header's quick audit is running ..."))
        self.audit_button.add_class("inspector-audit")
        self.result.add_class("inspector-audit-result")
        self.audit_button.on_click(errors.guard("The audit")(lambda _: self.start()))
        super().__init__([w.HBox([self.audit_button, self.values]), self.job, self.result])

    def quick(self, report: AuditReport) -> None:
        """Show the header's audit (files, sizes, completeness; no CRC-32s read)."""
        if self.report is None:
            self.show(report)

    def show(self, report: AuditReport) -> None:
        self.report = report
        self.result.value = report_html(report)

    def start(self) -> None:
        values = self.values.value
        self.result.value = note("auditing: reading every record for its CRC-32 ...")
        self.job.run(
            lambda report, cancel: audit(
                self.ck,
                checksums=True,
                values=values,
                on_progress=report.phase("checksums"),
                cancel=cancel,
            ),
            self._audited,
        )

    def _audited(self, report: AuditReport) -> None:
        self.show(report)
        self.on_report(report)

    def wait(self, timeout: float | None = None) -> None:
        self.job.wait(timeout)
