"""Header: the checkpoint's path, format, layout badge with its reason, and its totals."""

from __future__ import annotations

import ipywidgets as w

from inspector.checkpoint import Checkpoint
from inspector.keys.tree import Totals
from inspector.ui.views.summary import summarize
from inspector.ui.views.text import human_bytes
from inspector.ui.widgets.markup import badge, esc, pre, totals_table

LAYOUT_TONES = {"flat": "ok", "model-only": "ok", "prefixed": "warn", "unknown": "bad"}


class Header(w.HTML):
    """Everything known from metadata alone, at the top of the app."""

    def __init__(self, ck: Checkpoint) -> None:
        super().__init__()
        self.add_class("inspector-header")
        s = summarize(ck)
        model = s.by_component.get("model", Totals())
        ranks = f"{s.ranks} ranks" if s.ranks else "ranks not recorded"
        tone = LAYOUT_TONES.get(s.layout, "warn")
        line = (
            f"<b>{esc(ck.format)}</b> &middot; layout {badge(s.layout, tone)} "
            f"{esc(s.layout_reason)}<br>{s.keys:,} keys &middot; model: {model.numel:,} "
            f"parameters ({human_bytes(model.nbytes)}) &middot; all tensors: "
            f"{s.tensors.count:,}, {human_bytes(s.tensors.nbytes)} &middot; {s.files} files "
            f"&middot; {ranks}"
        )
        self.value = (
            f'<div style="font-size:14px"><code>{esc(ck.location)}</code></div><div>{line}</div>'
            '<details><summary class="inspector-note">how the layout was decided</summary>'
            f"{pre(ck.describe_layout())}</details>"
            '<div style="display:flex;gap:24px;flex-wrap:wrap">'
            f"<div>{totals_table('dtype', s.by_dtype)}</div>"
            f"<div>{totals_table('component', s.by_component)}</div></div>"
        )
