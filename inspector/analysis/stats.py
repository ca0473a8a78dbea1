"""Per-tensor statistics and histograms, from one read of the tensor in bounded memory.

A tensor is visited one stored chunk at a time and each chunk in blocks of ``BLOCK``
elements, tallied as :mod:`inspector.analysis.tally` says (by bit pattern for values of one
or two bytes, by float64 moments otherwise), so a huge bf16 or float8 tensor never needs a
float copy of itself. min / max / mean / std / absmax / L2 norm are over the finite values;
NaN and Inf are counted separately; std uses Bessel's correction, like ``torch.std``.
A view that repeats its stored values (stride 0, ``expand``) is summarised from the values
it stores, each counted as often as it is repeated: the same numbers, without expanding it.
``on_progress(done, total)`` hears of each block (elements) and a set ``cancel`` event
stops the work between blocks (:mod:`inspector.progress`), for callers in worker threads.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from inspector import dtypes
from inspector.analysis.tally import (
    BlockTally,
    Moments,
    Tally,
    count_blocks,
    span,
    sum_of_squares,
    tally_for,
)
from inspector.checkpoint import Checkpoint, as_checkpoint
from inspector.errors import UnsupportedError
from inspector.progress import Counter, ProgressFn
from inspector.tensors import broadcast

if TYPE_CHECKING:
    import pandas
    from matplotlib.figure import Figure

BLOCK = 1 << 22
DECADES = 2  # per-layer plots switch to a log scale past this many decades of values
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|layer)\.(\d+)\.")


@dataclass(frozen=True)
class TensorStats:
    """Summary numbers of one tensor (float fields are NaN when there is no finite value)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    min: float
    max: float
    mean: float
    std: float
    absmax: float
    l2: float
    zeros: int
    nan: int
    inf: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _weighted_blocks(
    ck: Checkpoint, key: str, counter: Counter | None = None
) -> Iterator[tuple[torch.Tensor, int]]:
    """Each stored chunk's values in blocks, with how often each value is repeated;
    ``counter`` hears of the elements each block stands for (and checks cancel)."""
    if counter is not None:
        counter.step(0)
    for _chunk, part in ck.iter_chunks(key):
        weight = broadcast.repeats(part)
        for block in broadcast.flat_blocks(broadcast.stored(part), BLOCK):
            yield block, weight
            if counter is not None:
                counter.step(block.numel() * weight)


def supported(dtype: str | None) -> bool:
    """Real-valued dtypes torch can convert to float64 (not complex, packed or quantized)."""
    return dtype is not None and dtypes.is_real(dtype)


def stats(
    ck: Checkpoint | str | os.PathLike,
    key: str,
    *,
    on_progress: ProgressFn | None = None,
    cancel: threading.Event | None = None,
) -> TensorStats:
    """Statistics of one tensor, reading it chunk by chunk."""
    ck = as_checkpoint(ck)
    entry = ck.entry(key)
    return _stats(ck, key, Counter(entry.numel, on_progress, cancel))


def _tally(ck: Checkpoint, key: str, counter: Counter, *, keep: bool) -> Tally:
    """One read of the tensor's values into the tally its dtype calls for."""
    entry = ck.entry(key)
    if entry.kind == "tensor" and not supported(entry.dtype):
        raise UnsupportedError(
            f"no statistics for {entry.dtype} tensors (complex, packed or quantized values)",
            file=ck.location,
            key=key,
        )
    found: Tally | None = None
    for block, weight in _weighted_blocks(ck, key, counter):
        if found is None:
            found = tally_for(block.dtype, keep=keep)
        found.add(block, weight)
    return found if found is not None else tally_for(torch.float64, keep=keep)


def _numbers(ck: Checkpoint, key: str, acc: Moments) -> TensorStats:
    entry = ck.entry(key)
    nan = math.nan
    has = acc.n > 0
    return TensorStats(
        key=key,
        dtype=entry.dtype or "",
        shape=tuple(entry.shape or ()),
        numel=entry.numel,
        min=acc.min if has else nan,
        max=acc.max if has else nan,
        mean=acc.mean if has else nan,
        std=math.sqrt(acc.m2 / (acc.n - 1)) if acc.n > 1 else nan,
        absmax=max(abs(acc.min), abs(acc.max)) if has else nan,
        l2=math.sqrt(acc.sumsq),
        zeros=acc.zeros,
        nan=acc.nan,
        inf=acc.inf,
    )


