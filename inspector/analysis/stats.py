"""Per-tensor statistics and histograms, computed chunk by chunk in bounded memory.

A tensor is visited one stored chunk at a time and each chunk in blocks of
``BLOCK`` elements, so a huge bf16 or float8 tensor never needs a float copy of
itself. min / max / mean / std / absmax / L2 norm are over the finite values; NaN
and Inf are counted separately; std uses Bessel's correction, like ``torch.std``.
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
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from inspector import dtypes
from inspector.checkpoint import Checkpoint, as_checkpoint
from inspector.errors import UnsupportedError
from inspector.progress import Counter, ProgressFn
from inspector.tensors import broadcast

if TYPE_CHECKING:
    import pandas
    from matplotlib.figure import Figure

BLOCK = 1 << 22
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


@dataclass
class _Moments:
    """Running count / mean / M2 (Chan et al. parallel update) plus extrema and counts."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    sumsq: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    zeros: int = 0
    nan: int = 0
    inf: int = 0

    def add(self, block: torch.Tensor, weight: int = 1) -> None:
        """Count every value of ``block`` ``weight`` times."""
        values = block.to(torch.float64)
        finite = torch.isfinite(values)
        self.nan += weight * int(torch.isnan(values).sum())
        self.inf += weight * int(torch.isinf(values).sum())
        self.zeros += weight * int((values == 0).sum())
        good = values[finite] if not bool(finite.all()) else values
        n = weight * good.numel()
        if n == 0:
            return
        mean = float(good.mean())
        m2 = weight * float(((good - mean) ** 2).sum())
        total = self.n + n
        delta = mean - self.mean
        self.m2 += m2 + delta * delta * self.n * n / total
        self.mean += delta * n / total
        self.n = total
        self.sumsq += weight * float((good * good).sum())
        self.min = min(self.min, float(good.min()))
        self.max = max(self.max, float(good.max()))


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


def _stats(ck: Checkpoint, key: str, counter: Counter) -> TensorStats:
    entry = ck.entry(key)
    if entry.kind == "tensor" and not supported(entry.dtype):
        raise UnsupportedError(
            f"no statistics for {entry.dtype} tensors (complex, packed or quantized values)",
            file=ck.location,
            key=key,
        )
    acc = _Moments()
    for block, weight in _weighted_blocks(ck, key, counter):
        acc.add(block, weight)
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
    """Histogram of a tensor's finite values, two streaming passes (range, then counts;
    give ``range``, e.g. a TensorStats' min and max, to spare the first)."""
    ck = as_checkpoint(ck)
    if bins < 1:
        raise UnsupportedError("bins must be >= 1", key=key)
    numel = ck.entry(key).numel
    counter = Counter(numel * (2 if range is None else 1), on_progress, cancel)
    if range is None:
        summary = _stats(ck, key, counter)
        range = (summary.min, summary.max)
    low, high = range
    if not (math.isfinite(low) and math.isfinite(high)):
        low, high = 0.0, 0.0
    if high <= low:
        high = low + 1.0
    counts = torch.zeros(bins, dtype=torch.int64)
    nan = inf = 0
    for block, weight in _weighted_blocks(ck, key, counter):
        values = block.to(torch.float64)
        nan += weight * int(torch.isnan(values).sum())
        inf += weight * int(torch.isinf(values).sum())
        values = values[torch.isfinite(values) & (values >= low) & (values <= high)]
        index = ((values - low) / (high - low) * bins).long().clamp_(0, bins - 1)
        counts += weight * torch.bincount(index, minlength=bins)
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
) -> pandas.DataFrame:
    """L2 norm per (layer index, parameter name within the layer), for per-layer plots:
    of the tensors matching the ``include`` globs, or exactly ``keys``."""
    import pandas
    from tqdm.auto import tqdm

    chosen = list(keys) if keys is not None else _matching(ck, include)
    layered = [(k, layer_index(k)) for k in chosen]
    layered = [(k, i) for k, i in layered if i is not None]
    counter = Counter(sum(ck.entry(k).numel for k, _ in layered), on_progress, cancel)
    rows = []
    for key, index in tqdm(layered, desc="norms", disable=not progress):
        l2 = _stats(ck, key, counter).l2
        rows.append({"layer": index, "name": layer_name(key), "key": key, "l2": l2})
    return pandas.DataFrame(rows, columns=["layer", "name", "key", "l2"])


def plot_layer_norms(
    ck: Checkpoint, include: Iterable[str] | None = None, *, ax: Any = None
) -> Figure:
    """One line per parameter name: L2 norm against the layer index parsed from the key."""
    return plot_by_layer(layer_norms(ck, include, progress=False), "l2", "L2 norm", ax=ax)


def plot_by_layer(table: pandas.DataFrame, value: str, label: str, *, ax: Any = None) -> Figure:
    """One line per ``name`` of a table with ``layer``, ``name`` and ``value`` columns."""
    fig, ax = _axes(ax)
    for name, group in table.groupby("name", sort=True):
        group = group.sort_values("layer")
        ax.plot(group["layer"], group[value], marker="o", label=name)
    ax.set_xlabel("layer")
    ax.set_ylabel(label)
    ax.xaxis.get_major_locator().set_params(integer=True)  # layers are whole numbers
    if len(table):
        ax.legend(fontsize="small")
    return fig


def _axes(ax: Any) -> tuple[Any, Any]:
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.2), layout="constrained")
    return fig, fig.add_subplot()
