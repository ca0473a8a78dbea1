"""Header totals: keys, elements and bytes per dtype and component, files and ranks."""

from __future__ import annotations

from pathlib import Path

import inspector
from inspector.demo.model import build_model
from inspector.entry import COMPONENTS
from inspector.keys.tree import Totals
from inspector.ui.views.summary import summarize


def test_fp8_demo_totals(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "fp8")
    s = summarize(ck)
    params = build_model().state_dict()
    assert (s.layout, s.keys, s.files, s.ranks) == ("flat", 347, 3, 2)
    assert "torchtitan's current layout" in s.layout_reason
    assert s.by_component["model"] == Totals(
        21, sum(p.numel() for p in params.values()), sum(p.numel() * 4 for p in params.values())
    )
    assert list(s.by_component) == [c for c in COMPONENTS if c in s.by_component]
    assert {c: t.count for c, t in s.by_component.items()} == ck.components()
    assert s.by_dtype == ck.tree().by_dtype
    assert list(s.by_dtype) == sorted(s.by_dtype, key=lambda d: -s.by_dtype[d].nbytes)
    tensors = [e for e in ck.entries() if e.kind == "tensor"]
    assert s.tensors == Totals(
        len(tensors), sum(e.numel for e in tensors), sum(e.nbytes for e in tensors)
    )


def test_layouts_and_formats(demo_dir: Path, tmp_path: Path) -> None:
    seed = summarize(inspector.open(demo_dir / "seed"))
    assert (seed.layout, seed.ranks, seed.files) == ("model-only", 1, 2)
    assert list(seed.by_component) == ["model"]
    prefixed = summarize(inspector.open(demo_dir / "prefixed"))
    assert prefixed.layout == "prefixed" and "PR #1347" in prefixed.layout_reason
    inspector.export(demo_dir / "seed", tmp_path / "out", progress=False)
    exported = summarize(inspector.open(tmp_path / "out" / "model.safetensors"))
    assert (exported.ranks, exported.files, exported.keys) == (None, 1, 21)
    assert exported.by_dtype == {"float32": seed.by_dtype["float32"]}
