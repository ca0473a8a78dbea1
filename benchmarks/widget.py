"""The Jupyter app on a 100k-key checkpoint, kernel side: first view, expand, page, view, filter.

Uses benchmarks/tree.py's synthetic DCP ``.metadata`` (a legacy torchtitan checkpoint,
2,222 layers, 100,006 keys, its data file sparse: the subclass scan of a shown page reads
zeros where genuine items would be, and marks those entries damaged).
Times, with ``inspector.open`` of the folder as the anchor (ratios printed as x), the
median of a few rounds of:
- first view: ``Inspector(path)`` (open, header totals, tree, first page of entries),
- findings: then until the header's worker thread has scanned the model's chunk records,
  asked the FQN doctor and audited (background: the app answers clicks meanwhile),
- open path: selecting ``optimizer`` then ``optimizer.state`` (80k and 60k keys below),
- expand: then selecting the largest node below (2,222 children, the first 200 listed),
- more: listing its next 200 children,
- page: the next page of the selected node's entry table,
- view: switching to the flattened spelling (tree rebuilt, selection kept),
- filter: a substring filter matching 20k keys and a glob matching 9.
Goals (on the median of the rounds; ranges printed): first view <= 1 s, expand <= 0.1 s
(exit 0 when met). Run: ``.venv/bin/python benchmarks/widget.py [rounds]`` (default 3).
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ipywidgets  # noqa: F401  (one-off imports are not per-view work)
import matplotlib  # noqa: F401
from peak import goal_line, spread
from tree import build_metadata

import inspector
from inspector.ui.widgets import Inspector

FIRST_VIEW_GOAL, EXPAND_GOAL = 1.0, 0.1
LARGEST = "optimizer.state.layers"


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes; what it returns is freed only after the clock stops."""
    start = time.perf_counter()
    kept = fn()
    elapsed = time.perf_counter() - start
    del kept
    return elapsed


def actions(app: Inspector) -> dict[str, Callable[[], object]]:
    """The user actions, in the order a user would take them."""
    tree = app.tree

    def glob_filter() -> None:
        tree.mode.value = "glob"
        tree.filter.value = "model.layers.1500.*"

    return {
        "open path": lambda: [tree.select(p) for p in ("optimizer", "optimizer.state")],
        "expand": lambda: tree.select(LARGEST),
        "more": lambda: tree.outline.show_more(LARGEST) or tree.render(),
        "page": lambda: tree.show_page(1),
        "view": lambda: setattr(tree.view, "value", "flattened"),
        "filter 20k": lambda: setattr(tree.filter, "value", "exp_avg_sq"),
        "filter glob": glob_filter,
    }


def main(rounds: int = 3) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        keys = build_metadata(folder)
        print(f"metadata: {keys} keys")
        opened = statistics.median(timed(lambda: inspector.open(folder)) for _ in range(rounds))
        print(f"inspector.open (anchor): {opened:.3f} s (median of {rounds})\n")
        times: dict[str, list[float]] = {"first view": []}
        cpus: list[float] = []  # the first view's CPU time: what the machine's load leaves out
        for _ in range(rounds):
            app = None

            def first_view() -> None:
                nonlocal app
                app = Inspector(folder)

            cpu = time.process_time()
            times["first view"].append(timed(first_view))
            cpus.append(time.process_time() - cpu)
            times.setdefault("findings", []).append(timed(app.header.wait))
            assert app.errors.value == "", app.errors.value
            for name, action in actions(app).items():
                times.setdefault(name, []).append(timed(action))
                assert app.errors.value == "", app.errors.value
            app.close()  # the next round starts without this one's 100k entries in memory
            del app
            gc.collect()
        print(f"{'action':12s} {'median':>9s} {'range':>13s} {'vs open':>8s}")
        for name, values in times.items():
            value = statistics.median(values)
            print(f"{name:12s} {value:7.3f} s {spread(values, 3):>13s} {value / opened:7.2f}x")
        print(f"first view CPU time {spread(cpus, 3)} s")
        print(f"\nload average: {os.getloadavg()[0]:.2f}")
        met = goal_line(f"first view <= {FIRST_VIEW_GOAL} s", times["first view"], FIRST_VIEW_GOAL)
        met &= goal_line(f"expand <= {EXPAND_GOAL} s", times["expand"], EXPAND_GOAL)
        return met


if __name__ == "__main__":
    sys.exit(0 if main(int(sys.argv[1]) if len(sys.argv) > 1 else 3) else 1)
