"""Figures as PNG bytes for the app's image widgets (an Agg canvas, no pyplot state)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 72


def png(figure: Figure, dpi: int = DPI) -> bytes:
    """The figure drawn to PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()
