"""Class 7, bounded work on absurd names: keys of dots, deep empty segments or short
segments, browsed as the app's tree does it (every node walked and named).
The work must stay linear in the key bytes: a generous time bound for a loaded 2-core
machine, and doubling the input may at most about double the time."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.hostile.trust import Report, TrustCase

SECONDS = 20.0  # one browse of a 32 KB key on a loaded 2-core machine (idle: about 0.3 s)
SHAPES = {
    "dots": lambda n: "." * n,
    "empty-segments": lambda n: "model." + "." * n + "weight",
    "short-segments": lambda n: "a." * (n // 2),
    "mixed": lambda n: ("layers..0." * (n // 10)),
}


def _browse(keys: list[str]) -> int:
    """Build the tree of ``keys`` in every view, walk every node, read its name, totals and
    entry, and find each key again: what the app's tree and key pickers do."""
    from inspector.entry import Entry
    from inspector.keys.tree import build_tree

    entries = [Entry(key=k, kind="tensor", dtype="float32", shape=(2,)) for k in keys]
    seen = 0
    for view in ("stored", "prefixed"):
        root = build_tree(entries, view)
        for node in root.walk():
            seen += len(node.name) + node.count + node.nbytes
            node.entry  # noqa: B018
        assert root.count == len(keys)
    return seen


def _outline(keys: list[str]) -> None:
    """What the app's tree pane does with them: open everything, list the rows, reveal
    each key, in every view."""
    from inspector.entry import Entry
    from inspector.keys.tree import build_tree
    from inspector.ui.views.outline import Outline

    entries = [Entry(key=k, kind="tensor", dtype="float32", shape=(2,)) for k in keys]
    for view in ("stored", "flattened", "prefixed"):
        outline = Outline(build_tree(entries, view))
        assert outline.expand_all(limit=1000)
        rows = outline.rows()
        assert rows and sum(r.count for r in rows if r.depth == 0) == len(keys)
        for key in keys:
            outline.reveal(key)
        outline.rows()


def outline(args: dict[str, Any], report: Report) -> None:
    """The tree pane on keys of ``bytes`` (1 MB): bounded, whatever their depth."""
    from tests.hostile.guard import guarded

    keys = [SHAPES[args["shape"]](args["bytes"]), "plain.weight"]
    with guarded(Path(args["tmp"])):
        began = time.perf_counter()
        _outline(keys)
        seconds = time.perf_counter() - began
    report({"seconds": seconds})
    assert seconds < SECONDS, f"{seconds:.1f} s for the tree pane on a {args['bytes']}-byte key"


def _timed(keys: list[str]) -> float:
    began = time.perf_counter()
    _browse(keys)
    return time.perf_counter() - began


def run(args: dict[str, Any], report: Report) -> None:
    from tests.hostile.guard import guarded

    shape = SHAPES[args["shape"]]
    n = args["bytes"]
    with guarded(Path(args["tmp"])):
        _timed([shape(n // 8), "plain.weight"])  # warm
        half = _timed([shape(n // 2), "plain.weight"])
        whole = _timed([shape(n), "plain.weight"])
    report({"half": half, "whole": whole})
    assert whole < SECONDS, f"{whole:.1f} s for a {n}-byte key"
    # linear: twice the bytes, about twice the time (quadratic would be four times)
    assert whole < 3.0 * half + 0.05, f"{half:.3f} s -> {whole:.3f} s for twice the bytes"


CASES = {
    **{
        f"names:{shape}": TrustCase(
            "tests.hostile.names:run", {"shape": shape, "bytes": 1 << 15}, seconds=120
        )
        for shape in SHAPES
    },
    **{
        f"names:outline-{shape}": TrustCase(
            "tests.hostile.names:outline", {"shape": shape, "bytes": 1 << 20}, seconds=120
        )
        for shape in SHAPES
    },
}
