"""A checkpoint at a glance: keys, elements and bytes per dtype and per component, files, ranks."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from operator import attrgetter

from inspector.checkpoint import Checkpoint
from inspector.entry import COMPONENTS
from inspector.gc_pause import paused_gc
from inspector.keys.tree import Totals, add_count, ordered_totals


@dataclass(frozen=True)
class Summary:
    """Totals of one checkpoint; ``ranks`` is None when the file names do not tell.

    ``layout_reason`` is the evidence that decided the layout.
    """

    layout: str
    layout_reason: str
    keys: int
    tensors: Totals
    by_dtype: dict[str, Totals]
    by_component: dict[str, Totals]
    files: int
    ranks: int | None


def summarize(ck: Checkpoint) -> Summary:
    """Count and size everything from metadata alone (nothing is read), in one pass."""
    by_dtype: dict[str, list[int]] = {}
    by_component: dict[str, list[int]] = {}
    by_kind: dict[str, list[int]] = {}
    with paused_gc():  # each distinct (component, kind, size) is counted at C speed first
        kinds = map(attrgetter("component", "kind"), ck.entries())
        for ((component, kind), (name, numel, nbytes)), n in Counter(
            zip(kinds, ck.sizes(), strict=True)
        ).items():
            add_count(by_dtype, name, n, numel, nbytes)
            add_count(by_component, component, n, numel, nbytes)
            add_count(by_kind, kind, n, numel, nbytes)
    return Summary(
        layout=ck.layout,
        layout_reason=ck.layout_reason,
        keys=len(ck),
        tensors=Totals(*by_kind.get("tensor", ())),
        by_dtype=ordered_totals(by_dtype),
        by_component={
            c: Totals(*by_component[c]) for c in (*COMPONENTS, "other") if c in by_component
        },
        files=len(ck.source_files),
        ranks=ck.ranks,
    )
