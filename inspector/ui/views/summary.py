"""A checkpoint at a glance: keys, elements and bytes per dtype and per component, files, ranks."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from inspector.checkpoint import Checkpoint
from inspector.entry import COMPONENTS
from inspector.gc_pause import paused_gc
from inspector.keys.tree import Totals, ordered_totals, sized, tally

# DCP names data files __<rank>_<n>.distcp and, without collectives, __<rank>.metadata.
_RANK_FILE = re.compile(r"__(\d+)(?:_\d+\.distcp|\.metadata)$")


@dataclass(frozen=True)
class Summary:
    """Totals of one checkpoint; ``ranks`` is None when the file names do not tell.

    ``layout_reason`` is the verdict line of ``ck.describe_layout()`` (why that layout).
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
    tensors: dict[str, list[int]] = {}
    with paused_gc():
        for e in ck.entries():
            name, numel, nbytes = sized(e)
            tally(by_dtype, name, numel, nbytes)
            tally(by_component, e.component, numel, nbytes)
            if e.kind == "tensor":
                tally(tensors, e.kind, numel, nbytes)
    return Summary(
        layout=ck.layout,
        layout_reason=ck.describe_layout().splitlines()[-1].removeprefix("- "),
        keys=len(ck),
        tensors=Totals(*tensors.get("tensor", (0, 0, 0))),
        by_dtype=ordered_totals(by_dtype),
        by_component={
            c: Totals(*by_component[c]) for c in (*COMPONENTS, "other") if c in by_component
        },
        files=len(ck.source_files),
        ranks=ranks_from_files(ck.source_files),
    )


def ranks_from_files(files: Iterable[str]) -> int | None:
    """How many ranks wrote a DCP checkpoint, from its file names; None for other layouts."""
    ranks = {m.group(1) for f in files if (m := _RANK_FILE.search(f))}
    return len(ranks) or None
