"""``Inspector``: the whole app in one widget (header of findings; keys and tensor, compare,
audit, FQN check and export tabs)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import ipywidgets as w

import inspector
from inspector.analysis.audit import AuditReport
from inspector.analysis.fqn import KeyReport
from inspector.analysis.health import stored_key
from inspector.checkpoint import Checkpoint
from inspector.formats.base import Step
from inspector.keys.tree import KeyNode
from inspector.storage.remote import display_url, is_url
from inspector.ui.views.findings import Findings
from inspector.ui.widgets.audit import AuditPanel
from inspector.ui.widgets.compare import ComparePanel
from inspector.ui.widgets.doctor import DoctorPanel
from inspector.ui.widgets.errors import ErrorBox
from inspector.ui.widgets.export import ExportPanel
from inspector.ui.widgets.header import Header, HeaderActions
from inspector.ui.widgets.markup import STYLE, note
from inspector.ui.widgets.run import RunPanel
from inspector.ui.widgets.tensor import TensorPanel
from inspector.ui.widgets.tree import TreePanel

TABS = ("Keys", "Compare", "Audit", "FQN check", "Export")
RUN_TAB = "Run"  # after TABS, when the checkpoint belongs to a run folder


def close_all(widget: w.Widget) -> None:
    """Close a widget and every widget inside it: ipywidgets keeps open ones (and, through
    their callbacks, the checkpoint) alive."""
    for child in getattr(widget, "children", ()):
        close_all(child)
    widget.close()


class Inspector(w.VBox):
    """``display(inspector.Inspector(path))``: browse, diagnose and export one checkpoint.

    A path that cannot be opened shows why inside the app; type another and press Open.
    The path box takes local paths and s3://, gs://, hf://, http(s):// URLs, opened with
    ``storage_options`` (fsspec's: endpoint_url, key, secret, token, anon, ...). The panels
    (``header``, ``tree``, ``tensor``, ``compare``, ``audit``, ``doctor``, ``export``) exist
    once a checkpoint is open, each tab with its own error box (``tab_errors``); ``ck`` is
    the opened :class:`~inspector.checkpoint.Checkpoint`.
    The header's findings arrive from a worker thread moments after the first view
    (``app.header.wait()`` blocks until they are in).
    """

    def __init__(
        self,
        path_or_ck: str | os.PathLike | Checkpoint,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.ck: Checkpoint | None = None
        self.run_steps: tuple[Step, ...] = ()  # a run root's steps, kept while one is open
        self.storage_options = dict(storage_options or {}) or None
        self.errors = ErrorBox()
        is_ck = isinstance(path_or_ck, Checkpoint)
        self.path = w.Text(
            value=path_or_ck.location if isinstance(path_or_ck, Checkpoint) else str(path_or_ck),
            description="Checkpoint",
            layout=w.Layout(width="640px"),
        )
        self.open_button = w.Button(description="Open", icon="folder-open")
        self.open_button.on_click(
            self.errors.guard("Opening the checkpoint")(lambda _: self.load())
        )
        self.path.add_class("inspector-path")
        self.open_button.add_class("inspector-open")
        self.opening = w.HTML()
        self.body = w.VBox()
        super().__init__(
            [
                w.HTML(STYLE),
                w.HBox([self.path, self.open_button]),
                self.opening,
                self.errors,
                self.body,
            ]
        )
        self.add_class("inspector-app")
        if is_ck:
            self.errors.guard("Showing the checkpoint")(self._show)(path_or_ck)
        else:
            self.errors.guard("Opening the checkpoint")(self.load)()

    def __repr__(self) -> str:
        if self.ck:
            return f"<Inspector {self.ck!r}>"
        path = self.path.value.strip()
        return f"<Inspector: {display_url(path) if is_url(path) else path} not open>"

    def load(self) -> None:
        """Open the checkpoint at the path box's value and show it (when it cannot be opened,
        the checkpoint shown stays, under the error)."""
        self._open(self.path.value.strip(), ())

    def open_step(self, step: Step) -> None:
        """Open another saved step of the run the path box names (the step picker)."""
        steps = self.run_steps or (self.ck.steps if self.ck is not None else ())
        self._open(
            step.location,
            tuple(Step(s.name, s.number, s.location, s.location == step.location) for s in steps),
        )

    def open_at(self, step: Step, name: str) -> None:
        """Open a saved step and show the model parameter ``name`` in it (the Run tab)."""
        self.open_step(step)
        if self.ck is not None:
            self.tree.select(stored_key(self.ck, name))

    def _open(self, location: str, run_steps: tuple[Step, ...]) -> None:
        self.opening.value = note(f"opening {location} ...")
        try:
            ck = inspector.open(location, self.storage_options)
        finally:
            self.opening.value = ""
        self.run_steps = run_steps
        self._show(ck)

    def close(self) -> None:
        """Close the whole app, so that it and its checkpoint can be freed."""
        for child in self.children:
            close_all(child)
        super().close()

    def _replace_body(self, children: list[w.Widget]) -> None:
        old = self.body.children
        self.body.children = children
        for widget in old:
            close_all(widget)

    def _show(self, ck: Checkpoint) -> None:
        self.ck = ck
        actions = HeaderActions(
            convert_fp8=self._convert_fp8,
            apply_fix=self._apply_fix,
            show_audit=lambda: self._select("Audit"),
            open_step=self.open_step,
            found=self._found,
        )
        self.header = Header(ck, self.errors, actions, steps=self.run_steps or ck.steps)
        self.tab_errors = boxes = {tab: ErrorBox() for tab in TABS}  # failures shown in place
        self.tensor = TensorPanel(ck, boxes["Keys"])
        self.tree = TreePanel(ck, boxes["Keys"], self.tensor, self._selected)
        self.compare = ComparePanel(ck, boxes["Compare"], self.storage_options)
        self.audit = AuditPanel(ck, boxes["Audit"], self._audited)
        tensor_bytes = self.header.summary.tensors.nbytes
        self.export = ExportPanel(ck, boxes["Export"], tensor_bytes, self.storage_options)
        self.doctor = DoctorPanel(ck, boxes["FQN check"], self._apply_rewrite)
        panels: list[w.Widget] = [self.tree, self.compare, self.audit, self.doctor, self.export]
        steps = self.run_steps or ck.steps
        self.run: RunPanel | None = None
        if steps:
            boxes[RUN_TAB] = ErrorBox()
            self.run = RunPanel(ck, steps, boxes[RUN_TAB], self.open_at, self.storage_options)
            panels.append(self.run)
        titles = (*TABS, RUN_TAB)[: len(panels)]
        self.tabs = w.Tab(
            children=[w.VBox([boxes[t], p]) for t, p in zip(titles, panels, strict=True)],
            titles=titles,
        )
        self.tabs.add_class("inspector-tabs")
        for finished in (
            self.tensor.job.finished,
            self.compare.job.finished,
            self.audit.job.finished,
            self.export.finished,
        ):
            finished.append(self.header.show_io)  # what was read so far
        self._replace_body([self.header, self.tabs])
        self.header.start()

    def _selected(self, node: KeyNode) -> None:
        self.tensor.show(node)
        self.header.show_io()

    def _select(self, tab: str) -> None:
        self.tabs.selected_index = TABS.index(tab)

    def _found(self, findings: Findings) -> None:
        """The header's worker is done: badges in the tree, the quick audit in its tab, the
        FP8 field and the Dequantize preset when there are FP8 or quantized weights."""
        self.tree.flags_found(findings.audit)
        fp8 = findings.fp8 is not None and findings.fp8.count > 0
        self.export.show_fp8(fp8 or bool(self.ck is not None and self.ck.logical))
        if findings.audit is not None:
            self.audit.quick(findings.audit)

    def _audited(self, report: AuditReport) -> None:
        """The Audit tab's full audit: its verdict in the header, its errors in the tree."""
        self.header.show_audit(report)
        self.tree.flags_found(report)

    def _convert_fp8(self, mode: str) -> None:
        fp8 = self.header.findings.fp8
        why = f"{fp8.count} FP8 tensors found." if fp8 is not None else ""
        self.export.preset_fp8(mode, why)
        self._select("Export")

    def _apply_fix(self, findings: Findings) -> None:
        report = findings.layout.report
        if report is not None:
            self._apply_rewrite(report)

    def _apply_rewrite(self, report: KeyReport) -> None:
        self.export.use_rewrite(report)
        self._select("Export")
