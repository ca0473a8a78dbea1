"""Keys: the key tree in a view (stored / flattened / prefixed), a filter, a node's entries."""

from __future__ import annotations

import threading
from collections.abc import Callable

import ipywidgets as w

from inspector.analysis.audit import AuditReport
from inspector.checkpoint import Checkpoint
from inspector.entry import Entry
from inspector.errors import MissingKeyError
from inspector.keys.filters import FILTER_MODES, filter_entries
from inspector.keys.spellings import VIEWS, view_key
from inspector.keys.tree import KeyNode, build_tree
from inspector.ui.views.flags import BADGES, SHOWS, KeyFlags
from inspector.ui.views.outline import CHILDREN_PAGE, Outline, Row, entry_page
from inspector.ui.views.text import human_bytes, shape_text
from inspector.ui.widgets.errors import ErrorBox
from inspector.ui.widgets.keylist import KeyList, RowValue
from inspector.ui.widgets.markup import heading, note, table
from inspector.words import counted

# A filter down to this many keys opens every node, so the matches are in sight.
EXPAND_MATCHES = 200
# "Expand all" below a node opens at most this many nodes (each lists up to a page of rows).
EXPAND_BELOW = 200
INDENT = "\u00a0" * 4
GAP = "\u00a0\u00a0\u00b7\u00a0\u00a0"
ENTRY_COLUMNS = ("key", "dtype", "shape", "size", "chunks", "subclass", "fp8")


def row_label(
    row: Row,
    page: int,
    flags: KeyFlags | None = None,
    view: str = "stored",
    within: frozenset[str] | None = None,
) -> str:
    """``▸ layers · 18 keys · 1.2 MB  [14 FP8]``, indented by depth (no-break spaces keep
    it); a leaf shows its dtype, shape and badges (``[FP8]``, ``[error]``, a quantized
    weight's scheme); an inner row counts its flagged keys (``within``: among the keys a
    filter kept)."""
    pad = INDENT * row.depth
    if row.kind == "more":
        return f"{pad}\u00a0\u00a0... {row.count:,} more: select to list {min(page, row.count):,}"
    marker = "\u25be" if row.expanded else "\u25b8" if row.expandable else "\u2022"
    entry = row.entry if not row.expandable else None
    if entry is not None:
        detail = f"{entry.dtype or entry.kind}{GAP}{shape_text(entry)}"
    else:
        detail = f"{row.count:,} {'key' if row.count == 1 else 'keys'}"
    label = f"{pad}{marker} {row.name}{GAP}{detail}{GAP}{human_bytes(row.nbytes)}"
    if flags is None:
        return label
    if entry is not None:
        scheme = flags.scheme(entry.key)  # a quantized weight's badge names its scheme
        marks = [b for b in flags.badges(entry.key) if not (scheme and b == "FP8")]
        marks = [scheme, *marks] if scheme else marks
    elif flags.ready:
        counts = ((flags.count_below(row.prefix, view, b, within), b) for b in BADGES)
        marks = [f"{n:,} {b}" for n, b in counts if n]
    else:
        marks = []
    return label + "".join(f"\u00a0\u00a0[{m}]" for m in marks)


def _holds(root: KeyNode, key: str) -> bool:
    """Whether the tree has an entry spelled ``key``."""
    try:
        return root.find(key).entry is not None
    except MissingKeyError:
        return False


