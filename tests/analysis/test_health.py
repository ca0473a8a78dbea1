"""Run health on runs a real AdamW training loop saved (torchtitan-style DCP ``step-N/``): the
numbers against torch's own computations on what DCP's reader loads, the injected faults
found at their layer and step, and nothing flagged on the healthy run."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import inspector
from inspector.analysis.health import KINDS, HealthReport, Thresholds, health
from inspector.errors import UsageError
from tests.analysis.conftest import health_by_torch
from tests.conftest import FAULTS

KEY = "layers.1.attention.wq.weight"
LAYER_PARAMS = 9  # attention wq/wk/wv/wo, feed_forward w1/w2/w3, two norms


@pytest.fixture(scope="module")
def faulty(faulty_run: Path) -> HealthReport:
    return health(faulty_run)


@pytest.fixture(scope="module", params=["C", "torch"])
def kernels(request: pytest.FixtureRequest, faulty: HealthReport, faulty_run: Path) -> HealthReport:
    """The report with the numbers taken by _health.c, and by torch (no C compiler)."""
    return faulty if request.param == "C" else health_by_torch(faulty_run)


@pytest.fixture(scope="module")
def loaded(faulty_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each step as DCP's own reader loads it (dcp_to_torch_save, then torch.load)."""
    out = tmp_path_factory.mktemp("loaded")
    states = {}
    for step in ("step-10", "step-20", "step-30"):
        dcp_to_torch_save(faulty_run / step, out / f"{step}.pt")
        states[step] = torch.load(out / f"{step}.pt", weights_only=True)
    return states


def _row(report: HealthReport, key: str, step: str):
    return next(r for r in report.rows if r.key == key and r.step_name == step)


def test_nothing_flagged_on_the_healthy_run(healthy_run: Path) -> None:
    report = health(healthy_run)
    assert report.findings == ()
    assert report.ok and not report.has_errors
    assert [s.name for s in report.steps] == ["step-10", "step-20", "step-30", "step-40"]
    assert len(report.rows) == 4 * (2 + 3 * LAYER_PARAMS + 1)  # embeddings, layers, norm, output
    assert "nothing looks wrong" in report.text()


def test_the_spike_is_found_at_its_layer_and_step(faulty: HealthReport) -> None:
    outliers = {
        (f.layer, f.step_name, f.key) for f in faulty.findings if f.kind == "update-outlier"
    }
    assert {(layer, step) for layer, step, _ in outliers} == {(FAULTS.spike_layer, "step-30")}
    assert len(outliers) == LAYER_PARAMS  # every parameter of the spiked layer
    assert all(f.severity == "warning" for f in faulty.findings)


def test_the_frozen_layer_is_found_where_it_stopped(faulty: HealthReport) -> None:
    frozen = {(f.layer, f.step_name) for f in faulty.findings if f.kind == "frozen"}
    assert frozen == {(FAULTS.frozen_layer, "step-30")}  # frozen after 15: 20 -> 30 unchanged
    assert sum(f.kind == "frozen" for f in faulty.findings) == LAYER_PARAMS
    counters = [f for f in faulty.findings if f.kind == "step-mismatch"]
    assert {(f.layer, f.step_name, f.value) for f in counters} == {
        (FAULTS.frozen_layer, "step-20", float(FAULTS.freeze_after))
    }
    assert len(counters) == LAYER_PARAMS


def test_nothing_else_is_flagged(faulty: HealthReport) -> None:
    spiked = {(FAULTS.spike_layer, "step-30")}
    for finding in faulty.findings:
        assert (
            finding.layer == FAULTS.frozen_layer or (finding.layer, finding.step_name) in spiked
        ), finding.message


def test_weight_numbers_match_torch(faulty: HealthReport, loaded: dict[str, dict]) -> None:
    w10, w20, w30 = (loaded[s][KEY].double() for s in ("step-10", "step-20", "step-30"))
    row = _row(faulty, KEY, "step-30")
    assert row.l2 == pytest.approx(float(torch.linalg.vector_norm(w30)), rel=1e-6)
    assert row.rms == pytest.approx(float(w30.pow(2).mean().sqrt()), rel=1e-6)
    assert row.absmax == float(w30.abs().max())
    assert (row.nan, row.inf, row.zero_fraction) == (0, 0, float((w30 == 0).double().mean()))
    update, before = w30 - w20, w20 - w10
    assert row.update_ratio == pytest.approx(float(update.norm() / w20.norm()), rel=1e-5)
    cosine = torch.nn.functional.cosine_similarity(update.flatten(), before.flatten(), dim=0)
    assert row.update_cosine == pytest.approx(float(cosine), rel=1e-5)
    rows = w30.abs().amax(1)
    assert row.channel_ratio == pytest.approx(
        max(
            float(rows.max() / rows.median()),
            float(w30.abs().amax(0).max() / w30.abs().amax(0).median()),
        ),
        rel=1e-6,
    )
    assert _row(faulty, KEY, "step-10").update_ratio is None


def test_optimizer_numbers_match_torch(kernels: HealthReport, loaded: dict[str, dict]) -> None:
    optim = loaded["step-30"]["optimizer"]
    m, v = (optim[f"state.{KEY}.{name}"].double() for name in ("exp_avg", "exp_avg_sq"))
    step = float(optim[f"state.{KEY}.step"])
    lr, (b1, b2), eps = (optim[f"param_groups.{KEY}.{h}"] for h in ("lr", "betas", "eps"))
    row = _row(kernels, KEY, "step-30")
    assert row.optimizer_step == step == 30.0
    assert row.exp_avg_rms == pytest.approx(float(m.pow(2).mean().sqrt()), rel=1e-6)
    assert row.exp_avg_sq_rms == pytest.approx(float(v.pow(2).mean().sqrt()), rel=1e-6)
    effective = lr * (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)
    assert row.effective_step_rms == pytest.approx(float(effective.pow(2).mean().sqrt()), rel=1e-5)
    assert row.second_moment_zero_fraction == 0.0


