"""Counts in words (inspector/words.py)."""

from __future__ import annotations

from inspector.words import counted, inflected


def test_a_count_takes_its_noun_in_the_right_number() -> None:
    assert counted(1, "file") == "1 file"
    assert counted(0, "file") == "0 files"
    assert counted(1024, "key") == "1,024 keys"
    assert counted(2, "index", "indices") == "2 indices"


def test_a_word_alone_takes_the_number_of_its_count() -> None:
    assert inflected(1, "rank") == "rank"
    assert inflected(3, "rank") == "ranks"
    assert inflected(2, "file is", "files are") == "files are"
