"""Run health's Adam numbers on the optimizer layouts of real trainers (HF Trainer, Lightning,
Megatron-Core, DeepSpeed ZeRO 1-3): the moments' RMS, the effective step and the step
counters against torch's computations on the state the producer's own files load to, and
numbered state paired only where the checkpoint says which parameter it is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import inspector
from inspector.analysis.health import HealthReport, ParamHealth, health

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
HF = FIXTURES / "hf_trainer"
LIGHTNING = FIXTURES / "lightning_run"
MEGATRON = FIXTURES / "megatron"
DEEPSPEED = FIXTURES / "deepspeed"
# Net's parameters in its named_parameters() order (tests/fixtures/lightning_run/generate.py)
LIGHTNING_NAMES = [f"net.{i}.{p}" for i in (0, 2, 4, 6) for p in ("weight", "bias")]
LIGHTNING_UNIQUE = {"net.0.weight", "net.6.weight", "net.6.bias"}  # the shapes no other has


def _rms(value: torch.Tensor) -> float:
    return float(value.double().pow(2).mean().sqrt())


def _effective(m: torch.Tensor, v: torch.Tensor, step: float, group: dict) -> float:
    (b1, b2), lr, eps = group["betas"], group["lr"], group["eps"]
    m, v = m.double(), v.double()
    return _rms(lr * (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps))


def _assert_adam(row: ParamHealth, state: dict, group: dict, step: float) -> None:
    m, v = state["exp_avg"], state["exp_avg_sq"]
    assert row.optimizer_step == step
    assert row.exp_avg_rms == pytest.approx(_rms(m), rel=1e-6)
    assert row.exp_avg_sq_rms == pytest.approx(_rms(v), rel=1e-6)
    assert row.effective_step_rms == pytest.approx(_effective(m, v, step, group), rel=1e-5)
    assert row.second_moment_zero_fraction == float((v == 0).double().mean())


def _rows(report: HealthReport, step: str) -> dict[str, ParamHealth]:
    return {r.key: r for r in report.rows if r.step_name == step}


def test_hf_trainer_state_paired_by_the_names_torch_recorded() -> None:
    """named_run: the Trainer handed AdamW(model.named_parameters()); optimizer.pt's groups
    keep param_names, so every parameter's numbered state is paired."""
    report = health(HF / "named_run")
    assert [s.name for s in report.steps] == ["checkpoint-2", "checkpoint-4"]
    assert report.findings == ()
    for n in (2, 4):
        folder = HF / "named_run" / f"checkpoint-{n}"
        saved = torch.load(folder / "optimizer.pt", weights_only=True)
        trained = json.loads((folder / "trainer_state.json").read_text())["global_step"]
        rows = _rows(report, f"checkpoint-{n}")
        for group in saved["param_groups"]:
            for number, name in zip(group["params"], group["param_names"], strict=True):
                row = rows[name.removeprefix("model.")]
                _assert_adam(row, saved["state"][number], group, float(trained))
        assert len(rows) == len(saved["state"]) == 21


def test_hf_trainer_default_optimizer_is_not_guessed() -> None:
    """run: the Trainer's own optimizer numbers 21 parameters in decay / no-decay groups with
    shapes shared across layers: nothing is paired, and that is said once per step."""
    report = health(HF / "run", keys=["layers.*"])
    assert all(r.exp_avg_rms is None and r.optimizer_step is None for r in report.rows)
    unpaired = [f for f in report.findings if f.kind == "cannot-pair"]
    assert [f.step_name for f in unpaired] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert {f.value for f in unpaired} == {21.0} and unpaired[0].severity == "info"
    assert "21 of 21 parameters" in unpaired[0].message
    assert [f.kind for f in report.findings] == ["cannot-pair"] * 3


@pytest.mark.parametrize("step", [2, 4])
def test_lightning_state_paired_by_unique_shapes(step: int) -> None:
    path = LIGHTNING / f"step-{step}.ckpt"
    saved = torch.load(path, weights_only=True)
    optimizer = saved["optimizer_states"][0]
    (group,) = optimizer["param_groups"]
    report = health(path)
    rows = {r.key: r for r in report.rows}
    assert set(rows) == set(LIGHTNING_NAMES)
    for number, name in enumerate(LIGHTNING_NAMES):
        if name in LIGHTNING_UNIQUE:
            _assert_adam(rows[name], optimizer["state"][number], group, float(saved["global_step"]))
        else:
            assert rows[name].exp_avg_rms is None and rows[name].optimizer_step is None
    (unpaired,) = report.findings
    assert (unpaired.kind, unpaired.value) == ("cannot-pair", 5.0)
    assert "optimizer_states.0" in unpaired.message and "5 of 8" in unpaired.message


