"""What a key-tree viewer shows: the rows of expanded nodes, children and entries a page at a time.

An :class:`Outline` keeps which nodes of a :class:`~inspector.keys.tree.KeyNode` tree are open and
how many of their children are listed; :meth:`Outline.rows` visits only those, so a
100k-key checkpoint costs what its visible rows cost. :func:`entry_page` cuts a node's
entries into pages for a table.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from inspector.entry import Entry
from inspector.keys.tree import KeyNode

CHILDREN_PAGE = 200
OPEN_DEPTH = 32  # levels that expand_all opens; deeper ones open by hand
ENTRIES_PAGE = 50


@dataclass(frozen=True)
class Row:
    """One visible line: a node (``kind="node"``) or the "more children" line below a long list.

    For a node, ``count`` and ``nbytes`` total the keys below it; ``entry`` is set on a node
    over one key when that key is the prefix itself (a leaf). For ``kind="more"``, ``prefix``
    is the parent's and ``count`` how many of its children are not listed yet.
    """

    kind: str
    prefix: str
    depth: int
    name: str
    count: int
    nbytes: int = 0
    expandable: bool = False
    expanded: bool = False
    entry: Entry | None = None


class Outline:
    """Open nodes of a key tree and how many children each lists (``page`` more per request)."""

    def __init__(self, root: KeyNode, page: int = CHILDREN_PAGE) -> None:
        self.root = root
        self.page = page
        self._shown: dict[str, int] = {"": page}

    def node(self, prefix: str) -> KeyNode:
        """The node at a dotted prefix ('' is the root)."""
        return self.root.find(prefix)

    def is_expanded(self, prefix: str) -> bool:
        return prefix in self._shown

    def expand(self, prefix: str) -> None:
        if not self.node(prefix).is_leaf:
            self._shown.setdefault(prefix, self.page)

    def collapse(self, prefix: str) -> None:
        """Close a node and everything open below it (the root stays open)."""
        below = f"{prefix}."
        for open_prefix in [p for p in self._shown if p == prefix or p.startswith(below)]:
            if open_prefix:
                del self._shown[open_prefix]

    def collapse_all(self) -> None:
        self._shown = {"": self._shown[""]}

    def show_more(self, prefix: str) -> None:
        """List the next page of a node's children."""
        self._shown[prefix] = self._shown.get(prefix, 0) + self.page

    def reveal(self, prefix: str) -> None:
        """Open every ancestor of ``prefix`` (down to ``OPEN_DEPTH`` levels) and page far
        enough that its row is listed."""
        node = self.root
        for name in prefix.split(".", OPEN_DEPTH)[:OPEN_DEPTH] if prefix else []:
            names = [c.name for c in node.children()]
            needed = math.ceil((names.index(name) + 1) / self.page) * self.page
            key = _prefix(node)
            self._shown[key] = max(self._shown.get(key, 0), needed)
            node = node.child(name)

    def expand_all(self, limit: int) -> bool:
        """Open every node down to ``OPEN_DEPTH`` levels when the tree holds at most
        ``limit`` keys; False when it is larger. (A key of a million dots is a million levels:
        opening them all would store a million prefixes of up to a million characters.)"""
        if self.root.count > limit:
            return False
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.depth >= OPEN_DEPTH or node.is_leaf:
                continue
            children = node.children()
            self._shown[_prefix(node)] = max(self.page, len(children))
            stack.extend(children)
        return True

    def expand_below(self, prefix: str, limit: int) -> tuple[int, bool]:
        """Open ``prefix`` and the nodes below it, level by level (those listed, down to
        ``OPEN_DEPTH`` levels), at most ``limit`` of them: (how many opened, whether the cap
        stopped it)."""
        queue = deque([self.node(prefix)])
        opened = 0
        while queue:
            node = queue.popleft()
            if node.depth >= OPEN_DEPTH or node.is_leaf:
                continue
            if opened == limit:
                return opened, True
            key = _prefix(node)
            shown = self._shown.setdefault(key, self.page)
            opened += 1
            queue.extend(node.children()[:shown])
        return opened, False

    def rows(self) -> list[Row]:
        """The visible rows, depth first in stored order."""
        out: list[Row] = []
        self._add_children(self.root, "", 0, out)
        return out

    def _add_children(self, node: KeyNode, key: str, depth: int, out: list[Row]) -> None:
        children = node.children()
        shown = self._shown[key]
        for child in children[:shown]:
            prefix = child.prefix
            expanded = prefix in self._shown
            totals = child.totals
            # A node over several keys has children: no need to group it to know.
            single = totals.count == 1
            out.append(
                Row(
                    "node",
                    prefix,
                    depth,
                    child.name,
                    totals.count,
                    totals.nbytes,
                    not single or not child.is_leaf,
                    expanded,
                    child.entry if single else None,
                )
            )
            if expanded:
                self._add_children(child, prefix, depth + 1, out)
        if len(children) > shown:
            out.append(Row("more", key, depth, "", len(children) - shown))


def _prefix(node: KeyNode) -> str:
    """The node's prefix; '' for the root (whose ``prefix`` needs a key below it)."""
    return node.prefix if node.depth else ""


@dataclass(frozen=True)
class EntryPage:
    """Page ``number`` (from 0) of ``pages`` of a node's entries, with their keys as viewed."""

    entries: list[Entry]
    keys: list[str]
    start: int
    total: int
    number: int
    pages: int


def entry_page(node: KeyNode, number: int, size: int = ENTRIES_PAGE) -> EntryPage:
    """The entries below ``node`` on page ``number``, clamped to the pages there are."""
    total = node.count
    pages = max(1, math.ceil(total / size))
    number = min(max(number, 0), pages - 1)
    start = number * size
    return EntryPage(
        node.entries(start, start + size),
        node.keys(start, start + size),
        start,
        total,
        number,
        pages,
    )