def _stats(ck: Checkpoint, key: str, counter: Counter) -> TensorStats:
    return _numbers(ck, key, _tally(ck, key, counter, keep=False).moments())


def _matching(ck: Checkpoint, include: Iterable[str] | None) -> list[str]:
    from fnmatch import fnmatchcase

    patterns = list(include) if include is not None else None
    return [
        e.key
        for e in ck.entries()
        if e.kind == "tensor"
        and not ck.facts(e.key).error
        and supported(e.dtype)
        and (patterns is None or any(fnmatchcase(e.key, p) for p in patterns))
    ]


def stats_table(
    ck: Checkpoint, include: Iterable[str] | None = None, *, progress: bool = True
) -> pandas.DataFrame:
    """One row of statistics per tensor key matching the ``include`` globs (all by default)."""
    import pandas
    from tqdm.auto import tqdm

    keys = _matching(ck, include)
    rows = [stats(ck, k).as_dict() for k in tqdm(keys, desc="stats", disable=not progress)]
    columns = list(TensorStats.__dataclass_fields__)
    return pandas.DataFrame.from_records(rows, columns=columns)


@dataclass(frozen=True)
class Histogram:
    """Bin counts over the finite values; ``edges`` has one more element than ``counts``."""

    key: str
    counts: torch.Tensor
    edges: torch.Tensor
    nan: int
    inf: int

    def plot(self, *, log: bool = False, ax: Any = None) -> Figure:
        """A matplotlib figure of the bars (log-scaled counts on request)."""
        fig, ax = _axes(ax)
        widths = (self.edges[1:] - self.edges[:-1]).numpy()
        ax.bar(self.edges[:-1].numpy(), self.counts.numpy(), width=widths, align="edge")
        extra = f"  (NaN {self.nan}, Inf {self.inf})" if self.nan or self.inf else ""
        ax.set_title(f"{self.key}{extra}")
        ax.set_xlabel("value")
        ax.set_ylabel("count")
        if log:
            ax.set_yscale("log")
        return fig


def histogram(
    ck: Checkpoint | str | os.PathLike,
    key: str,
    bins: int = 64,
    range: tuple[float, float] | None = None,
    *,
    on_progress: ProgressFn | None = None,
    cancel: threading.Event | None = None,
) -> Histogram:
    """Histogram of a tensor's finite values over ``range`` (by default their min to max),
    in one read."""
    ck = as_checkpoint(ck)
    if range is None:
        return summarize(ck, key, bins, on_progress=on_progress, cancel=cancel)[1]
    _check_bins(bins, key)
    counter = Counter(ck.entry(key).numel, on_progress, cancel)
    found = _tally(ck, key, counter, keep=True)
    return _histogram_of(ck, key, found, span(*range), bins, on_progress, cancel)


def summarize(
    ck: Checkpoint | str | os.PathLike,
    key: str,
    bins: int = 64,
    *,
    on_stats: Callable[[TensorStats], None] | None = None,
    on_progress: ProgressFn | None = None,
    cancel: threading.Event | None = None,
) -> tuple[TensorStats, Histogram]:
    """Statistics and the histogram over their range from one read of the tensor;
    ``on_stats`` hears the numbers as soon as they exist, before the histogram is counted."""
    ck = as_checkpoint(ck)
    _check_bins(bins, key)
    counter = Counter(ck.entry(key).numel, on_progress, cancel)
    found = _tally(ck, key, counter, keep=True)
    numbers = _numbers(ck, key, found.moments())
    if on_stats is not None:
        on_stats(numbers)
    low, high = span(numbers.min, numbers.max)
    return numbers, _histogram_of(ck, key, found, (low, high), bins, on_progress, cancel)


def _check_bins(bins: int, key: str) -> None:
    if bins < 1:
        raise UnsupportedError("bins must be >= 1", key=key)


def _histogram_of(
    ck: Checkpoint,
    key: str,
    found: Tally,
    range: tuple[float, float],
    bins: int,
    on_progress: ProgressFn | None,
    cancel: threading.Event | None,
) -> Histogram:
    """The histogram from a tally, or from a second read when it could not keep its values."""
    low, high = range
    if isinstance(found, BlockTally) and not found.kept:
        counter = Counter(ck.entry(key).numel, on_progress, cancel)
        counts, nan, inf = count_blocks(_weighted_blocks(ck, key, counter), low, high, bins)
    else:
        counts, nan, inf = found.histogram(low, high, bins)
    edges = torch.linspace(low, high, bins + 1, dtype=torch.float64)
    return Histogram(key, counts, edges, nan, inf)


