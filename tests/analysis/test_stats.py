"""Statistics and histograms equal torch's reductions on the fully loaded tensor."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import inspector
from inspector.analysis import stats


@pytest.fixture(scope="module")
def numbers_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    special = torch.randn(300, 7)
    special[3, 2], special[10, 0], special[11, 1] = math.nan, math.inf, -math.inf
    state = {
        "fp32": torch.randn(513, 129) * 3 + 1,
        "bf16": (torch.randn(257, 65) * 0.02).to(torch.bfloat16),
        "f8": (torch.randn(64, 96) * 2).to(torch.float8_e4m3fn),
        "special": special,
        "ints": torch.arange(-50, 950, dtype=torch.int64).reshape(10, 100),
        "flags": torch.rand(40) > 0.5,
        "empty": torch.empty(0, 5),
        "layers.0.attention.wq.weight": torch.full((4, 4), 2.0),
        "layers.1.attention.wq.weight": torch.full((4, 4), 3.0),
        "layers.1.ffn.w1.weight": torch.full((2, 2), 1.0),
    }
    out = tmp_path_factory.mktemp("numbers")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(out), no_dist=True)
    return out


def reference(t: torch.Tensor) -> dict:
    v = t.to(torch.float64).reshape(-1)
    finite = v[torch.isfinite(v)]
    return {
        "min": float(finite.min()),
        "max": float(finite.max()),
        "mean": float(finite.mean()),
        "std": float(finite.std()),
        "absmax": float(finite.abs().max()),
        "l2": float(torch.linalg.vector_norm(finite)),
        "zeros": int((v == 0).sum()),
        "nan": int(v.isnan().sum()),
        "inf": int(v.isinf().sum()),
    }


@pytest.mark.parametrize("key", ["fp32", "bf16", "f8", "special", "ints", "flags"])
@pytest.mark.parametrize("block", [stats.BLOCK, 1000])
def test_stats_match_torch(numbers_dir: Path, key: str, block: int, monkeypatch) -> None:
    monkeypatch.setattr(stats, "BLOCK", block)
    ck = inspector.open(numbers_dir)
    got = ck.stats(key).as_dict()
    want = reference(ck.read(key))
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
    assert (got["dtype"], got["shape"]) == (ck.entry(key).dtype, ck.entry(key).shape)


def test_stats_over_sharded_chunks(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "flat")
    key = "tok_embeddings.weight"
    assert len(ck.entry(key).chunks) == 2
    got, want = ck.stats(key).as_dict(), reference(ck.read(key))
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-9), name


def test_unsupported_dtypes_are_refused_and_left_out(tmp_path: Path) -> None:
    state = {
        "packed": torch.zeros(4, 2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
        "complex": torch.ones(3, dtype=torch.complex64),
        "real": torch.ones(3),
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    ck = inspector.open(tmp_path)
    for key in ("packed", "complex"):
        with pytest.raises(inspector.UnsupportedError, match=rf"'{key}'.*no statistics"):
            ck.stats(key)
    assert ck.stats_table(progress=False).key.tolist() == ["real"]


def test_empty_tensor(numbers_dir: Path) -> None:
    s = inspector.open(numbers_dir).stats("empty")
    assert s.numel == 0 and math.isnan(s.mean) and s.l2 == 0.0 and s.nan == 0


def test_special_values_counted(numbers_dir: Path) -> None:
    s = inspector.open(numbers_dir).stats("special")
    assert (s.nan, s.inf) == (1, 2)
    assert math.isfinite(s.mean) and math.isfinite(s.max)


def test_histogram_counts(numbers_dir: Path) -> None:
    ck = inspector.open(numbers_dir)
    hist = ck.histogram("special", bins=10)
    values = ck.read("special").double().reshape(-1)
    finite = values[torch.isfinite(values)]
    assert int(hist.counts.sum()) == finite.numel()
    assert (hist.nan, hist.inf) == (1, 2)
    assert float(hist.edges[0]) == float(finite.min()) and float(hist.edges[-1]) == float(
        finite.max()
    )
    expected = torch.histc(finite, bins=10, min=float(finite.min()), max=float(finite.max()))
    assert hist.counts.tolist() == expected.long().tolist()


def test_stats_table(numbers_dir: Path) -> None:
    table = inspector.open(numbers_dir).stats_table(include=["fp32", "layers.*"], progress=False)
    assert table.key.tolist() == [
        "fp32",
        "layers.0.attention.wq.weight",
        "layers.1.attention.wq.weight",
        "layers.1.ffn.w1.weight",
    ]
    assert table.set_index("key").loc["layers.1.attention.wq.weight", "l2"] == pytest.approx(12.0)


def test_layer_norms_and_plots(numbers_dir: Path) -> None:
    ck = inspector.open(numbers_dir)
    norms = stats.layer_norms(ck, progress=False)
    rows = {(r.layer, r.name): r.l2 for r in norms.itertuples()}
    assert rows == {
        (0, "layers.*.attention.wq.weight"): pytest.approx(8.0),
        (1, "layers.*.attention.wq.weight"): pytest.approx(12.0),
        (1, "layers.*.ffn.w1.weight"): pytest.approx(2.0),
    }
    fig = stats.plot_layer_norms(ck)
    line = fig.axes[0].get_lines()[0]
    assert list(line.get_xdata()) == [0, 1] and list(line.get_ydata()) == pytest.approx([8.0, 12.0])
    fig = ck.histogram("fp32", bins=16).plot()
    assert sum(p.get_height() for p in fig.axes[0].patches) == 513 * 129


def test_layer_index() -> None:
    assert stats.layer_index("model.layers.12.attention.wq.weight") == 12
    assert stats.layer_index("optimizer.state.layers.3.w.exp_avg") == 3
    assert stats.layer_index("tok_embeddings.weight") is None


def test_progress_counts_every_element_block_by_block(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "fp8")
    key = "layers.0.attention.wq.weight"  # two FSDP chunks, one per rank
    seen: list[tuple[int, int]] = []
    found = stats.stats(ck, key, on_progress=lambda done, total: seen.append((done, total)))
    assert seen == [(0, 4096), (2048, 4096), (4096, 4096)]
    assert found == ck.stats(key)
    seen.clear()
    counts = stats.histogram(ck, key, 8, on_progress=lambda d, t: seen.append((d, t)))
    assert seen == [(0, 4096), (2048, 4096), (4096, 4096)]  # one read gives both
    assert int(counts.counts.sum()) == 4096


def test_cancel_stops_between_blocks_and_is_not_damage(demo_dir: Path) -> None:
    from inspector.progress import Cancelled

    ck = inspector.open(demo_dir / "fp8")
    key = "layers.0.attention.wq.weight"
    cancel = threading.Event()
    cancel.set()
    before = ck.io.bytes
    with pytest.raises(Cancelled):
        stats.stats(ck, key, cancel=cancel)
    assert ck.io.bytes == before  # stopped before the first read
    cancel.clear()

    def stop_after_first(done: int, total: int) -> None:
        if done:
            cancel.set()

    with pytest.raises(Cancelled):
        stats.histogram(ck, key, 8, on_progress=stop_after_first, cancel=cancel)
    assert ck.facts(key).error is None and ck.stats(key).numel == 4096


def test_same_parameter_in_every_layer(numbers_dir: Path, demo_dir: Path) -> None:
    ck = inspector.open(numbers_dir)
    assert stats.layer_name("layers.12.attention.wq.weight") == "layers.*.attention.wq.weight"
    assert stats.layer_name("fp32") is None and stats.same_parameter(ck, "fp32") == []
    peers = stats.same_parameter(ck, "layers.1.attention.wq.weight")
    assert peers == ["layers.0.attention.wq.weight", "layers.1.attention.wq.weight"]
    seen: list[int] = []
    norms = stats.layer_norms(
        ck, keys=peers, progress=False, on_progress=lambda d, t: seen.append(d)
    )
    assert list(norms["l2"]) == pytest.approx([8.0, 12.0]) and seen[-1] == 32
    demo = inspector.open(demo_dir / "flat")
    assert stats.same_parameter(demo, "layers.0.feed_forward.w1.weight") == [
        "layers.0.feed_forward.w1.weight",
        "layers.1.feed_forward.w1.weight",
    ]
