"""Small HTML builders for the panels: tables, key/value facts, badges (all text escaped)."""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from typing import Any

from inspector.keys.tree import Totals
from inspector.ui.views.text import human_bytes

STYLE = """<style>
.inspector-tree select { font-family: var(--jp-code-font-family, monospace); font-size: 12px; }
.inspector-table { border-collapse: collapse; font-size: 12px; margin: 4px 0; line-height: 1.5; }
.inspector-table th { text-align: left; background: #f3f3f3; }
.inspector-table th, .inspector-table td { padding: 2px 8px; border-bottom: 1px solid #e0e0e0;
  font-family: var(--jp-code-font-family, monospace); white-space: nowrap; }
.inspector-badge { display: inline-block; padding: 1px 8px; border-radius: 10px; color: white;
  font-weight: bold; font-size: 12px; }
.inspector-note { color: #555; font-size: 12px; }
</style>"""
COLORS = {"ok": "#2e7d32", "warn": "#ef6c00", "bad": "#c62828", "info": "#1565c0"}


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], *, more: int = 0) -> str:
    """An escaped table; ``more`` rows left out are announced below it."""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    tail = f'<div class="inspector-note">... and {more:,} more</div>' if more else ""
    return f'<table class="inspector-table"><tr>{head}</tr>{body}</table>{tail}'


def limited(header: Sequence[str], rows: Sequence[Sequence[Any]], limit: int) -> str:
    """The first ``limit`` rows as a table, saying how many more there are."""
    return table(header, rows[:limit], more=max(0, len(rows) - limit))


def facts(pairs: Iterable[tuple[str, Any]]) -> str:
    """A two-column table of names and values (None values are left out)."""
    rows = "".join(
        f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in pairs if v is not None
    )
    return f'<table class="inspector-table">{rows}</table>'


def badge(text: str, tone: str = "info") -> str:
    return f'<span class="inspector-badge" style="background:{COLORS[tone]}">{esc(text)}</span>'


def heading(text: str) -> str:
    return f'<div style="font-weight:bold;margin-top:8px">{esc(text)}</div>'


def note(text: str) -> str:
    return f'<div class="inspector-note">{esc(text)}</div>'


def pre(text: str) -> str:
    return f'<pre style="font-size:12px;margin:4px 0;white-space:pre-wrap">{esc(text)}</pre>'


def totals_table(group: str, totals: dict[str, Totals]) -> str:
    """Keys, elements and size per group (dtype, component)."""
    rows = [
        (name, f"{t.count:,}", f"{t.numel:,}", human_bytes(t.nbytes)) for name, t in totals.items()
    ]
    return table((group, "keys", "elements", "size"), rows)
