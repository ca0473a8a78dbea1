"""The Compare tab's table: the diff columns shown, with their headings, keys that differ
first (see :mod:`inspector.analysis.comparison` for the comparison itself)."""

from __future__ import annotations

from inspector.analysis.comparison import Comparison
from inspector.analysis.diff import STATUSES

# The diff table as the Compare tab shows it: column -> heading.
SHOWN_COLUMNS = {
    "status": "status",
    "key": "key",
    "key_b": "key in other",
    "dtype_a": "dtype",
    "dtype_b": "dtype in other",
    "max_abs_diff": "max abs diff",
    "max_rel_diff": "max rel diff",
}


def comparison_rows(found: Comparison, limit: int | None = None) -> list[tuple[object, ...]]:
    """The shown columns, keys that differ first, in stored order within each status."""
    table = found.table
    order = {s: i for i, s in enumerate(reversed(STATUSES))}
    ranked = table.assign(rank=table["status"].map(order)).sort_values("rank", kind="stable")
    picked = ranked[list(SHOWN_COLUMNS)]
    picked = picked.head(limit) if limit else picked
    return [tuple(_shown(v) for v in row) for row in picked.itertuples(index=False)]


def _shown(value: object) -> object:
    if isinstance(value, float):
        return "" if value != value else f"{value:.3g}"  # NaN: not compared
    return "" if value is None else value
