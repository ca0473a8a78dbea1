"""The tensor panel's numbers: a tensor's statistics, its histogram and the L2 norm of the
same parameter in every layer, read block by block in one job with one progress bar."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from inspector.analysis.stats import (
    Histogram,
    TensorStats,
    layer_norms,
    norms_table,
    plot_by_layer,
    same_parameter,
    summarize,
)
from inspector.checkpoint import Checkpoint
from inspector.ui.views.plots import png

if TYPE_CHECKING:
    import pandas

HISTOGRAM_BINS = 64
STAT_FIELDS = ("min", "max", "mean", "std", "absmax", "l2", "zeros", "nan", "inf")


@dataclass(frozen=True)
class TensorNumbers:
    """``stats`` of one tensor, then its ``histogram``, then ``norms``: the per-layer L2 norms
    of its parameter (None until known, and when it is not inside the layers or has no
    peers); ``partial`` while more is coming, or when a cancel cut the norms short."""

    stats: TensorStats
    histogram: Histogram | None = None
    norms: pandas.DataFrame | None = None
    partial: bool = True

    def rows(self) -> list[tuple[str, str]]:
        return [(name, number_text(getattr(self.stats, name))) for name in STAT_FIELDS]

    def histogram_png(self) -> bytes | None:
        return None if self.histogram is None else png(self.histogram.plot())

    def norms_png(self) -> bytes | None:
        if self.norms is None or not len(self.norms):
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
    on_part: Callable[[TensorNumbers], None] | None = None,
) -> TensorNumbers:
    """One read of the tensor gives its statistics, then the histogram over their range;
    then one read of each peer gives the norms per layer. ``on_part`` hears each stage as
    soon as it exists (and the norms so far when a cancel stops them); ``report`` hears
    elements read of all the reads together."""
    peers = same_parameter(ck, key)
    peers = peers if len(peers) > 1 else []
    numel = ck.entry(key).numel
    total = numel + sum(ck.entry(k).numel for k in peers)
    tell = on_part or (lambda _numbers: None)

    def phase(start: int, text: str) -> Callable[[int, int], None]:
        return lambda done, _total: report(start + done, total, text)

    found, counts = summarize(
        ck,
        key,
        bins,
        on_stats=lambda numbers: tell(TensorNumbers(numbers)),
        on_progress=phase(0, "statistics"),
        cancel=cancel,
    )
    numbers = TensorNumbers(found, counts, partial=bool(peers))
    tell(numbers)
    if peers:
        rows: list[dict] = []
        try:
            layer_norms(
                ck,
                keys=peers,
                progress=False,
                on_progress=phase(numel, "norms per layer"),
                cancel=cancel,
                rows=rows,
            )
        finally:
            numbers = replace(numbers, norms=norms_table(rows), partial=len(rows) < len(peers))
            tell(numbers)
    report(total, total, "done")
    return numbers


def number_text(value: float | int) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:.6g}"
