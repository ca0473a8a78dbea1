"""The key tree: keys split at their dots into nodes that total count, numel and bytes per dtype.

A node groups its children on first use, so building the root of a 100k-key checkpoint
costs one pass over the keys and expanding a node one pass over the keys below it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from itertools import groupby
from math import prod
from operator import attrgetter
from typing import Any, NamedTuple

from inspector.dtypes import itemsize
from inspector.entry import Entry
from inspector.errors import MissingKeyError
from inspector.gc_pause import paused_gc
from inspector.keys.spellings import VIEWS, view_key

# Shared, never mutated: most nodes are leaves or hold no entry of their own.
_NO_CHILDREN: dict[str, KeyNode] = {}
_NONE: list[int] = []
_BYTE_LENGTH = attrgetter("byte_length")
# Grouping this many rows allocates enough to set off full collections of a large heap.
_PAUSE_GC_ABOVE = 1000


class Totals(NamedTuple):
    """How many entries, elements and bytes (a tuple: ``count, numel, nbytes = totals``)."""

    count: int = 0  # type: ignore[assignment]  # shadows tuple.count, as namedtuples may
    numel: int = 0
    nbytes: int = 0


class _Spelled:
    """The entries of one view and their keys as spelled in it, shared by every node."""

    __slots__ = ("_sizes", "entries", "keys", "view")

    def __init__(
        self, entries: list[Entry], view: str, sizes: list[tuple[str, int, int]] | None
    ) -> None:
        if view not in VIEWS:
            raise ValueError(f"view must be one of {VIEWS}, not {view!r}")
        self.view = view
        self.entries = entries
        self.keys = (
            [e.key for e in entries] if view == "stored" else [view_key(e, view) for e in entries]
        )
        self._sizes = sizes

    @property
    def sizes(self) -> list[tuple[str, int, int]]:
        """(dtype or kind, numel, nbytes) per entry, computed once."""
        if self._sizes is None:
            self._sizes = sizes_of(self.entries)
        return self._sizes


class KeyNode:
    """All keys that start with ``prefix`` (a whole number of dotted segments) in one view.

    ``start``: where every key below continues past the prefix and its dot (0 at the root).
    """

    __slots__ = ("_by_dtype", "_children", "_here", "_rows", "_spelled", "_start", "depth")

    def __init__(self, spelled: _Spelled, depth: int, rows: list[int], start: int) -> None:
        self._spelled = spelled
        self.depth = depth
        self._rows = rows
        self._start = start
        self._children: dict[str, KeyNode] | None = None
        self._here: list[int] = _NONE
        self._by_dtype: dict[str, Totals] | None = None

    # --- totals ----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The last segment of the prefix ('' for the root)."""
        if not self.depth:
            return ""
        key, end = self._spelled.keys[self._rows[0]], self._start - 1
        return key[key.rfind(".", 0, end) + 1 : end]

    @property
    def prefix(self) -> str:
        """The dotted key prefix every key below this node starts with ('' for the root)."""
        return self._spelled.keys[self._rows[0]][: self._start - 1] if self.depth else ""

    @property
    def view(self) -> str:
        return self._spelled.view

    @property
    def count(self) -> int:
        return len(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def by_dtype(self) -> dict[str, Totals]:
        """Totals per dtype (``"object"`` for non-tensor values), largest first; read-only."""
        if self._by_dtype is None:
            with paused_gc() if len(self._rows) > _PAUSE_GC_ABOVE else nullcontext():
                self._by_dtype = ordered_totals(add_rows({}, self._rows, self._spelled.sizes))
        return self._by_dtype

    def _total_from_children(self) -> None:
        """Totals as the sum of the (already totalled) children and this node's own entries."""
        children, here = self._children or _NO_CHILDREN, self._here
        if len(children) == 1 and not here:
            [only] = children.values()
            self._by_dtype = only._by_dtype
            return
        if not children and len(here) == 1:
            dtype, numel, nbytes = self._spelled.sizes[here[0]]
            self._by_dtype = {dtype: Totals(1, numel, nbytes)}
            return
        sums: dict[str, list[int]] = {}
        for child in children.values():
            for dtype, t in child.by_dtype.items():
                acc = sums.get(dtype)
                if acc is None:
                    sums[dtype] = [t.count, t.numel, t.nbytes]
                else:
                    acc[0] += t.count
                    acc[1] += t.numel
                    acc[2] += t.nbytes
        self._by_dtype = ordered_totals(add_rows(sums, self._here, self._spelled.sizes))

    @property
    def totals(self) -> Totals:
        parts = self.by_dtype.values()
        return Totals(
            sum(t.count for t in parts), sum(t.numel for t in parts), sum(t.nbytes for t in parts)
        )

    @property
    def numel(self) -> int:
        return self.totals.numel

    @property
    def nbytes(self) -> int:
        return self.totals.nbytes

    # --- structure -------------------------------------------------------------------------
    def _grouped(self) -> dict[str, KeyNode]:
        if self._children is not None:
            return self._children
        rows, keys, start = self._rows, self._spelled.keys, self._start
        if len(rows) == 1:  # most nodes: a leaf, or a chain of segments down to one
            key = keys[rows[0]]
            if len(key) < start:
                self._here, self._children = rows, _NO_CHILDREN
            else:
                name = _segment(key, start)
                self._children = {name: self._child(rows, start + len(name) + 1)}
            return self._children
        with paused_gc() if len(rows) > _PAUSE_GC_ABOVE else nullcontext():
            names = [_segment(keys[row], start) for row in rows]
            groups: dict[str, list[int]] = {}
            at = 0
            for name, run in groupby(names):  # keys below a prefix are mostly stored together
                n = len(list(run))
                if name in groups:
                    groups[name].extend(rows[at : at + n])
                else:
                    groups[name] = rows[at : at + n]
                at += n
            here = [row for row in groups.get("", ()) if len(keys[row]) < start]
            if here:  # keys that are this prefix itself, named "" like an empty segment below it
                below = [row for row in groups.pop("") if len(keys[row]) >= start]
                if below:  # in the order of each group's first key, as the keys were stored
                    groups = dict(sorted({**groups, "": below}.items(), key=lambda g: g[1][0]))
            self._here = here or _NONE
            self._children = {
                name: self._child(group, start + len(name) + 1) for name, group in groups.items()
            } or _NO_CHILDREN
            if len(rows) > _PAUSE_GC_ABOVE:
                for child in self._children.values():
                    child.by_dtype  # noqa: B018  (an expanded node shows them; total them in the pause)
        return self._children

    def _child(self, rows: list[int], start: int) -> KeyNode:
        return KeyNode(self._spelled, self.depth + 1, rows, start)

    def children(self) -> list[KeyNode]:
        """The next level, in the order the keys were stored."""
        return list(self._grouped().values())

    def child(self, name: str) -> KeyNode:
        try:
            return self._grouped()[name]
        except KeyError:
            raise MissingKeyError(
                f"no keys under {self._join(name)!r} in the {self.view} view", key=self._join(name)
            ) from None

    def _join(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.depth else name

    @property
    def is_leaf(self) -> bool:
        return not self._grouped()

    @property
    def entry(self) -> Entry | None:
        """The entry whose key is exactly this node's prefix, if any."""
        self._grouped()
        return self._spelled.entries[self._here[0]] if self._here else None

    def entries(self, start: int = 0, stop: int | None = None) -> list[Entry]:
        """Entries below this node in stored order; ``start``/``stop`` select a page."""
        everything = self._spelled.entries
        return [everything[row] for row in self._rows[start:stop]]

    def keys(self, start: int = 0, stop: int | None = None) -> list[str]:
        """The same page as :meth:`entries`, as keys spelled in this view."""
        spelled = self._spelled.keys
        return [spelled[row] for row in self._rows[start:stop]]

    def find(self, prefix: str) -> KeyNode:
        """The node for a dotted key prefix (a whole key gives its leaf), searched from here."""
        segments = prefix.split(".") if prefix else []
        mine = self.prefix.split(".") if self.depth else []
        if segments[: self.depth] != mine:
            raise MissingKeyError(f"not below {self.prefix!r} in the {self.view} view", key=prefix)
        node = self
        for name in segments[self.depth :]:
            node = node.child(name)
        return node

    def walk(self) -> Iterator[KeyNode]:
        """This node and every node below it, depth first, in stored order.

        The whole subtree is grouped and totalled first, in one pass with the garbage
        collector paused and totals summed bottom-up from the children.
        """
        with paused_gc():
            order, stack = [], [self]
            while stack:
                node = stack.pop()
                order.append(node)
                children = node._grouped()
                if children:
                    stack.extend(reversed(children.values()))
            for node in reversed(order):
                if node._by_dtype is None:
                    node._total_from_children()
        return iter(order)

    def as_dict(self, depth: int = 0) -> dict[str, Any]:
        """JSON-ready totals, with ``depth`` levels of children."""
        out: dict[str, Any] = {
            "name": self.name,
            "prefix": self.prefix,
            "count": self.count,
            "numel": self.numel,
            "nbytes": self.nbytes,
            "dtypes": {
                d: {"count": t.count, "numel": t.numel, "nbytes": t.nbytes}
                for d, t in self.by_dtype.items()
            },
        }
        if depth > 0:
            out["children"] = [c.as_dict(depth - 1) for c in self.children()]
        return out

    def __repr__(self) -> str:
        where = self.prefix or "<root>"
        return f"<KeyNode {where!r} ({self.view}): {self.count} keys, {self.nbytes} bytes>"


def _segment(key: str, start: int) -> str:
    """The dotted segment of ``key`` that begins at ``start``: work in its length only, so a
    key of a million dots costs a million steps, not a million squared."""
    end = key.find(".", start)
    return key[start:] if end < 0 else key[start:end]


def sized(entry: Entry) -> tuple[str, int, int]:
    """(dtype, or "object" / "unknown" without one; numel; nbytes): what totals count.
    The same as ``entry.numel`` / ``entry.nbytes``, in one pass."""
    dtype, shape = entry.dtype, entry.shape
    numel = prod(shape) if shape is not None else 0
    if entry.kind != "tensor":
        return dtype or "object", numel, sum(map(_BYTE_LENGTH, entry.chunks))
    if dtype is None:
        return "unknown", numel, 0
    return dtype, numel, numel * itemsize(dtype)


def sizes_of(entries: Iterable[Entry]) -> list[tuple[str, int, int]]:
    """:func:`sized` of each entry; worked out once per tensor dtype and shape (a model
    repeats a few dozen), so equal sizes are one shared tuple."""
    known: dict[tuple[str | None, tuple[int, ...] | None], tuple[str, int, int]] = {}
    out = []
    for e in entries:
        if e.kind != "tensor":
            out.append(sized(e))
            continue
        size = known.get((e.dtype, e.shape))
        if size is None:
            size = known[e.dtype, e.shape] = sized(e)
        out.append(size)
    return out


def add_rows(
    sums: dict[str, list[int]], rows: Iterable[int], sizes: list[tuple[str, int, int]]
) -> dict[str, list[int]]:
    """Count each row's (name, numel, nbytes) from ``sizes`` into ``sums``: one more value,
    its elements and bytes, under its name (each distinct size counted at C speed first)."""
    for (name, numel, nbytes), n in Counter(map(sizes.__getitem__, rows)).items():
        add_count(sums, name, n, numel, nbytes)
    return sums


def add_count(sums: dict[str, list[int]], name: str, n: int, numel: int, nbytes: int) -> None:
    """Count ``n`` values of ``numel`` elements and ``nbytes`` bytes each under ``name``."""
    acc = sums.get(name)
    if acc is None:
        sums[name] = [n, n * numel, n * nbytes]
    else:
        acc[0] += n
        acc[1] += n * numel
        acc[2] += n * nbytes


def ordered_totals(sums: dict[str, list[int]]) -> dict[str, Totals]:
    """Totals per name (dtype), largest byte count first."""
    if len(sums) == 1:
        [(dtype, acc)] = sums.items()
        return {dtype: Totals(*acc)}
    ordered = sorted(sums.items(), key=lambda kv: (-kv[1][2], kv[0]))
    return {d: Totals(*acc) for d, acc in ordered}


def build_tree(
    entries: list[Entry], view: str = "stored", sizes: list[tuple[str, int, int]] | None = None
) -> KeyNode:
    """The root node over ``entries`` spelled as in ``view`` (stored / flattened / prefixed);
    ``sizes``: :func:`sized` of each entry, where the caller has them already."""
    with paused_gc():
        spelled = _Spelled(entries, view, sizes)
        return KeyNode(spelled, 0, list(range(len(entries))), 0)
