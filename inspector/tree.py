"""The key tree: keys split at their dots into nodes that total count, numel and bytes per dtype.

A node groups its children on first use, so building the root of a 100k-key checkpoint
costs one pass over the keys and expanding a node one pass over the keys below it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from inspector.errors import MissingKeyError
from inspector.keys import VIEWS, view_key
from inspector.model import Entry


@dataclass(frozen=True, slots=True)
class Totals:
    """How many entries, elements and bytes."""

    count: int = 0
    numel: int = 0
    nbytes: int = 0

    def __add__(self, other: Totals) -> Totals:
        return Totals(
            self.count + other.count, self.numel + other.numel, self.nbytes + other.nbytes
        )


class _Spelled:
    """The entries of one view: spelled keys and their segments, shared by every node."""

    __slots__ = ("_sizes", "entries", "keys", "parts", "view")

    def __init__(self, entries: list[Entry], view: str) -> None:
        if view not in VIEWS:
            raise ValueError(f"view must be one of {VIEWS}, not {view!r}")
        self.view = view
        self.entries = entries
        self.keys = [view_key(e, view) for e in entries]
        self.parts = [k.split(".") for k in self.keys]
        self._sizes: list[tuple[str, int, int]] | None = None

    @property
    def sizes(self) -> list[tuple[str, int, int]]:
        """(dtype or kind, numel, nbytes) per entry, computed once."""
        if self._sizes is None:
            self._sizes = [
                (e.dtype_name or ("object" if e.kind == "object" else "unknown"), e.numel, e.nbytes)
                for e in self.entries
            ]
        return self._sizes


class KeyNode:
    """All keys that start with ``prefix`` (a whole number of dotted segments) in one view."""

    __slots__ = ("_by_dtype", "_children", "_here", "_rows", "_spelled", "depth", "name", "prefix")

    def __init__(
        self, spelled: _Spelled, name: str, prefix: str, depth: int, rows: list[int]
    ) -> None:
        self._spelled = spelled
        self.name = name
        self.prefix = prefix
        self.depth = depth
        self._rows = rows
        self._children: dict[str, KeyNode] | None = None
        self._here: list[int] = []
        self._by_dtype: dict[str, Totals] | None = None

    # --- totals ----------------------------------------------------------------------------
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
        """Totals per dtype (``"object"`` for non-tensor values), largest first."""
        if self._by_dtype is None:
            sums: dict[str, list[int]] = {}
            sizes = self._spelled.sizes
            for row in self._rows:
                dtype, numel, nbytes = sizes[row]
                acc = sums.get(dtype)
                if acc is None:
                    sums[dtype] = [1, numel, nbytes]
                else:
                    acc[0] += 1
                    acc[1] += numel
                    acc[2] += nbytes
            ordered = sorted(sums.items(), key=lambda kv: (-kv[1][2], kv[0]))
            self._by_dtype = {d: Totals(*acc) for d, acc in ordered}
        return self._by_dtype

    @property
    def totals(self) -> Totals:
        return sum(self.by_dtype.values(), Totals())

    @property
    def numel(self) -> int:
        return self.totals.numel

    @property
    def nbytes(self) -> int:
        return self.totals.nbytes

    # --- structure -------------------------------------------------------------------------
    def _grouped(self) -> dict[str, KeyNode]:
        if self._children is None:
            depth, parts = self.depth, self._spelled.parts
            groups: dict[str, list[int]] = {}
            for row in self._rows:
                segments = parts[row]
                if len(segments) > depth:
                    rows = groups.get(segments[depth])
                    if rows is None:
                        groups[segments[depth]] = [row]
                    else:
                        rows.append(row)
                else:
                    self._here.append(row)
            base = f"{self.prefix}." if self.depth else ""
            self._children = {
                name: KeyNode(self._spelled, name, base + name, depth + 1, rows)
                for name, rows in groups.items()
            }
        return self._children

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
        """This node and every node below it, depth first, in stored order."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children()))

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


def build_tree(entries: list[Entry], view: str = "stored") -> KeyNode:
    """The root node over ``entries`` spelled as in ``view`` (stored / flattened / prefixed)."""
    spelled = _Spelled(entries, view)
    return KeyNode(spelled, "", "", 0, list(range(len(entries))))
