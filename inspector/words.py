"""Counts in words, for every human-readable line the package writes."""

from __future__ import annotations


def inflected(n: int, word: str, plural: str | None = None) -> str:
    """``word`` as ``n`` of it asks: ``rank`` for 1, ``ranks`` (or ``plural``) otherwise."""
    return word if n == 1 else plural or word + "s"


def counted(n: int, word: str, plural: str | None = None) -> str:
    """``n`` with its word in the right number: ``1 rank``, ``2 ranks``, ``1,024 keys``."""
    return f"{n:,} {inflected(n, word, plural)}"
