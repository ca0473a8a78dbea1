"""Counts in words, for every human-readable line the package writes."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` with its noun in the right number: ``1 rank``, ``2 ranks``, ``1,024 keys``."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
