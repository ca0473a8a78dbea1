"""Counts in words (inspector/words.py)."""

from __future__ import annotations

from inspector.words import counted


def test_a_count_takes_its_noun_in_the_right_number() -> None:
    assert counted(1, "file") == "1 file"
    assert counted(0, "file") == "0 files"
    assert counted(1024, "key") == "1,024 keys"
    assert counted(2, "index", "indices") == "2 indices"
