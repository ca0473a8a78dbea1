"""One pass over a tensor's values that yields its summary numbers and its histogram.

Values of one or two bytes (bf16, fp16, the float8 kinds, int8, uint8, int16, bool) are
tallied by bit pattern: a ``bincount`` of at most 65,536 patterns per block, from which
every number and any binning follow exactly, without a second read. Wider values are
summed in float64 block by block (Chan et al.'s parallel update); the blocks are kept
(they are the tensor's own stored values, so memory stays within one tensor) up to
``KEEP_LIMIT`` bytes, so the histogram needs no second read either.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

KEEP_LIMIT = 1 << 30  # the most bytes of wide values kept for the histogram


@dataclass(frozen=True)
class Moments:
    """Count, mean, M2 and sum of squares of the finite values; extrema; special counts."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    sumsq: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    zeros: int = 0
    nan: int = 0
    inf: int = 0

    def merge(self, other: Moments) -> Moments:
        total = self.n + other.n
        if not total:
            return Moments(
                zeros=self.zeros + other.zeros, nan=self.nan + other.nan, inf=self.inf + other.inf
            )
        delta = other.mean - self.mean
        return Moments(
            n=total,
            mean=self.mean + delta * other.n / total,
            m2=self.m2 + other.m2 + delta * delta * self.n * other.n / total,
            sumsq=self.sumsq + other.sumsq,
            min=min(self.min, other.min),
            max=max(self.max, other.max),
            zeros=self.zeros + other.zeros,
            nan=self.nan + other.nan,
            inf=self.inf + other.inf,
        )


def _bins_of(values: torch.Tensor, low: float, high: float, bins: int) -> torch.Tensor:
    """Each value's bin over ``[low, high]`` (values outside are the caller's to drop)."""
    return ((values - low) / (high - low) * bins).long().clamp_(0, bins - 1)


def span(low: float, high: float) -> tuple[float, float]:
    """A histogram range from extrema: finite, and not empty."""
    if not (math.isfinite(low) and math.isfinite(high)):
        low, high = 0.0, 0.0
    return (low, high if high > low else low + 1.0)


class Tally(Protocol):
    """Accumulates blocks of one dtype (each value counted ``weight`` times)."""

    def add(self, block: torch.Tensor, weight: int = 1) -> None: ...

    def moments(self) -> Moments: ...

    def histogram(self, low: float, high: float, bins: int) -> tuple[torch.Tensor, int, int]:
        """Counts of the finite values in ``[low, high]``, and the NaN and Inf counts."""
        ...


class PatternTally:
    """Counts per bit pattern, for values of at most two bytes."""

    def __init__(self, dtype: torch.dtype) -> None:
        size = torch.empty((), dtype=dtype).element_size()
        self.carrier = torch.int16 if size == 2 else torch.uint8
        self.offset = 1 << 15 if size == 2 else 0
        patterns = torch.arange(-self.offset, (1 << (8 * size)) - self.offset)
        self.values = patterns.to(self.carrier).view(dtype).to(torch.float64)
        self.counts = torch.zeros(len(self.values), dtype=torch.int64)

    def add(self, block: torch.Tensor, weight: int = 1) -> None:
        codes = block.reshape(-1).view(self.carrier)
        if self.offset:
            codes = codes.to(torch.int32) + self.offset
        found = torch.bincount(codes, minlength=len(self.counts))
        self.counts += found * weight if weight != 1 else found

    def moments(self) -> Moments:
        v, c = self.values, self.counts
        finite = torch.isfinite(v) & (c > 0)
        special = {
            "zeros": int(c[v == 0].sum()),
            "nan": int(c[torch.isnan(v)].sum()),
            "inf": int(c[torch.isinf(v)].sum()),
        }
        n = int(c[finite].sum())
        if not n:
            return Moments(**special)
        fv, fc = v[finite], c[finite].to(torch.float64)
        mean = float((fv * fc).sum()) / n
        return Moments(
            n=n,
            mean=mean,
            m2=float(((fv - mean) ** 2 * fc).sum()),
            sumsq=float((fv * fv * fc).sum()),
            min=float(fv.min()),
            max=float(fv.max()),
            **special,
        )

    def histogram(self, low: float, high: float, bins: int) -> tuple[torch.Tensor, int, int]:
        v, c = self.values, self.counts
        chosen = torch.isfinite(v) & (c > 0) & (v >= low) & (v <= high)
        counts = torch.zeros(bins, dtype=torch.int64)
        counts.scatter_add_(0, _bins_of(v[chosen], low, high, bins), c[chosen])
        return counts, int(c[torch.isnan(v)].sum()), int(c[torch.isinf(v)].sum())


