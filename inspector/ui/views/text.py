"""How sizes and shapes read to a person (shared by the command line and the Jupyter app)."""

from __future__ import annotations

from typing import Any

from inspector.entry import Entry
from inspector.reprs import bounded_repr


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` with its noun in the right number: ``1 rank``, ``2 ranks``, ``1,024 keys``."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def human_bytes(n: int) -> str:
    """Decimal units, like file managers and Hugging Face: 1.5 MB is 1,500,000 bytes."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"


def shape_text(entry: Entry) -> str:
    """``64x64``, ``scalar`` for a 0-d tensor, ``-`` for a non-tensor value."""
    if entry.shape:
        return "x".join(map(str, entry.shape))
    return "scalar" if entry.kind == "tensor" else "-"


def value_text(value: Any, budget: int = 4000) -> str:
    """A decoded value as text, cut at ``budget`` characters (shared parts and cycles safe)."""
    return bounded_repr(value, budget)
