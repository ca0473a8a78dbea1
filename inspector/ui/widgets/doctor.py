"""FQN check: compare with another checkpoint or a ``module:factory`` model; apply the fix."""

from __future__ import annotations

from collections.abc import Callable

import ipywidgets as w

from inspector.analysis.fqn import KeyReport, check_keys, resolve_against
from inspector.checkpoint import Checkpoint
from inspector.keys.spellings import VIEWS
from inspector.ui.widgets.errors import ErrorBox
from inspector.ui.widgets.markup import badge, esc, heading, limited, note

SHOWN = 20


def _shown(value: object) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)


def report_html(report: KeyReport) -> str:
    """The verdict, the explanation, each kind of mismatch and the ranked rewrites."""
    verdict = badge("match", "ok") if report.ok else badge("mismatch", "bad")
    parts = [f"<div>{verdict} <span>{esc(report.explain())}</span></div>"]
    for title, keys in (
        ("missing from the checkpoint", report.missing),
        ("unexpected in the checkpoint", report.unexpected),
    ):
        if keys:
            parts.append(heading(f"{title} ({len(keys):,})"))
            parts.append(limited(("key",), [(k,) for k in keys], SHOWN))
    for name, found in (("shape", report.shape_mismatches), ("dtype", report.dtype_mismatches)):
        if found:
            rows = [
                (m.checkpoint_key, m.model_key, _shown(m.checkpoint), _shown(m.model))
                for m in found
            ]
            parts.append(heading(f"{name} mismatches ({len(found):,})"))
            header = ("checkpoint key", "model key", "checkpoint", "model")
            parts.append(limited(header, rows, SHOWN))
    if report.suggestions:
        suggested = [
            (i, s.description, s.why or "", s.resolves, s.remaining, s.shape_mismatches)
            for i, s in enumerate(report.suggestions, 1)
        ]
        parts.append(heading("suggested rewrites of the checkpoint keys, best first"))
        columns = ("#", "rewrite", "why", "resolves", "left", "shape mismatches")
        parts.append(limited(columns, suggested, SHOWN))
    return "".join(parts)


class DoctorPanel(w.VBox):
    """Check the checkpoint's model keys; ``on_apply`` receives the report to export with."""

    def __init__(
        self, ck: Checkpoint, errors: ErrorBox, on_apply: Callable[[KeyReport], None]
    ) -> None:
        self.ck = ck
        self.on_apply = on_apply
        self.report: KeyReport | None = None
        self.against = w.Text(
            description="Compare with",
            placeholder="another checkpoint path, or module.path:factory",
            layout=w.Layout(width="560px"),
            style={"description_width": "110px"},
        )
        self.spelling = w.Dropdown(
            options=[("auto", None), *((v, v) for v in VIEWS)],
            description="Spelling",
            layout=w.Layout(width="220px"),
        )
        self.check_button = w.Button(description="Check", button_style="primary", icon="search")
        self.apply_button = w.Button(
            description="Apply best rewrite to export",
            icon="wrench",
            disabled=True,
            layout=w.Layout(width="260px"),
        )
        self.result = w.HTML(
            note(
                "A model is built on the meta device from module.path:factory "
                "(e.g. inspector.demo.model:build_model); nothing is loaded."
            )
        )
        self.result.add_class("inspector-doctor")
        self.check_button.on_click(errors.guard("The FQN check")(lambda _: self.check()))
        self.apply_button.on_click(errors.guard("Applying the rewrite")(lambda _: self.apply()))
        row = w.HBox([self.against, self.spelling, self.check_button])
        super().__init__([row, self.result, self.apply_button])

    def check(self) -> None:
        self.report = None
        self.apply_button.disabled = True
        self.result.value = ""
        against = resolve_against(self.against.value)
        self.report = check_keys(self.ck, against, spelling=self.spelling.value)
        self.result.value = report_html(self.report)
        self.apply_button.disabled = self.report.best is None

    def apply(self) -> None:
        if self.report is not None:
            self.on_apply(self.report)
