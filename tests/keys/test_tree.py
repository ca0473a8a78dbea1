"""The key tree: structure, totals per dtype, views, paging and lookup on real checkpoints."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import inspector
from inspector.errors import MissingKeyError
from inspector.keys.spellings import view_key
from inspector.keys.tree import Totals, build_tree
from tests.conftest import save_dcp


def _dtype(entry) -> str:
    return entry.dtype or entry.kind


def expected_totals(entries) -> dict[str, Totals]:
    out: dict[str, Totals] = {}
    for e in entries:
        count, numel, nbytes = out.get(_dtype(e), Totals())
        out[_dtype(e)] = Totals(count + 1, numel + e.numel, nbytes + e.nbytes)
    return out


@pytest.mark.parametrize("view", ["stored", "flattened", "prefixed"])
def test_root_totals_cover_every_entry(demo_dir: Path, view: str) -> None:
    ck = inspector.open(demo_dir / "flat")
    root = ck.tree(view)
    entries = ck.entries()
    assert (root.count, root.view, root.prefix) == (len(entries), view, "")
    assert root.nbytes == sum(e.nbytes for e in entries)
    assert root.numel == sum(e.numel for e in entries)
    assert root.by_dtype == expected_totals(entries)
    assert list(root.by_dtype) == sorted(root.by_dtype, key=lambda d: -root.by_dtype[d].nbytes)
    assert root.entries() == entries


def test_children_follow_stored_order(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "flat")
    heads = list(dict.fromkeys(k.split(".")[0] for k in ck.keys()))
    root = ck.tree()
    assert [c.name for c in root.children()] == heads
    layers = root.child("layers")
    assert [c.prefix for c in layers.children()] == ["layers.0", "layers.1"]
    optimizer = root.child("optimizer")
    assert optimizer.by_dtype == expected_totals(
        e for e in ck.entries() if e.key.startswith("optimizer.")
    )
    assert optimizer.by_dtype["object"].count == 21 * 12
    assert sum(c.count for c in root.children()) == root.count


def test_views_regroup_model_keys(demo_dir: Path) -> None:
    prefixed, flat = inspector.open(demo_dir / "prefixed"), inspector.open(demo_dir / "flat")
    assert prefixed.tree("flattened").find("layers.0").as_dict(2) == flat.tree().find(
        "layers.0"
    ).as_dict(2)
    model = flat.tree("prefixed").child("model")
    assert model.count == 21
    assert model.as_dict(1) == prefixed.tree().child("model").as_dict(1)
    assert "model" not in [c.name for c in flat.tree().children()]
    heads = dict.fromkeys(view_key(e, "flattened").split(".")[0] for e in prefixed.entries())
    assert [c.name for c in prefixed.tree("flattened").children()] == list(heads)
    assert "tok_embeddings" in heads and "model" not in heads


def test_leaf_and_lookup(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "prefixed")
    root = ck.tree()
    leaf = root.find("model.layers.1.feed_forward.w2.weight")
    assert leaf.is_leaf and leaf.entry is ck.entry("model.layers.1.feed_forward.w2.weight")
    assert (leaf.name, leaf.depth, leaf.count, leaf.nbytes) == ("weight", 6, 1, 64 * 128 * 4)
    layer = root.find("model.layers.1")
    assert layer.entry is None and not layer.is_leaf
    assert layer.find("model.layers.1.ffn_norm") is root.find("model.layers.1.ffn_norm")
    with pytest.raises(MissingKeyError, match=r"model\.layers\.7"):
        root.find("model.layers.7")
    with pytest.raises(KeyError, match="not below"):
        layer.find("model.layers.0.ffn_norm")
    with pytest.raises(ValueError, match="view must be one of"):
        ck.tree("hf")


def test_entries_page_in_stored_order(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "flat")
    node = ck.tree().child("optimizer")
    under = [e for e in ck.entries() if e.key.startswith("optimizer.")]
    assert node.entries(10, 20) == under[10:20]
    assert node.keys(0, 3) == [e.key for e in under[:3]]
    assert node.entries(len(under)) == []
    flattened = inspector.open(demo_dir / "prefixed").tree("flattened").child("norm")
    assert flattened.keys() == ["norm.weight"]


def test_walk_reaches_every_key_once(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "flat")
    leaves = [n.prefix for n in ck.tree().walk() if n.entry is not None]
    assert len(leaves) == len(ck.keys()) and set(leaves) == set(ck.keys())
    depths = Counter(n.depth for n in ck.tree().walk())
    assert depths[0] == 1 and depths[1] == len(ck.tree().children())


def test_a_key_can_also_be_a_prefix(tmp_path: Path) -> None:
    state = {"a": torch.ones(3), "a.b": torch.ones(2, dtype=torch.bfloat16)}
    ck = inspector.open(save_dcp(state, tmp_path / "ck"))
    node = ck.tree().find("a")
    assert node.entry is ck.entry("a") and not node.is_leaf
    assert node.count == 2 and [c.prefix for c in node.children()] == ["a.b"]
    assert node.by_dtype == {"float32": Totals(1, 3, 12), "bfloat16": Totals(1, 2, 4)}


def test_empty_segments_and_keys_that_are_prefixes(tmp_path: Path) -> None:
    """A key that is its node's prefix is not the empty segment of ``a.`` below it, and each
    level lists its children in the order their first key was stored."""
    state = {
        "a": torch.ones(1),
        "a.x": torch.ones(2),
        "b.y": torch.ones(3),
        "a.": torch.ones(4),
        "a..z": torch.ones(5),
        "a.x.w": torch.ones(6),
        "c": torch.ones(7),
        "c.": torch.ones(8),
        "c.x": torch.ones(9),
    }
    ck = inspector.open(save_dcp(state, tmp_path / "ck"))
    keys = ck.keys()
    root = ck.tree()
    assert [c.name for c in root.children()] == list(dict.fromkeys(k.split(".")[0] for k in keys))
    for head in ("a", "c"):
        node, below = root.child(head), [k for k in keys if k.startswith(f"{head}.")]
        names = list(dict.fromkeys(k.split(".")[1] for k in below))
        assert [c.name for c in node.children()] == names
        assert node.entry is ck.entry(head) and node.count == len(below) + 1
    assert [c.name for c in root.child("a").children()] == ["x", ""]  # as saved, if DCP keeps order
    empty = root.child("a").child("")
    assert (empty.prefix, empty.name, empty.depth, empty.count) == ("a.", "", 2, 2)
    assert empty.entry is ck.entry("a.") and [c.prefix for c in empty.children()] == ["a..z"]
    assert root.find("a..z").name == "z" and root.find("a..z").entry is ck.entry("a..z")
    assert root.find("a.x").by_dtype == {"float32": Totals(2, 8, 32)}
    assert root.find("c.").entry is ck.entry("c.") and root.find("c.").is_leaf
    walked = build_tree(ck.entries()).child("a")
    assert [n.prefix for n in walked.walk()] == ["a", "a.x", "a.x.w", "a.", "a..z"]
    assert walked.by_dtype == {"float32": Totals(5, 1 + 2 + 4 + 5 + 6, 4 * 18)}


def test_every_node_is_what_splitting_the_keys_gives(tmp_path: Path) -> None:
    """Random keys of few, often empty, segments: each node's keys, entry and children (in
    the order of their first key) are what splitting every key at its dots gives."""
    rng = random.Random(5)
    segments = ["a", "b", "", "cc"]
    made = {".".join(rng.choices(segments, k=rng.randint(1, 4))) for _ in range(80)}
    state = {k: torch.ones(i + 1) for i, k in enumerate(rng.sample(sorted(made), len(made)))}
    ck = inspector.open(save_dcp(state, tmp_path / "ck"))
    keys = ck.keys()
    split = [k.split(".") for k in keys]

    def check(node: Any, path: list[str]) -> int:
        below = [k for k, s in zip(keys, split, strict=True) if s[: len(path)] == path]
        assert node.keys() == below and node.prefix == ".".join(path)
        assert node.name == (path[-1] if path else "")
        here = [k for k, s in zip(keys, split, strict=True) if s == path]
        assert (node.entry.key if node.entry else None) == (here[0] if here else None)
        nexts = [s[len(path)] for s in split if s[: len(path)] == path and len(s) > len(path)]
        assert [c.name for c in node.children()] == list(dict.fromkeys(nexts))
        return 1 + sum(check(c, [*path, c.name]) for c in node.children())

    assert check(ck.tree(), []) == len({tuple(s[:n]) for s in split for n in range(len(s) + 1)})


def test_the_checkpoints_sizes_are_each_entrys_and_worked_out_once(demo_dir: Path) -> None:
    """What the header and the tree share: (dtype or kind, numel, nbytes) per entry."""
    ck = inspector.open(demo_dir / "fp8")
    sizes = ck.sizes()
    assert [(n, b) for _, n, b in sizes] == [(e.numel, e.nbytes) for e in ck.entries()]
    assert [d for d, _, _ in sizes] == [e.dtype or "object" for e in ck.entries()]
    assert ck.sizes() is sizes
    assert build_tree(ck.entries(), "flattened", sizes).by_dtype == expected_totals(ck.entries())
