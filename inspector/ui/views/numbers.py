"""The tensor panel's numbers: a tensor's statistics, its histogram and the L2 norm of the
same parameter in every layer, read block by block in one job with one progress bar."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inspector.analysis.stats import (
    Histogram,
    TensorStats,
    histogram,
    layer_norms,
    plot_by_layer,
    same_parameter,
    stats,
)
from inspector.checkpoint import Checkpoint
from inspector.ui.views.plots import png

if TYPE_CHECKING:
    import pandas

HISTOGRAM_BINS = 64
STAT_FIELDS = ("min", "max", "mean", "std", "absmax", "l2", "zeros", "nan", "inf")


@dataclass(frozen=True)
class TensorNumbers:
    """``stats`` and ``histogram`` of one tensor; ``norms`` the per-layer L2 norms of its
    parameter (None when it is not inside the layers or has no peers)."""

    stats: TensorStats
    histogram: Histogram
    norms: pandas.DataFrame | None

    def rows(self) -> list[tuple[str, str]]:
        return [(name, number_text(getattr(self.stats, name))) for name in STAT_FIELDS]

    def histogram_png(self) -> bytes:
        return png(self.histogram.plot())

    def norms_png(self) -> bytes | None:
        if self.norms is None:
            return None
        figure = plot_by_layer(self.norms, "l2", "L2 norm")
        axes = figure.axes[0]
        axes.set_title(f"{self.norms['name'].iloc[0]}: L2 norm per layer")
        legend = axes.get_legend()
        if legend is not None:
            legend.remove()  # one line: the title names it
        return png(figure)


def tensor_numbers(
    ck: Checkpoint,
    key: str,
    report: Callable[[int, int, str], None],
    cancel: threading.Event,
    bins: int = HISTOGRAM_BINS,
) -> TensorNumbers:
    """Statistics, then the histogram over their range, then the peers' norms; ``report``
    hears elements read of all three passes together."""
    peers = same_parameter(ck, key)
    peers = peers if len(peers) > 1 else []
    numel = ck.entry(key).numel
    total = 2 * numel + sum(ck.entry(k).numel for k in peers)

    def phase(start: int, text: str) -> Callable[[int, int], None]:
        return lambda done, _total: report(start + done, total, text)

    found = stats(ck, key, on_progress=phase(0, "statistics"), cancel=cancel)
    finite = math.isfinite(found.min) and math.isfinite(found.max)
    span = (found.min, found.max) if finite else (0.0, 0.0)
    counts = histogram(ck, key, bins, span, on_progress=phase(numel, "histogram"), cancel=cancel)
    norms = None
    if peers:
        norms = layer_norms(
            ck,
            keys=peers,
            progress=False,
            on_progress=phase(2 * numel, "norms per layer"),
            cancel=cancel,
        )
    report(total, total, "done")
    return TensorNumbers(found, counts, norms)


def number_text(value: float | int) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:.6g}"
