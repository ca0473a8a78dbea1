"""Header: where the checkpoint is and what was read, its totals, and the findings that
matter (FP8, layout, audit, producer and step), each with the button that acts on it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import ipywidgets as w

from inspector.analysis.audit import AuditReport
from inspector.checkpoint import Checkpoint
from inspector.formats.base import Step
from inspector.keys.tree import Totals
from inspector.ui.views.findings import Finding, Findings, at_once, find, location_text
from inspector.ui.views.summary import Summary, summarize
from inspector.ui.views.text import human_bytes
from inspector.ui.widgets.errors import ErrorBox
from inspector.ui.widgets.jobs import JobBar
from inspector.ui.widgets.markup import badge, esc, pre, totals_table
from inspector.words import counted

TONE_BADGES = {"ok": "ok", "info": "info", "warn": "warn", "bad": "bad"}
TOPICS = {"fp8": "FP8", "layout": "layout", "audit": "audit", "producer": "producer"}


@dataclass
class HeaderActions:
    """What the header's buttons do (the app wires them to its tabs)."""

    convert_fp8: Callable[[str], None]
    apply_fix: Callable[[Findings], None]
    show_audit: Callable[[], None]
    open_step: Callable[[Step], None]
    found: Callable[[Findings], None]


def finding_html(found: Finding) -> str:
    """``[topic] title``, then what it means and what fixes it."""
    parts = [f"{badge(TOPICS[found.topic], TONE_BADGES[found.tone])} <b>{esc(found.title)}</b>"]
    if found.consequence:
        parts.append(
            f'<div class="inspector-note" style="margin-left:12px">{esc(found.consequence)}</div>'
        )
    if found.fix:
        parts.append(f'<div style="margin-left:12px">Fix: {esc(found.fix)}</div>')
    return f'<div class="inspector-finding" style="margin:3px 0">{"".join(parts)}</div>'


class Header(w.VBox):
    """Metadata at once; the findings that need a scan and a quick audit come from a worker
    thread moments later (``wait()`` blocks until they are there)."""

    def __init__(
        self,
        ck: Checkpoint,
        errors: ErrorBox,
        actions: HeaderActions,
        steps: tuple[Step, ...] = (),
    ) -> None:
        self.ck, self.actions = ck, actions
        self.findings = at_once(ck)
        self.summary = summarize(ck)  # also the Export panel's, so counted once
        self.where = w.HTML()
        self.totals = w.HTML(_totals(ck, self.summary))
        self.totals.add_class("inspector-totals")
        self.found = w.HTML()
        self.found.add_class("inspector-findings")
        self.fp8_button = w.Button(
            description="Convert FP8 and export", icon="magic", button_style="warning"
        )
        self.fix_button = w.Button(description="Apply the fix in Export", icon="wrench")
        self.audit_button = w.Button(description="Audit details", icon="stethoscope")
        self.steps = w.Dropdown(description="Step", layout=w.Layout(width="320px"))
        for widget, name in (
            (self.fp8_button, "convert-fp8"),
            (self.fix_button, "apply-fix"),
            (self.audit_button, "audit-details"),
            (self.steps, "steps"),
        ):
            widget.add_class(f"inspector-{name}")
            widget.layout.display = "none"
        self.fp8_button.layout.width = self.fix_button.layout.width = "220px"
        self.fp8_button.on_click(errors.guard("Presetting the export")(self._convert))
        self.fix_button.on_click(errors.guard("Applying the fix")(self._fix))
        self.audit_button.on_click(
            errors.guard("Showing the audit")(lambda _: actions.show_audit())
        )
        self.scan = JobBar(errors, "Scanning the checkpoint")
        self.where.add_class("inspector-where")
        self._show_steps(errors, steps)
        self.show()
        buttons = w.HBox([self.fp8_button, self.fix_button, self.audit_button, self.steps])
        super().__init__([self.where, self.found, buttons, self.scan, self.totals])
        self.add_class("inspector-header")

    def start(self) -> None:
        """Scan, ask the FQN doctor and audit in the background; show the findings after."""
        self.scan.run(
            lambda report, cancel: find(self.ck, report, cancel, self._early), self._found
        )

    def wait(self, timeout: float | None = None) -> None:
        self.scan.wait(timeout)

    def show(self) -> None:
        """The findings known now and what was read so far."""
        self.show_io()
        self.found.value = "".join(finding_html(f) for f in self.findings.lines())
        fp8, layout = self.findings.fp8, self.findings.layout
        self.fp8_button.layout.display = "" if fp8 is not None and fp8.count else "none"
        fixable = layout.report is not None and layout.report.best is not None
        self.fix_button.layout.display = "" if fixable else "none"
        self.audit_button.layout.display = "" if self.findings.audit is not None else "none"

    def show_audit(self, report: AuditReport) -> None:
        """A later audit's verdict (the Audit tab's, with CRC-32s) instead of the quick one."""
        self.findings = replace(self.findings, audit=report)
        self.show()

    def show_io(self) -> None:
        self.where.value = (
            f'<div style="font-size:14px"><code>{esc(location_text(self.ck))}</code></div>'
        )

    def _early(self, findings: Findings) -> None:
        """FP8 and layout while the quick audit still runs."""
        self.findings = findings
        self.show()

    def _found(self, findings: Findings) -> None:
        self.findings = findings
        self.show()
        self.actions.found(findings)

    def _convert(self, _button: object) -> None:
        if self.findings.fp8 is not None:
            self.actions.convert_fp8(self.findings.fp8.mode)

    def _fix(self, _button: object) -> None:
        self.actions.apply_fix(self.findings)

    def _show_steps(self, errors: ErrorBox, steps: tuple[Step, ...]) -> None:
        """The step picker, for a run's saved steps (``steps``: those of the run root the
        path box names, the open one marked)."""
        if not steps:
            return
        self.steps.options = [(_step_label(s), s) for s in steps]
        self.steps.value = next((s for s in steps if s.opened), steps[-1])
        self.steps.layout.display = ""
        self.steps.observe(errors.guard("Opening the step")(self._pick_step), "value")

    def _pick_step(self, change: dict) -> None:
        step = change["new"]
        if step is not None and not step.opened:
            self.actions.open_step(step)


def _step_label(step: Step) -> str:
    number = "release" if step.number is None else f"step {step.number:,}"
    return f"{number} ({step.name})" + (" - open" if step.opened else "")


def _totals(ck: Checkpoint, s: Summary) -> str:
    """Format, keys, parameters and bytes, files and ranks; the totals per dtype and component."""
    model = s.by_component.get("model", Totals())
    ranks = counted(s.ranks, "rank") if s.ranks else "ranks not recorded"
    line = (
        f"<b>{esc(ck.format)}</b> &middot; {counted(s.keys, 'key')} &middot; model: "
        f"{counted(model.numel, 'parameter')} ({human_bytes(model.nbytes)}) &middot; all "
        f"tensors: {s.tensors.count:,}, {human_bytes(s.tensors.nbytes)} &middot; "
        f"{counted(s.files, 'file')} &middot; {ranks}"
    )
    return (
        f"<div>{line}</div>"
        '<details><summary class="inspector-note">totals per dtype and component; how the '
        "layout was decided</summary>"
        '<div style="display:flex;gap:24px;flex-wrap:wrap">'
        f"<div>{totals_table('dtype', s.by_dtype)}</div>"
        f"<div>{totals_table('component', s.by_component)}</div></div>"
        f"{pre(ck.describe_layout())}</details>"
    )
