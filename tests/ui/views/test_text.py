"""Sizes and shapes as people read them."""

from __future__ import annotations

from pathlib import Path

import inspector
from inspector.ui.views.text import human_bytes, shape_text


def test_human_bytes_uses_decimal_units() -> None:
    assert [human_bytes(n) for n in (0, 999, 1000, 1500, 460_032, 5 * 10**9)] == [
        "0 B",
        "999 B",
        "1.0 KB",
        "1.5 KB",
        "460.0 KB",
        "5.0 GB",
    ]
    assert human_bytes(3 * 10**15) == "3000.0 TB"


def test_shape_text(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "flat")
    assert shape_text(ck.entry("tok_embeddings.weight")) == "256x64"
    assert shape_text(ck.entry("norm.weight")) == "64"
    assert shape_text(ck.entry("train_state.step")) == "scalar"
    assert shape_text(ck.entry("lr_scheduler.last_epoch")) == "-"
