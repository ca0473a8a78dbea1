"""``Inspector``: the whole app in one widget (header, keys and tensor, FQN check, export)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import ipywidgets as w

import inspector
from inspector.analysis.fqn import KeyReport
from inspector.checkpoint import Checkpoint
from inspector.ui.widgets.doctor import DoctorPanel
from inspector.ui.widgets.errors import ErrorBox
from inspector.ui.widgets.export import ExportPanel
from inspector.ui.widgets.header import Header
from inspector.ui.widgets.markup import STYLE, note
from inspector.ui.widgets.tensor import TensorPanel
from inspector.ui.widgets.tree import TreePanel

TABS = ("Keys", "FQN check", "Export")


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
    (``header``, ``tree``, ``tensor``, ``doctor``, ``export``) exist once a
    checkpoint is open; ``ck`` is the opened :class:`~inspector.checkpoint.Checkpoint`.
    """

    def __init__(
        self,
        path_or_ck: str | os.PathLike | Checkpoint,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.ck: Checkpoint | None = None
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
        self.body = w.VBox()
        super().__init__(
            [w.HTML(STYLE), w.HBox([self.path, self.open_button]), self.errors, self.body]
        )
        self.add_class("inspector-app")
        if is_ck:
            self.errors.guard("Showing the checkpoint")(self._show)(path_or_ck)
        else:
            self.errors.guard("Opening the checkpoint")(self.load)()

    def __repr__(self) -> str:
        return f"<Inspector {self.ck!r}>" if self.ck else f"<Inspector: {self.path.value} not open>"

    def load(self) -> None:
        """Open the checkpoint at the path box's value and show it."""
        self._replace_body([w.HTML(note(f"opening {self.path.value} ..."))])
        try:
            ck = inspector.open(self.path.value.strip(), self.storage_options)
        except Exception:
            self._replace_body([])
            raise
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
        self.header = Header(ck)
        self.tensor = TensorPanel(ck, self.errors)
        self.tree = TreePanel(ck, self.errors, self.tensor, self.tensor.show)
        self.export = ExportPanel(ck, self.errors)
        self.doctor = DoctorPanel(ck, self.errors, self._apply_rewrite)
        self.tabs = w.Tab(children=[self.tree, self.doctor, self.export], titles=TABS)
        self.tabs.add_class("inspector-tabs")
        self._replace_body([self.header, self.tabs])

    def _apply_rewrite(self, report: KeyReport) -> None:
        self.export.use_rewrite(report)
        self.tabs.selected_index = TABS.index("Export")