def _assert_megatron(
    rows: dict[str, ParamHealth], held: dict[str, torch.Tensor], group: dict, step: float
) -> None:
    """Every parameter's row against Megatron's ``optimizer.state.<name>.<fqn>`` tensors."""
    fqns = [k.removeprefix("optimizer.state.exp_avg.") for k in held if ".exp_avg." in k]
    assert sorted(fqns) == sorted(rows) and len(fqns) == 9
    for fqn in fqns:
        state = {s: held[f"optimizer.state.{s}.{fqn}"] for s in ("exp_avg", "exp_avg_sq")}
        _assert_adam(rows[fqn], state, group, step)


def test_megatron_state_first_keys_and_common_step() -> None:
    """Megatron-Core torch_dist (tests/fixtures/megatron/generate.py): moments under
    ``optimizer.state.<name>.<fqn>``, the step and hyper-parameters once in the common state."""
    report = health(MEGATRON / "run")
    assert [s.name for s in report.steps] == ["iter_0000001", "iter_0000003"]
    for name, iteration in (("iter_0000001", 1), ("iter_0000003", 3)):
        held = load_file(MEGATRON / "expected" / f"run_{name}.safetensors")
        common = json.loads((MEGATRON / "expected" / f"run_{name}.json").read_text())
        optimizer = common["common_state"]["optimizer"]
        step = optimizer["state"]["common_step"]["values"]
        assert step == iteration
        _assert_megatron(_rows(report, name), held, optimizer["param_groups"][0], float(step))
    assert report.findings == ()


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_deepspeed_state_rebuilt_from_the_ranks_partitions(stage: str) -> None:
    """DeepSpeed ZeRO (tests/fixtures/deepspeed/generate.py: AdamW lr 1e-2, torch's betas and
    eps, 2 steps): each parameter's moments as DeepSpeed's own universal-checkpoint converter
    splits them (moments.py), bit for bit, and the numbers health derives from them."""
    held = load_file(DEEPSPEED / f"{stage}.moments.safetensors")
    group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8}
    ck = inspector.open(DEEPSPEED / stage)
    report = health(ck)
    rows = _rows(report, "global_step2")
    names = sorted({k.rsplit(".", 1)[0] for k in held if k.endswith(".exp_avg")})
    assert len(names) == 10  # every trained parameter (the frozen norm and the tied head: none)
    for name in names:
        state = {s: held[f"{name}.{s}"] for s in ("exp_avg", "exp_avg_sq")}
        for s, value in state.items():
            assert torch.equal(ck.read(f"optimizer.state.{name}.{s}").flatten(), value.flatten())
        step = float(held.get(f"{name}.step", torch.tensor(2.0)))
        _assert_adam(rows[name.removeprefix("model.")], state, group, step)
    with_state = {key for key, row in rows.items() if row.exp_avg_rms is not None}
    assert with_state == {name.removeprefix("model.") for name in names}
    assert report.findings == ()


def test_megatron_distributed_optimizer_state() -> None:
    """distopt/: the same Megatron run with ``--use-distributed-optimizer`` (state saved
    fully reshardable: per parameter, the step in each parameter group); the moments as
    torch's DCP reader loads them, lr / betas / eps as the same schedule's (run/'s)."""
    import torch.distributed.checkpoint as dcp

    report = health(MEGATRON / "distopt")
    assert [s.name for s in report.steps] == ["iter_0000001", "iter_0000003"]
    for name, iteration in (("iter_0000001", 1), ("iter_0000003", 3)):
        folder = MEGATRON / "distopt" / name
        stored = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        wanted = {k: v for k, v in stored.items() if k.startswith("optimizer.state.exp_avg")}
        loaded = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in wanted.items()}
        dcp.load(loaded, checkpoint_id=folder)
        common = json.loads((MEGATRON / "expected" / f"run_{name}.json").read_text())
        group = common["common_state"]["optimizer"]["param_groups"][0]
        _assert_megatron(_rows(report, name), loaded, group, float(iteration))
    assert report.findings == ()


def test_a_damaged_optimizer_file_is_an_error_the_rest_is_reported(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(HF / "named_run", run)
    damaged = run / "checkpoint-4" / "optimizer.pt"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    report = health(run)
    (finding,) = report.findings
    assert (finding.kind, finding.severity, finding.step_name) == (
        "unreadable",
        "error",
        "checkpoint-4",
    )
    assert "optimizer.pt" in finding.message and "torch.save archive" in finding.message
    assert all(r.exp_avg_rms is not None for r in report.rows if r.step_name == "checkpoint-2")
    assert all(r.exp_avg_rms is None for r in report.rows if r.step_name == "checkpoint-4")
    assert len(report.rows) == 42  # the weights of both steps
