"""A checkpoint at a glance: keys, elements and bytes per dtype and per component, files, ranks."""

from __future__ import annotations

from dataclasses import dataclass

from inspector.checkpoint import Checkpoint
from inspector.entry import COMPONENTS
from inspector.gc_pause import paused_gc
from inspector.keys.tree import Totals, ordered_totals


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
    tensors = [0, 0, 0]
    with paused_gc():
        # tallies inlined: this runs once per key
        for e, (name, numel, nbytes) in zip(ck.entries(), ck.sizes(), strict=True):
            acc = by_dtype.get(name)
            if acc is None:
                by_dtype[name] = [1, numel, nbytes]
            else:
                acc[0] += 1
                acc[1] += numel
                acc[2] += nbytes
            acc = by_component.get(e.component)
            if acc is None:
                by_component[e.component] = [1, numel, nbytes]
            else:
                acc[0] += 1
                acc[1] += numel
                acc[2] += nbytes
            if e.kind == "tensor":
                tensors[0] += 1
                tensors[1] += numel
                tensors[2] += nbytes
    return Summary(
        layout=ck.layout,
        layout_reason=ck.layout_reason,
        keys=len(ck),
        tensors=Totals(*tensors),
        by_dtype=ordered_totals(by_dtype),
        by_component={
            c: Totals(*by_component[c]) for c in (*COMPONENTS, "other") if c in by_component
        },
        files=len(ck.source_files),
        ranks=ck.ranks,
    )
