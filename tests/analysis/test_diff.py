"""diff: same weights in different shardings agree; one perturbed element is found exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

import inspector
from inspector.analysis import diff as compare
from inspector.analysis import stats as stats_module


def resave(source: Path, target: Path, edit=None) -> Path:
    """Load a checkpoint with torch's own reader and save it again from ONE process."""
    state = _load_state_dict_from_keys(checkpoint_id=str(source))
    if edit is not None:
        edit(state)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(target), no_dist=True)
    return target


@pytest.fixture(scope="module")
def one_rank(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resave(demo_dir / "flat", tmp_path_factory.mktemp("one_rank"))


def test_one_rank_vs_two_ranks_all_same(demo_dir: Path, one_rank: Path) -> None:
    two = inspector.open(demo_dir / "flat")
    one = inspector.open(one_rank)
    assert len(one.entry("layers.0.attention.wq.weight").chunks) == 1
    assert len(two.entry("layers.0.attention.wq.weight").chunks) == 2
    table = inspector.diff(two, one, key_map=None, progress=False)
    assert len(table) == len(two.keys()) == len(one.keys())
    assert set(table.status) == {"same"} and table.equal.all()
    tensors = table[table.kind == "tensor"]
    assert (tensors.hash_a == tensors.hash_b).all() and (tensors.max_abs_diff == 0).all()


def test_one_perturbed_element(demo_dir: Path, tmp_path: Path) -> None:
    def bump(state: dict) -> None:
        state["layers.1.feed_forward.w2.weight"][5, 7] += 0.25

    changed = resave(demo_dir / "flat", tmp_path / "changed", bump)
    table = inspector.diff(demo_dir / "flat", changed, key_map=None, progress=False)
    bad = table[~table.equal]
    assert bad.key.tolist() == ["layers.1.feed_forward.w2.weight"]
    row = bad.iloc[0]
    assert row.status == "values" and row.n_diff == 1
    original = inspector.open(demo_dir / "flat").read("layers.1.feed_forward.w2.weight")[5, 7]
    assert row.max_abs_diff == pytest.approx(abs(float((original + 0.25) - original)), rel=1e-6)
    assert row.hash_a != row.hash_b


def test_dtype_change_within_rounding(demo_dir: Path, tmp_path: Path) -> None:
    def to_bf16(state: dict) -> None:
        flat, _ = flatten_state_dict(state)
        for key, value in flat.items():
            if isinstance(value, torch.Tensor) and "." in key and value.is_floating_point():
                value.data = value.data.to(torch.bfloat16)

    low = resave(demo_dir / "seed", tmp_path / "bf16", to_bf16)
    exact = inspector.diff(demo_dir / "seed", low, key_map=None, progress=False)
    exact_in_bf16 = exact[exact.status == "dtype"].key.tolist()
    assert exact_in_bf16 and all("norm" in key for key in exact_in_bf16)  # all-ones weights
    assert set(exact.status) == {"values", "dtype"}
    assert (exact.dtype_b == "bfloat16").all()
    assert exact.max_rel_diff.max() <= 2**-8
    loose = inspector.diff(demo_dir / "seed", low, key_map=None, rtol=2**-8, progress=False)
    assert set(loose.status) == {"dtype"} and loose.equal.all()


def test_only_on_one_side_and_shape(demo_dir: Path) -> None:
    table = inspector.diff(
        demo_dir / "seed", demo_dir / "flat", key_map=None, values=False, progress=False
    )
    counts = compare.summarize(table)
    assert counts["only_b"] == 347 - 21 and counts["only_a"] == 0 and counts["same"] == 21


def test_explicit_key_map_and_filters(demo_dir: Path) -> None:
    mapping = {f"model.{k}": k for k in inspector.open(demo_dir / "flat").keys()}
    table = inspector.diff(
        demo_dir / "prefixed",
        demo_dir / "flat",
        key_map=mapping,
        include=["model.layers.0.*"],
        progress=False,
    )
    assert len(table) == 9 and set(table.status) == {"same"}
    table = inspector.diff(
        demo_dir / "prefixed",
        demo_dir / "flat",
        key_map=lambda k: k.removeprefix("model."),
        exclude=["optimizer.*", "dataloader.*"],
        progress=False,
    )
    assert set(table.status) == {"same"} and len(table) == 347 - 315 - 2


def test_value_differences_nan_and_inf() -> None:
    a = torch.tensor([1.0, float("nan"), float("inf"), 2.0, 0.0])
    b = torch.tensor([1.0, float("nan"), float("inf"), 2.5, 0.0])
    found = compare.value_differences(a, b)
    assert (found.max_abs, found.max_rel, found.n_diff) == (0.5, pytest.approx(0.2), 1)
    assert found.rel_l2 == pytest.approx(0.5 / 7.25**0.5)  # over the finite positions only
    c = torch.tensor([1.0, 1.0, float("inf"), 2.0, 0.0])
    found = compare.value_differences(a, c)
    assert found.max_abs == float("inf") and found.n_diff == 1


def test_legacy_prefixed_vs_flat_with_auto_key_map(demo_dir: Path) -> None:
    table = inspector.diff(demo_dir / "prefixed", demo_dir / "flat", progress=False)
    assert len(table) == 347 and set(table.status) == {"same"}
    renamed = table[table.key != table.key_b]
    assert len(renamed) == 21 and (renamed.key == "model." + renamed.key_b).all()
    plain = inspector.diff(demo_dir / "prefixed", demo_dir / "flat", key_map=None, progress=False)
    assert compare.summarize(plain) | {"same": 0} == {
        "same": 0,
        "dtype": 0,
        "values": 0,
        "shape": 0,
        "only_a": 21,
        "only_b": 21,
    }


def test_fp32_vs_its_bf16_export(demo_dir: Path, tmp_path: Path) -> None:
    inspector.export(demo_dir / "flat", tmp_path / "bf16", dtype=torch.bfloat16, progress=False)
    table = inspector.diff(
        demo_dir / "flat", tmp_path / "bf16", include=["*weight"], progress=False
    )
    model = table[table.status != "only_a"]
    assert len(model) == 21 and (model.dtype_b == "bfloat16").all()
    assert set(model.status) <= {"values", "dtype"} and model.max_rel_diff.max() <= 2**-8
    loose = inspector.diff(
        demo_dir / "flat", tmp_path / "bf16", include=["*weight"], rtol=2**-8, progress=False
    )
    assert set(loose[loose.status != "only_a"].status) == {"dtype"}


def test_cli_diff_across_layouts(demo_dir: Path) -> None:
    from tests.ui.test_cli import cli

    done = cli("diff", str(demo_dir / "prefixed"), str(demo_dir / "flat"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("347 keys: 347 same")


def test_largest_difference_per_layer(demo_dir: Path, tmp_path: Path) -> None:
    def bump(state: dict) -> None:
        state["layers.1.feed_forward.w2.weight"][5, 7] += 0.25

    changed = resave(demo_dir / "flat", tmp_path / "changed", bump)
    table = inspector.diff(
        demo_dir / "prefixed", changed, include=["model.layers.*"], progress=False
    )
    per_layer = compare.layer_differences(table)
    assert len(per_layer) == 18  # 9 weights in each of the 2 layers, nothing outside them
    moved = per_layer[per_layer.max_abs_diff > 0]
    assert moved.key.tolist() == ["model.layers.1.feed_forward.w2.weight"]
    row = moved.iloc[0]
    assert row["layer"] == 1 and row["name"] == "model.layers.*.feed_forward.w2.weight"
    assert row["max_abs_diff"] == pytest.approx(0.25, rel=1e-2)
    figure = compare.plot_layer_differences(table)
    lines = {line.get_label(): list(line.get_ydata()) for line in figure.axes[0].get_lines()}
    assert len(lines) == 9 and lines["model.layers.*.feed_forward.w2.weight"][0] == 0.0
    assert lines["model.layers.*.feed_forward.w2.weight"][1] == pytest.approx(0.25, rel=1e-2)
    assert figure.axes[0].get_title() == "largest difference per layer"


def test_relative_l2_and_cosine_of_each_pair(tmp_path: Path) -> None:
    torch.manual_seed(3)
    a = {"w": torch.randn(64, 32), "flipped": torch.randn(40), "same": torch.randn(8)}
    b = {
        "w": a["w"] + 0.01 * torch.randn(64, 32),
        "flipped": -a["flipped"],
        "same": a["same"].clone(),
    }
    a["w"][0, 0], b["w"][0, 0] = float("nan"), float("nan")  # left out of both measures
    for name, state in (("a", a), ("b", b)):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / name), no_dist=True)
    table = inspector.diff(tmp_path / "a", tmp_path / "b", key_map=None, progress=False)
    rows = table.set_index("key")
    x, y = a["w"].double().flatten()[1:], b["w"].double().flatten()[1:]
    assert rows.loc["w", "rel_l2_diff"] == pytest.approx(float((x - y).norm() / y.norm()))
    cosine = float(torch.dot(x, y) / (x.norm() * y.norm()))
    assert rows.loc["w", "cosine"] == pytest.approx(cosine, rel=1e-12) and cosine < 1
    assert rows.loc["flipped", "cosine"] == pytest.approx(-1.0)
    assert rows.loc["flipped", "rel_l2_diff"] == pytest.approx(2.0)
    assert (rows.loc["same", "rel_l2_diff"], rows.loc["same", "cosine"]) == (0.0, 1.0)


def test_per_layer_plot_keeps_lines_clear_of_the_legend_and_goes_log_over_decades() -> None:
    import pandas

    rows = [
        {"layer": i, "name": f"layers.*.{n}.weight", "key": f"layers.{i}.{n}.weight", "v": v}
        for i in range(4)
        for n, v in (("small", 1e-6 * (i + 1)), ("big", 10.0 * (i + 1)))
    ]
    figure = stats_module.plot_by_layer(pandas.DataFrame(rows), "v", "value")
    axes = figure.axes[0]
    assert axes.get_yscale() == "log"
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    legend = axes.get_legend().get_window_extent(renderer)
    assert legend.x0 >= axes.get_window_extent(renderer).x1  # beside the axes, not over them
    rows = [{**r, "v": 0.0 if r["layer"] == 0 else r["v"]} for r in rows]
    assert stats_module.plot_by_layer(pandas.DataFrame(rows), "v", "v").axes[0].get_yscale() == (
        "symlog"
    )
    narrow = [{**r, "v": 1.0 + r["layer"]} for r in rows]
    assert stats_module.plot_by_layer(pandas.DataFrame(narrow), "v", "v").axes[0].get_yscale() == (
        "linear"
    )
