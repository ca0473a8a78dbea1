"""Small HTML builders for the panels: tables, key/value facts, badges (all text escaped)."""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from typing import Any

from inspector.keys.tree import Totals
from inspector.ui.views.text import human_bytes

# Every colour is one of JupyterLab's theme variables (light fallbacks outside JupyterLab),
# so the light, dark and high-contrast themes all read well.
STYLE = """<style>
.inspector-app { color: var(--jp-ui-font-color1, rgba(0,0,0,.87)); }
.inspector-rows { font-family: var(--jp-code-font-family, monospace); font-size: 12px;
  color: var(--jp-ui-font-color1, rgba(0,0,0,.87)); background: var(--jp-layout-color1, white);
  border: 1px solid var(--jp-border-color1, #bdbdbd); overflow: auto; outline: none; }
.inspector-rows:focus { border-color: var(--jp-brand-color1, #1976d2); }
.inspector-row { display: flex; align-items: center; white-space: pre; line-height: 1.6em;
  padding: 0 4px; cursor: pointer; }
.inspector-row span { flex: 1; overflow: hidden; text-overflow: ellipsis; }
.inspector-row.inspector-selected { background: var(--jp-layout-color3, #bdbdbd); }
.inspector-rows:focus .inspector-cursor { outline: 1px dashed var(--jp-ui-font-color1, black);
  outline-offset: -1px; }
.inspector-row-copy { visibility: hidden; font-size: 10px; padding: 0 6px; cursor: pointer;
  color: var(--jp-ui-font-color1, rgba(0,0,0,.87)); background: var(--jp-layout-color2, #eee);
  border: 1px solid var(--jp-border-color1, #bdbdbd); border-radius: 2px; }
.inspector-row:hover .inspector-row-copy, .inspector-cursor .inspector-row-copy {
  visibility: visible; }
.inspector-tensor, .inspector-tensor * { user-select: text; }
.inspector-table { border-collapse: collapse; font-size: 12px; margin: 4px 0; line-height: 1.5;
  color: var(--jp-ui-font-color1, rgba(0,0,0,.87)); }
.inspector-table th { text-align: left; background: var(--jp-layout-color2, #eee);
  color: var(--jp-ui-font-color1, rgba(0,0,0,.87)); }
.inspector-table th, .inspector-table td { padding: 2px 8px;
  border-bottom: 1px solid var(--jp-border-color2, #e0e0e0);
  font-family: var(--jp-code-font-family, monospace); white-space: nowrap; }
.inspector-badge { display: inline-block; padding: 1px 8px; border-radius: 10px;
  color: var(--jp-layout-color0, white); font-weight: bold; font-size: 12px; }
.inspector-note { color: var(--jp-ui-font-color2, rgba(0,0,0,.54)); font-size: 12px; }
.inspector-failure { border-left: 4px solid var(--jp-error-color1, #d32f2f);
  background: var(--jp-layout-color2, #eee); color: var(--jp-ui-font-color1, rgba(0,0,0,.87));
  padding: 6px 10px; border-radius: 4px; }
.inspector-failure b { color: var(--jp-error-color1, #d32f2f); }
</style>"""
COLORS = {
    "ok": "var(--jp-success-color0, #1b5e20)",
    "warn": "var(--jp-warn-color0, #e65100)",
    "bad": "var(--jp-error-color0, #b71c1c)",
    "info": "var(--jp-brand-color0, #0d47a1)",
}


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
