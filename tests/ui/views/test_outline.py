"""The visible rows of a key tree (open nodes, paged children) and pages of a node's entries."""

from __future__ import annotations

from pathlib import Path

import pytest

import inspector
from inspector.keys.filters import filter_entries
from inspector.keys.tree import build_tree
from inspector.ui.views.outline import Outline, Row, entry_page


@pytest.fixture(scope="module")
def flat(demo_dir: Path) -> inspector.Checkpoint:
    return inspector.open(demo_dir / "flat")


def names(rows: list[Row]) -> list[str]:
    return [("  " * r.depth) + (r.name if r.kind == "node" else f"+{r.count}") for r in rows]


def test_first_rows_are_the_top_level(flat) -> None:
    root = flat.tree()
    rows = Outline(root).rows()
    assert [r.prefix for r in rows] == [c.prefix for c in root.children()]
    assert {(r.kind, r.depth, r.expanded) for r in rows} == {("node", 0, False)}
    assert sum(r.count for r in rows) == len(flat)
    assert sum(r.nbytes for r in rows) == sum(e.nbytes for e in flat.entries())
    layers = next(r for r in rows if r.name == "layers")
    assert (layers.count, layers.expandable, layers.entry) == (18, True, None)


def test_expand_collapse_and_leaves(flat) -> None:
    outline = Outline(flat.tree())
    outline.expand("layers")
    outline.expand("layers.0")
    outline.expand("layers.0.attention_norm")
    shown = names(outline.rows())
    start = shown.index("layers")
    assert shown[start + 1 : start + 3] == ["  0", "    attention"]
    leaf = next(r for r in outline.rows() if r.prefix == "layers.0.attention_norm.weight")
    assert leaf.entry is flat.entry("layers.0.attention_norm.weight")
    assert (leaf.depth, leaf.count, leaf.expandable, leaf.nbytes) == (3, 1, False, 64 * 4)
    outline.expand(leaf.prefix)
    assert not outline.is_expanded(leaf.prefix)
    outline.collapse("layers")
    assert not any(r.prefix.startswith("layers.") for r in outline.rows())
    outline.expand("layers")
    assert not outline.is_expanded("layers.0")
    outline.collapse_all()
    assert {r.depth for r in outline.rows()} == {0}


def test_children_come_a_page_at_a_time(flat) -> None:
    root = flat.tree()
    children = [c.prefix for c in root.children()]
    outline = Outline(root, page=3)
    rows = outline.rows()
    assert [r.prefix for r in rows[:3]] == children[:3]
    assert (rows[3].kind, rows[3].prefix, rows[3].count) == ("more", "", len(children) - 3)
    outline.show_more("")
    assert [r.prefix for r in outline.rows()][:6] == children[:6]
    outline.expand("optimizer")
    outline.expand("optimizer.state")
    below = [r for r in outline.rows() if r.depth == 2]
    assert [r.kind for r in below] == ["node"] * 3 + ["more"]
    assert below[-1].prefix == "optimizer.state"
    assert below[-1].count == len(root.find("optimizer.state").children()) - 3


def test_reveal_opens_ancestors_and_pages(flat) -> None:
    outline = Outline(flat.tree(), page=1)
    key = "layers.1.feed_forward.w3.weight"
    outline.reveal(key)
    rows = outline.rows()
    assert key in [r.prefix for r in rows]
    for ancestor in ("layers", "layers.1", "layers.1.feed_forward", "layers.1.feed_forward.w3"):
        assert outline.is_expanded(ancestor)
    assert [r.prefix for r in rows if r.depth == 1 and r.kind == "node"] == ["layers.0", "layers.1"]


def test_expand_all_only_when_small(flat) -> None:
    assert not Outline(flat.tree()).expand_all(limit=100)
    matches = filter_entries(flat.entries(), "stored", "layers.1.*.weight", "glob")
    outline = Outline(build_tree(matches, "stored"))
    assert outline.expand_all(limit=100)
    leaves = [r.prefix for r in outline.rows() if r.entry is not None]
    assert leaves == [e.key for e in matches] and len(leaves) == 9


def test_empty_tree_has_no_rows(flat) -> None:
    root = build_tree(filter_entries(flat.entries(), "stored", "nothing-like-this", "substring"))
    outline = Outline(root)
    assert outline.rows() == [] and outline.expand_all(limit=10)
    page = entry_page(root, 3)
    assert (page.entries, page.total, page.number, page.pages) == ([], 0, 0, 1)


def test_entry_pages(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "prefixed")
    node = ck.tree("flattened").child("optimizer")
    under = [e for e in ck.entries() if e.key.startswith("optimizer.")]
    last = entry_page(node, 6)
    assert (last.start, last.total, last.number, last.pages) == (300, 315, 6, 7)
    assert last.entries == under[300:] and len(last.entries) == 15
    assert entry_page(node, 99).number == 6 and entry_page(node, -1).entries == under[:50]
    model = entry_page(ck.tree("flattened"), 0, size=400)
    assert "layers.0.attention.wq.weight" in model.keys
    assert "model.layers.0.attention.wq.weight" in [e.key for e in model.entries]


def test_expand_below_opens_a_subtree_up_to_a_cap(flat) -> None:
    keys = [k for k in flat.keys() if k.startswith("layers.")]
    inner = {".".join(k.split(".")[:i]) for k in keys for i in range(1, k.count(".") + 1)}
    outline = Outline(flat.tree())
    assert outline.expand_below("layers", limit=100) == (len(inner), False)
    shown = [r.prefix for r in outline.rows()]
    assert set(keys) | inner <= set(shown) and not outline.is_expanded("optimizer")
    capped = Outline(flat.tree())
    assert capped.expand_below("layers", limit=3) == (3, True)
    assert {p for p in inner if capped.is_expanded(p)} == {"layers", "layers.0", "layers.1"}
    assert capped.expand_below("layers.0.attention_norm.weight", limit=3) == (0, False)