def test_layers_pool_their_parameters(faulty: HealthReport, loaded: dict[str, dict]) -> None:
    layer = [r for r in faulty.layers() if r["group"] == "layer 1" and r["step_name"] == "step-30"]
    keys = [k for k in loaded["step-30"] if k.startswith("layers.1.")]
    now = torch.cat([loaded["step-30"][k].double().flatten() for k in keys])
    before = torch.cat([loaded["step-20"][k].double().flatten() for k in keys])
    assert len(keys) == layer[0]["parameters"] == LAYER_PARAMS
    assert layer[0]["l2"] == pytest.approx(float(now.norm()), rel=1e-6)
    assert layer[0]["update_ratio"] == pytest.approx(
        float((now - before).norm() / before.norm()), rel=1e-5
    )
    groups, names, grid = faulty.grid("update_ratio")
    assert groups[:2] == ["tok_embeddings.weight", "layer 0"] and names[2] == "step-30"
    assert grid[groups.index("layer 1")][2] == layer[0]["update_ratio"]
    assert math.isnan(grid[0][0])  # no update into the first step
    assert grid[groups.index("layer 0")][2] == 0.0


def test_thresholds_are_arguments(faulty_run: Path) -> None:
    strict = health(
        faulty_run, keys=["layers.*.attention.wq.weight"], thresholds=Thresholds(norm_jump=1.01)
    )
    jumps = {(f.key, f.step_name) for f in strict.findings if f.kind == "norm-jump"}
    assert ("layers.1.attention.wq.weight", "step-30") in jumps
    assert {r.key for r in strict.rows} == {f"layers.{i}.attention.wq.weight" for i in range(3)}
    assert set(KINDS) >= {f.kind for f in strict.findings}


def test_steps_and_an_opened_checkpoint(faulty_run: Path) -> None:
    ck = inspector.open(faulty_run)
    report = health(ck, steps=["step-20", 30], keys=[KEY])
    assert [s.name for s in report.steps] == ["step-20", "step-30"]
    assert [r.step_name for r in report.rows] == ["step-20", "step-30"]
    with pytest.raises(UsageError, match="step-99"):
        health(ck, steps=["step-99"])


def test_json_shape(faulty: HealthReport) -> None:
    shape = faulty.as_dict()
    assert list(shape) == [
        "run",
        "steps",
        "thresholds",
        "ok",
        "errors",
        "findings",
        "layers",
        "parameters",
    ]
    assert shape["steps"][0] == {"name": "step-10", "number": 10}
    assert set(shape["findings"][0]) == {
        "kind",
        "severity",
        "step",
        "step_name",
        "key",
        "layer",
        "value",
        "message",
    }
    assert shape["ok"] is False and shape["errors"] is False


HF_RUN = Path(__file__).resolve().parents[1] / "fixtures" / "hf_trainer" / "run"


def test_hf_trainer_run_weights_match_safetensors() -> None:
    """A transformers Trainer run (tests/fixtures/hf_trainer/generate.py): the checkpoint-N/
    steps, keys without the ``model.`` prefix, layers found, numbers as torch computes them
    from what safetensors loads; a healthy run, so nothing flagged but the numbered optimizer
    state nothing pairs (tests/analysis/test_health_optimizer.py)."""
    from safetensors.torch import load_file

    report = health(HF_RUN)
    assert [s.name for s in report.steps] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert {f.kind for f in report.findings} == {"cannot-pair"}
    key = "layers.1.self_attn.q_proj.weight"
    w2, w4, w6 = (
        load_file(HF_RUN / f"checkpoint-{n}" / "model.safetensors")[f"model.{key}"].double()
        for n in (2, 4, 6)
    )
    row = _row(report, key, "checkpoint-6")
    assert (row.layer, row.group) == (1, "layer 1")
    assert row.l2 == pytest.approx(float(w6.norm()), rel=1e-6)
    assert row.absmax == float(w6.abs().max())
    assert row.update_ratio == pytest.approx(float((w6 - w4).norm() / w4.norm()), rel=1e-5)
    cosine = torch.nn.functional.cosine_similarity((w6 - w4).flatten(), (w4 - w2).flatten(), dim=0)
    assert row.update_cosine == pytest.approx(float(cosine), rel=1e-5)
    assert row.exp_avg_rms is None  # optimizer.pt numbers its parameters: not paired


def test_a_damaged_step_is_an_error_the_rest_is_reported(healthy_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(healthy_run, run)
    data = run / "step-20" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    report = health(run, keys=["layers.*.attention.wq.weight", "output.weight"])
    bad = [f for f in report.findings if f.kind == "unreadable"]
    assert bad and {f.step_name for f in bad} == {"step-20"} and report.has_errors
    assert all("__0_0.distcp" in f.message and "truncated" in f.message for f in bad)
    assert {f.kind for f in report.findings} == {"unreadable"}
    lost = {f.key for f in bad if "its weights" in f.message}
    kept = {r.key for r in report.rows if r.step_name == "step-20"}
    assert lost and kept and lost | kept == {r.key for r in report.rows}  # the rest is reported
    after = [r for r in report.rows if r.step_name == "step-30" and r.key in lost]
    assert after and all(r.update_ratio is None for r in after)  # no step-20 to compare with