def layer_index(key: str) -> int | None:
    """The block index in a key such as ``layers.12.attention.wq.weight`` (None if none)."""
    match = _LAYER.search(key)
    return int(match.group(1)) if match else None


def layer_name(key: str) -> str | None:
    """The key with its block index as ``*`` (``layers.*.attention.wq.weight``): the same
    parameter in every layer has the same name; None for keys outside the layers."""
    if _LAYER.search(key) is None:
        return None
    return _LAYER.sub(lambda m: m.group(0).replace(m.group(1), "*"), key, count=1)


def same_parameter(ck: Checkpoint, key: str) -> list[str]:
    """The keys of ``key``'s parameter in every layer (itself included), in layer order;
    empty when the key is outside the layers."""
    name = layer_name(key)
    if name is None:
        return []
    found = [k for k in _matching(ck, None) if layer_name(k) == name]
    return sorted(found, key=lambda k: layer_index(k) or 0)


def layer_norms(
    ck: Checkpoint,
    include: Iterable[str] | None = None,
    *,
    keys: Iterable[str] | None = None,
    progress: bool = True,
    on_progress: ProgressFn | None = None,
    cancel: threading.Event | None = None,
    rows: list[dict[str, Any]] | None = None,
) -> pandas.DataFrame:
    """L2 norm per (layer index, parameter name within the layer), for per-layer plots:
    of the tensors matching the ``include`` globs, or exactly ``keys``, one read each.
    ``rows``, when given, receives each row as it is found (so a cancel keeps them)."""
    from tqdm.auto import tqdm

    chosen = list(keys) if keys is not None else _matching(ck, include)
    layered = [(k, layer_index(k)) for k in chosen]
    layered = [(k, i) for k, i in layered if i is not None]
    counter = Counter(sum(ck.entry(k).numel for k, _ in layered), on_progress, cancel)
    found = rows if rows is not None else []
    for key, index in tqdm(layered, desc="norms", disable=not progress):
        l2 = math.sqrt(sum(w * sum_of_squares(b) for b, w in _weighted_blocks(ck, key, counter)))
        found.append({"layer": index, "name": layer_name(key), "key": key, "l2": l2})
    return norms_table(found)


def norms_table(rows: list[dict[str, Any]]) -> pandas.DataFrame:
    """The table :func:`layer_norms` returns, from its rows."""
    import pandas

    return pandas.DataFrame(rows, columns=["layer", "name", "key", "l2"])


def plot_layer_norms(
    ck: Checkpoint, include: Iterable[str] | None = None, *, ax: Any = None
) -> Figure:
    """One line per parameter name: L2 norm against the layer index parsed from the key."""
    return plot_by_layer(layer_norms(ck, include, progress=False), "l2", "L2 norm", ax=ax)


def plot_by_layer(table: pandas.DataFrame, value: str, label: str, *, ax: Any = None) -> Figure:
    """One line per ``name`` of a table with ``layer``, ``name`` and ``value`` columns; the
    legend beside the axes (never over a line), a log scale when values span decades."""
    fig, ax = _axes(ax)
    for name, group in table.groupby("name", sort=True):
        group = group.sort_values("layer")
        ax.plot(group["layer"], group[value], marker="o", label=name)
    ax.set_xlabel("layer")
    ax.set_ylabel(label)
    ax.xaxis.get_major_locator().set_params(integer=True)  # layers are whole numbers
    _scale(ax, table[value])
    if len(table):
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    return fig


def _scale(ax: Any, values: pandas.Series) -> None:
    """A log y axis when the positive values span more than ``DECADES`` decades (symmetric
    log, linear below the smallest of them, when there are zeros too)."""
    positive = values[values > 0]
    if not len(positive) or positive.max() < 10**DECADES * positive.min():
        return
    if (values <= 0).any():
        ax.set_yscale("symlog", linthresh=float(positive.min()))
    else:
        ax.set_yscale("log")


def _axes(ax: Any) -> tuple[Any, Any]:
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.2), layout="constrained")
    return fig, fig.add_subplot()
