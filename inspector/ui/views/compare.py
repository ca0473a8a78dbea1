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
    "rel_l2_diff": "rel L2 diff",
    "cosine": "cosine",
}


def comparison_rows(found: Comparison, limit: int | None = None) -> list[tuple[object, ...]]:
    """The shown columns, keys that differ first, in stored order within each status."""
    table = found.table
    order = {s: i for i, s in enumerate(reversed(STATUSES))}
    ranked = table.assign(rank=table["status"].map(order)).sort_values("rank", kind="stable")
    picked = ranked[list(SHOWN_COLUMNS)]
    picked = picked.head(limit) if limit else picked
    return [
        tuple(_shown(v, c) for v, c in zip(row, SHOWN_COLUMNS, strict=True))
        for row in picked.itertuples(index=False)
    ]


def _shown(value: object, column: str) -> object:
    if isinstance(value, float):
        # NaN: not compared; a cosine near 1 needs its digits ("1" would hide 0.9996)
        return "" if value != value else f"{value:{'.6f' if column == 'cosine' else '.3g'}}"
    return "" if value is None else value