class BlockTally:
    """float64 moments per block, merged; the blocks kept for the histogram up to
    ``KEEP_LIMIT`` bytes (``kept`` is False past it: the histogram needs another read)."""

    def __init__(self, keep: bool = True) -> None:
        self.total = Moments()
        self.blocks: list[tuple[torch.Tensor, int]] = []
        self.kept_bytes = 0
        self.kept = keep

    def add(self, block: torch.Tensor, weight: int = 1) -> None:
        self.total = self.total.merge(block_moments(block, weight))
        if self.kept:
            self.kept_bytes += block.numel() * block.element_size()
            self.kept = self.kept_bytes <= KEEP_LIMIT
            if self.kept:
                self.blocks.append((block, weight))
            else:
                self.blocks.clear()

    def moments(self) -> Moments:
        return self.total

    def histogram(self, low: float, high: float, bins: int) -> tuple[torch.Tensor, int, int]:
        assert self.kept, "the blocks were not kept: count them again"
        return count_blocks(self.blocks, low, high, bins)


def block_moments(block: torch.Tensor, weight: int = 1) -> Moments:
    """The moments of one block's values, each counted ``weight`` times."""
    values = block.reshape(-1).to(torch.float64)
    finite = torch.isfinite(values)
    zeros = weight * int((values == 0).sum())
    if bool(finite.all()):
        nan = inf = 0
        good = values
    else:
        nan = weight * int(torch.isnan(values).sum())
        inf = weight * int(torch.isinf(values).sum())
        good = values[finite]
    if not good.numel():
        return Moments(zeros=zeros, nan=nan, inf=inf)
    low, high = torch.aminmax(good)
    var, mean = torch.var_mean(good, correction=0)
    return Moments(
        n=weight * good.numel(),
        mean=float(mean),
        m2=weight * float(var) * good.numel(),
        sumsq=weight * float(torch.dot(good, good)),
        min=float(low),
        max=float(high),
        zeros=zeros,
        nan=nan,
        inf=inf,
    )


def count_blocks(
    blocks: Iterable[tuple[torch.Tensor, int]], low: float, high: float, bins: int
) -> tuple[torch.Tensor, int, int]:
    """Histogram counts over ``[low, high]`` of weighted blocks, with NaN and Inf counts."""
    counts = torch.zeros(bins, dtype=torch.int64)
    nan = inf = 0
    for block, weight in blocks:
        values = block.reshape(-1).to(torch.float64)
        nan += weight * int(torch.isnan(values).sum())
        inf += weight * int(torch.isinf(values).sum())
        values = values[torch.isfinite(values) & (values >= low) & (values <= high)]
        counts += weight * torch.bincount(_bins_of(values, low, high, bins), minlength=bins)
    return counts, nan, inf


def sum_of_squares(block: torch.Tensor) -> float:
    """The sum of the squares of a block's finite values, in float64."""
    values = block.reshape(-1).to(torch.float64)
    total = float(torch.dot(values, values))
    if math.isfinite(total):
        return total
    values = values[torch.isfinite(values)]
    return float(torch.dot(values, values))


def tally_for(dtype: torch.dtype, *, keep: bool = True) -> Tally:
    """The fastest exact tally for values of ``dtype``; ``keep=False`` when no histogram
    will be asked of it."""
    if torch.empty((), dtype=dtype).element_size() > 2:
        return BlockTally(keep)
    return PatternTally(dtype)
