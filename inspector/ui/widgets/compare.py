"""Compare: another checkpoint (path or URL) key by key, with fingerprints and a per-layer plot."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ipywidgets as w

import inspector
from inspector.analysis.comparison import Comparison, compare
from inspector.analysis.diff import plot_layer_differences
from inspector.checkpoint import Checkpoint
from inspector.ui.views.compare import SHOWN_COLUMNS, comparison_rows
from inspector.ui.views.plots import png
from inspector.ui.widgets.errors import ErrorBox
from inspector.ui.widgets.jobs import JobBar
from inspector.ui.widgets.markup import badge, esc, heading, note, table

ROWS_SHOWN = 200


def comparison_html(found: Comparison) -> str:
    """The verdict, the fingerprints, the rows per status and the table, differences first."""
    counts = {s: n for s, n in found.counts.items() if n}
    what = "model keys" if found.model_only else "keys"
    if found.same:
        verdict = badge("same", "ok") + f" all {len(found.table):,} compared {what} are the same"
    else:
        shown = ", ".join(f"{n:,} {s}" for s, n in counts.items())
        verdict = badge("different", "bad") + f" {esc(shown)}"
    prints = (
        badge("fingerprints equal", "ok")
        if found.fingerprints_equal
        else badge("fingerprints differ", "warn")
    )
    digests = f"{found.digest_a} (this) vs {found.digest_b} (other)"
    rows = comparison_rows(found, ROWS_SHOWN)
    more = max(0, len(found.table) - ROWS_SHOWN)
    return (
        f"<div>{verdict}</div>"
        f'<div style="margin:4px 0">{prints} <span class="inspector-note">model weights, '
        f"BLAKE3: {esc(digests)}</span></div>"
        + note(f"this: {found.a}; other: {found.b}; keys paired by key_map='auto'")
        + heading(f"compared {what} ({len(found.table):,}), differences first")
        + table(tuple(SHOWN_COLUMNS.values()), rows, more=more)
    )


class ComparePanel(w.VBox):
    """Type another checkpoint and press Compare; the comparison runs in a worker thread."""

    def __init__(
        self,
        ck: Checkpoint,
        errors: ErrorBox,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.ck, self.errors, self.storage_options = ck, errors, storage_options
        self.comparison: Comparison | None = None
        self.other = w.Text(
            description="Compare with",
            placeholder="another checkpoint: a path or URL",
            layout=w.Layout(width="560px"),
            style={"description_width": "110px"},
        )
        self.model_only = w.Checkbox(value=True, description="model weights only")
        self.compare_button = w.Button(description="Compare", button_style="primary", icon="clone")
        self.job = JobBar(errors, "The comparison")
        self.result = w.HTML(
            note(
                "Keys are paired by the FQN doctor (key_map='auto': a 'model.' prefix or wrapper "
                "segments do not count); equal fingerprint digests settle a pair without "
                "comparing values."
            )
        )
        self.plot = w.Image(format="png", layout=w.Layout(display="none", width="520px"))
        for widget, name in (
            (self.other, "compare-with"),
            (self.compare_button, "compare"),
            (self.result, "compare-result"),
            (self.plot, "compare-plot"),
        ):
            widget.add_class(f"inspector-{name}")
        self.compare_button.on_click(errors.guard("The comparison")(lambda _: self.start()))
        row = w.HBox([self.other, self.model_only, self.compare_button])
        super().__init__([row, self.job, self.result, self.plot])

    def start(self) -> None:
        """Open the other checkpoint here (errors show at once), compare in the background."""
        text = self.other.value.strip()
        if not text:
            raise ValueError("nothing to compare with: give a checkpoint path or URL")
        other = inspector.open(text, dict(self.storage_options or {}) or None)
        model_only = self.model_only.value
        self.comparison = None
        self.result.value = note(f"comparing with {other.location} ...")
        self.plot.layout.display = "none"
        self.job.run(
            lambda report, cancel: compare(
                self.ck,
                other,
                model_only=model_only,
                on_progress=report.phase("comparing"),
                cancel=cancel,
            ),
            self._shown,
        )

    def wait(self, timeout: float | None = None) -> None:
        self.job.wait(timeout)

    def _shown(self, found: Comparison) -> None:
        self.comparison = found
        self.result.value = comparison_html(found)
        self.plot.value = png(plot_layer_differences(found.table))
        self.plot.layout.display = ""
