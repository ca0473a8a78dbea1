"""The one-pass tallies give torch's numbers and the element-by-element histogram."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import inspector
from inspector.analysis import stats, tally

NARROW = [
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.int8,
    torch.uint8,
    torch.int16,
]


def sample(dtype: torch.dtype, n: int = 5000) -> torch.Tensor:
    """Values of ``dtype`` with zeros, both signs, extremes and (for floats) NaN and Inf."""
    generator = torch.Generator().manual_seed(n)
    if dtype.is_floating_point:
        values = torch.randn(n, generator=generator, dtype=torch.float64) * 40
        values[:6] = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, 1e9])
        return values.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max + 1, (n,), generator=generator, dtype=dtype)


def elementwise(values: torch.Tensor, low: float, high: float, bins: int) -> list[int]:
    v = values.to(torch.float64)
    v = v[torch.isfinite(v) & (v >= low) & (v <= high)]
    index = ((v - low) / (high - low) * bins).long().clamp(0, bins - 1)
    return torch.bincount(index, minlength=bins).tolist()


@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_pattern_tally_equals_block_tally_and_torch(dtype: torch.dtype) -> None:
    values = sample(dtype)
    by_pattern, by_block = tally.tally_for(dtype), tally.BlockTally()
    assert isinstance(by_pattern, tally.PatternTally)
    for part in values.split(1234):
        by_pattern.add(part, 3)
        by_block.add(part, 3)
    p, b = by_pattern.moments(), by_block.moments()
    assert (p.n, p.zeros, p.nan, p.inf, p.min, p.max) == (b.n, b.zeros, b.nan, b.inf, b.min, b.max)
    for name in ("mean", "m2", "sumsq"):
        assert getattr(p, name) == pytest.approx(getattr(b, name), rel=1e-12), name
    f = values.to(torch.float64)
    finite = f[torch.isfinite(f)]
    assert p.n == 3 * finite.numel() and p.nan == 3 * int(f.isnan().sum())
    assert p.mean == pytest.approx(float(finite.mean()), rel=1e-12)
    low, high = tally.span(p.min, p.max)
    counts, nan, inf = by_pattern.histogram(low, high, 37)
    assert counts.tolist() == [3 * c for c in elementwise(values, low, high, 37)]
    assert by_block.histogram(low, high, 37)[0].tolist() == counts.tolist()
    assert (nan, inf) == (p.nan, p.inf)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(1)
    state = {
        "fp32": torch.randn(300, 70) * 5 - 2,
        "bf16": (torch.randn(300, 70) * 0.02).to(torch.bfloat16),
        "i64": torch.arange(-1000, 1000, dtype=torch.int64),
    }
    out = tmp_path_factory.mktemp("wide")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(out), no_dist=True)
    return out


@pytest.mark.parametrize("key", ["fp32", "bf16", "i64"])
def test_summarize_reads_once_and_reports_numbers_first(wide_dir: Path, key: str) -> None:
    ck = inspector.open(wide_dir)
    events: list[str] = []
    seen: list[tuple[int, int]] = []
    numbers, counts = stats.summarize(
        ck,
        key,
        16,
        on_stats=lambda found: events.append(f"stats {found.numel}"),
        on_progress=lambda done, total: seen.append((done, total)),
    )
    numel = ck.entry(key).numel
    assert events == [f"stats {numel}"] and seen[-1] == (numel, numel)
    assert numbers == ck.stats(key)
    values = ck.read(key)
    assert counts.counts.tolist() == elementwise(values, numbers.min, numbers.max, 16)
    assert counts.counts.tolist() == ck.histogram(key, 16).counts.tolist()


def test_wide_values_past_the_keep_limit_are_read_again(
    wide_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = inspector.open(wide_dir)
    before = ck.io.bytes
    expected = stats.summarize(ck, "fp32", 16)[1].counts.tolist()
    one_read = ck.io.bytes - before
    monkeypatch.setattr(tally, "KEEP_LIMIT", 1000)
    monkeypatch.setattr(stats, "BLOCK", 500)
    before = ck.io.bytes
    counts = stats.summarize(ck, "fp32", 16)[1]
    assert counts.counts.tolist() == expected
    assert ck.io.bytes - before == 2 * one_read


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_sum_of_squares_skips_non_finite_values(dtype: torch.dtype) -> None:
    values = sample(dtype).to(torch.float64)
    finite = values[torch.isfinite(values)]
    expected = float((finite * finite).sum())
    assert tally.sum_of_squares(values.to(dtype)) == pytest.approx(expected, rel=1e-12)
    assert tally.sum_of_squares(finite.to(dtype)) == pytest.approx(expected, rel=1e-12)
