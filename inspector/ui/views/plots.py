"""Figures as PNG bytes for the app's image widgets (an Agg canvas, no pyplot state).

Titles, labels and legends carry key names from the checkpoint: they are drawn as plain
text (never mathtext or TeX, which a ``$...$`` key would drive into parse errors or deep
recursion) and cut to ``LABEL_CHARS`` (a 200,000-character key would take minutes to lay
out)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 72
LABEL_CHARS = 120


def png(figure: Figure, dpi: int = DPI) -> bytes:
    """The figure drawn to PNG bytes, every text in it plain and bounded."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    with matplotlib.rc_context({"text.parse_math": False, "text.usetex": False}):
        plain_text(figure)
        figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def plain_text(figure: Figure) -> None:
    """Every text of ``figure`` drawn as the characters it holds, at most ``LABEL_CHARS``."""
    from matplotlib.text import Text

    for text in figure.findobj(Text):
        text.set_parse_math(False)
        text.set_usetex(False)
        text.set_text(bounded_label(text.get_text()))


def bounded_label(text: str) -> str:
    """``text`` cut to ``LABEL_CHARS`` characters, an ellipsis marking the cut."""
    return text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 1] + "\u2026"