class TreePanel(w.VBox):
    """The key tree as a list of visible rows; selecting a node opens it and lists its entries.

    ``side`` sits to the right of the list (the Tensor panel); ``on_select`` gets each
    selected node. A node lists ``children_page`` children, then a "more" row.
    """

    children_page = CHILDREN_PAGE

    def __init__(
        self,
        ck: Checkpoint,
        errors: ErrorBox,
        side: w.Widget,
        on_select: Callable[[KeyNode], None],
    ) -> None:
        self.ck = ck
        self.on_select = on_select
        self.view = w.ToggleButtons(options=list(VIEWS), value="stored", description="View")
        self.flags = KeyFlags(ck)
        self.mode = w.Dropdown(options=list(FILTER_MODES), layout=w.Layout(width="110px"))
        self.mode.add_class("inspector-filter-mode")
        self.show = w.Dropdown(options=list(SHOWS), layout=w.Layout(width="130px"))
        self.show.add_class("inspector-show")
        self.filter = w.Text(
            placeholder="filter keys, then Enter",
            continuous_update=False,
            layout=w.Layout(width="280px"),
        )
        self.collapse_button = w.Button(description="Collapse", icon="compress")
        self.collapse_all_button = w.Button(description="Collapse all")
        self.expand_button = w.Button(description="Expand all", icon="expand")
        self.expand_button.add_class("inspector-expand-below")
        self.status = w.HTML()
        self.status.add_class("inspector-tree-status")
        self.tree = KeyList(rows=22, layout=w.Layout(width="100%"))
        self.entries = w.HTML()
        self.prev_button = w.Button(description="Previous", icon="chevron-left")
        self.next_button = w.Button(description="Next", icon="chevron-right")
        self.page_label = w.Label()
        for widget, name in (
            (self.view, "view"),
            (self.filter, "filter"),
            (self.tree, "tree"),
            (self.entries, "entries"),
        ):
            widget.add_class(f"inspector-{name}")
        self.outline: Outline
        self.kept: frozenset[str] | None = None  # the keys a filter kept (None: all)
        self.selected = ""
        self.page = 0
        self._quiet = False
        self._lock = threading.RLock()  # the header's worker re-renders the rows too

        self.view.observe(errors.guard("Switching the view")(self._refilter), "value")
        self.filter.observe(errors.guard("Filtering")(self._refilter), "value")
        self.mode.observe(errors.guard("Filtering")(self._refilter), "value")
        self.show.observe(errors.guard("Filtering")(self._refilter), "value")
        self.tree.observe(errors.guard("Selecting")(self._on_pick), "value")
        self.collapse_button.on_click(errors.guard("Collapsing")(lambda _: self.collapse()))
        self.collapse_all_button.on_click(errors.guard("Collapsing")(lambda _: self.collapse_all()))
        self.expand_button.on_click(
            errors.guard("Expanding")(lambda _: self.expand_below(self.selected))
        )
        self.tree.on_key(errors.guard("Moving in the tree")(self._on_key))
        self.prev_button.on_click(errors.guard("Paging")(lambda _: self.show_page(self.page - 1)))
        self.next_button.on_click(errors.guard("Paging")(lambda _: self.show_page(self.page + 1)))

        self.rebuild()
        controls = w.HBox(
            [
                self.show,
                self.mode,
                self.filter,
                self.expand_button,
                self.collapse_button,
                self.collapse_all_button,
            ]
        )
        pager = w.HBox([self.prev_button, self.page_label, self.next_button])
        body = w.HBox(
            [
                w.VBox([self.status, self.tree], layout=w.Layout(width="50%")),
                w.Box([side], layout=w.Layout(width="50%", padding="0 0 0 12px", overflow="auto")),
            ]
        )
        super().__init__([self.view, controls, body, self.entries, pager])

    # --- building and showing ---------------------------------------------------------------
    def rebuild(self, keep: Entry | None = None) -> None:
        """The tree for the current view and filter; ``keep`` stays selected if it matches."""
        view, pattern, show = self.view.value, self.filter.value, self.show.value
        entries = filter_entries(self.ck.entries(), view, pattern, self.mode.value)
        entries = self.flags.select(entries, show)
        filtered = len(entries) < len(self.ck)
        self.kept = frozenset(e.key for e in entries) if filtered else None
        root = build_tree(entries, view, None if filtered else self.ck.sizes())
        self.outline = Outline(root, self.children_page)
        self.selected = ""
        if pattern or SHOWS[show]:
            self.outline.expand_all(EXPAND_MATCHES)
            self.status.value = note(f"{root.count:,} of {counted(len(self.ck), 'key')} match")
        else:
            self.status.value = note(
                f"{counted(root.count, 'key')}, {view} spelling; select a row to open it"
            )
        spelled = view_key(keep, view) if keep is not None else ""
        if spelled and _holds(root, spelled):
            self.outline.reveal(spelled)
            self.selected = spelled
        self._show_selected()

    @property
    def node(self) -> KeyNode:
        """The selected node (the root when nothing is selected)."""
        return self.outline.node(self.selected)

    def render(self) -> None:
        """Rows as options, with the selected node still selected."""
        with self._lock:
            self._render()

    def _render(self) -> None:
        page, view = self.outline.page, self.view.value
        options = tuple(
            (row_label(r, page, self.flags, view, self.kept), (r.kind, r.prefix))
            for r in self.outline.rows()
        )
        self._quiet = True
        try:
            self.tree.options = options
            wanted = ("node", self.selected)
            shown = {v for _, v in options}
            self.tree.value = wanted if wanted in shown else None
            if self.tree.cursor not in shown:
                self.tree.cursor = self.tree.value
        finally:
            self._quiet = False

    def show_page(self, number: int) -> None:
        """The selected node's entries, page ``number``, with subclasses scanned for that page."""
        node = self.node
        page = entry_page(node, number)
        self.page = page.number
        self.ck.scan([e.key for e in page.entries], progress=False)
        rows = []
        for key, e in zip(page.keys, page.entries, strict=True):
            found = self.ck.facts(e.key)
            rows.append(
                (
                    key,
                    e.dtype or e.kind,
                    shape_text(e),
                    human_bytes(e.nbytes),
                    len(e.chunks),
                    found.subclass or "",
                    found.fp8 or (f"unreadable: {found.error}" if found.error else ""),
                )
            )
        where = node.prefix if node.depth else "all keys"
        shown = f"{page.start + 1:,}-{page.start + len(rows):,}" if rows else "none"
        self.entries.value = heading(f"{where}: entries {shown} of {page.total:,}") + table(
            ENTRY_COLUMNS, rows
        )
        self.page_label.value = f"page {page.number + 1} of {page.pages}"
        self.prev_button.disabled = page.number == 0
        self.next_button.disabled = page.number >= page.pages - 1

    def flags_found(self, audit: AuditReport | None) -> None:
        """The header's scan and audit are done: collect the flags, show the badges."""
        self.flags.refresh(audit)
        self.render()

    # --- user actions -----------------------------------------------------------------------
    def select(self, prefix: str) -> None:
        """Select a node by its prefix in the current view (opening it and its ancestors)."""
        self.outline.reveal(prefix)
        self.selected = prefix
        self.outline.expand(prefix)
        self._show_selected()
        self.tree.cursor = ("node", prefix)

    def collapse(self) -> None:
        """Close the selected node; on a closed or leaf node, close its parent instead."""
        prefix = self.selected
        if prefix and not self.outline.is_expanded(prefix):
            prefix = prefix.rpartition(".")[0]
        if prefix:
            self.outline.collapse(prefix)
        else:
            self.outline.collapse_all()
        self.selected = prefix
        self._show_selected()

    def collapse_all(self) -> None:
        self.outline.collapse_all()
        self.selected = ""
        self._show_selected()

    def expand_below(self, prefix: str) -> None:
        """Open the node ``prefix`` ('' the root) and the nodes below it, at most
        ``EXPAND_BELOW`` of them (a large subtree would list thousands of rows)."""
        opened, capped = self.outline.expand_below(prefix, EXPAND_BELOW)
        where = prefix or "the root"
        self.status.value = note(
            f"opened the first {opened:,} nodes below {where}: the rest stay closed "
            "(expand a deeper node to see more)"
            if capped
            else f"opened {counted(opened, 'node')} below {where}"
        )
        self.render()

    def key_right(self, prefix: str) -> None:
        """Right arrow: open a closed node; on an open one, move to its first child."""
        if self.outline.is_expanded(prefix) or self.outline.node(prefix).is_leaf:
            self._move_cursor(prefix, 1)
        else:
            self.outline.expand(prefix)
            self.render()

    def key_left(self, prefix: str) -> None:
        """Left arrow: close an open node; on a closed one or a leaf, move to its parent."""
        if self.outline.is_expanded(prefix):
            self.outline.collapse(prefix)
            self.render()
        elif "." in prefix:
            self.tree.cursor = ("node", prefix.rpartition(".")[0])

    def _move_cursor(self, prefix: str, step: int) -> None:
        """The cursor to the row ``step`` rows after the node ``prefix``, when that row is a
        child of it."""
        values = [v for _, v in self.tree.options]
        at = values.index(("node", prefix)) + step
        if at < len(values) and values[at][1].startswith(f"{prefix}."):
            self.tree.cursor = values[at]

    def _on_key(self, event: str, row: RowValue) -> None:
        kind, prefix = row
        if kind == "more":  # the "more" row stands for its parent
            if event == "left" and prefix:
                self.tree.cursor = ("node", prefix)
            return
        if event == "right":
            self.key_right(prefix)
        elif event == "left":
            self.key_left(prefix)
        else:
            self.expand_below(prefix)

    def _show_selected(self) -> None:
        self.render()
        self.show_page(0)
        self.on_select(self.node)

    def _refilter(self, _change: object) -> None:
        node = self.node
        self.rebuild(keep=node.entry if node.depth else None)

    def _on_pick(self, change: dict) -> None:
        if self._quiet or change["new"] is None:
            return
        kind, prefix = change["new"]
        if kind == "more":
            self.outline.show_more(prefix)
            self.render()
        else:
            self.select(prefix)
