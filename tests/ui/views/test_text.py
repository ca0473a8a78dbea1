"""Sizes, shapes and untrusted text as people read them."""

from __future__ import annotations

import io
from pathlib import Path

import inspector
from inspector.ui.views.text import TerminalStream, human_bytes, shape_text, terminal_text


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


def test_terminal_text_spells_every_active_character_visibly() -> None:
    hostile = "a\x1b]52;c;eA==\x07b\rc\u202ed\x00e\x9bf\ud800g\u2028h\u2066"
    assert terminal_text(hostile) == (
        "a\\x1b]52;c;eA==\\x07b\\rc\\u202ed\\x00e\\x9bf\\ud800g\\u2028h\\u2066"
    ).replace("\\r", "\\x0d")
    assert terminal_text("plain\ttext\nnext line é 漢") == "plain\ttext\nnext line é 漢"


def test_terminal_stream_escapes_what_it_writes_and_keeps_json() -> None:
    import json

    inner = io.StringIO()
    stream = TerminalStream(inner)
    print("key \x1b[2J", file=stream)
    json.dump({"k\x1b\ud800": 1}, stream, indent=1)
    text = inner.getvalue()
    first, _, rest = text.partition("\n")
    assert first == "key \\x1b[2J"
    assert json.loads(rest) == {"k\x1b\ud800": 1}
