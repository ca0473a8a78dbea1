"""Run health over real run folders of step files and of tagged folders: Lightning
(tests/fixtures/lightning_run/generate.py: ModelCheckpoint's default names, a save every 2
steps, ``last.ckpt``) against torch's numbers on the state dicts the checkpoints load to;
DeepSpeed saved after each step (tests/fixtures/deepspeed/generate.py ``run/``: two
``global_stepN/`` tags and ``latest``) against DeepSpeed's own fp32 weights of each tag."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from inspector.analysis.health import health

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RUN = FIXTURES / "lightning_run" / "checkpoints"
DEEPSPEED = FIXTURES / "deepspeed"
STEPS = {"epoch=0-step=2.ckpt": 2, "epoch=0-step=4.ckpt": 4, "epoch=1-step=6.ckpt": 6}
UNIQUE = {"net.0.weight", "net.6.weight", "net.6.bias"}  # the shapes no other parameter has
NAMES = [f"net.{i}.{p}" for i in (0, 2, 4, 6) for p in ("weight", "bias")]


def _rms(value: torch.Tensor) -> float:
    return float(value.double().pow(2).mean().sqrt())


def test_health_walks_the_step_files() -> None:
    report = health(RUN)
    assert [(s.name, s.number) for s in report.steps] == list(STEPS.items())
    saved = {name: torch.load(RUN / name, weights_only=True) for name in STEPS}
    assert len(report.rows) == len(STEPS) * len(NAMES)
    before: dict[str, torch.Tensor] = {}
    update: dict[str, torch.Tensor] = {}
    for name, number in STEPS.items():
        state, optimizer = saved[name]["state_dict"], saved[name]["optimizer_states"][0]
        (group,) = optimizer["param_groups"]
        rows = {r.key: r for r in report.rows if r.step_name == name}
        assert sorted(rows) == sorted(NAMES)
        for i, key in enumerate(NAMES):
            w, row = state[key].double(), rows[key]
            assert row.step == number
            assert row.l2 == pytest.approx(float(w.norm()), rel=1e-6)
            assert row.rms == pytest.approx(_rms(w), rel=1e-6)
            assert row.absmax == float(w.abs().max())
            if key in before:
                delta = w - before[key]
                assert row.update_l2 == pytest.approx(float(delta.norm()), rel=1e-6)
                ratio = float(delta.norm() / before[key].norm())
                assert row.update_ratio == pytest.approx(ratio, rel=1e-6)
                if key in update:
                    cosine = torch.nn.functional.cosine_similarity(
                        delta.flatten(), update[key].flatten(), dim=0
                    )
                    assert row.update_cosine == pytest.approx(float(cosine), rel=1e-5, abs=1e-9)
                update[key] = delta
            else:
                assert row.update_ratio is None
            before[key] = w
            if key in UNIQUE:  # Adam state paired as for one file (test_health_optimizer.py)
                m, v = optimizer["state"][i]["exp_avg"], optimizer["state"][i]["exp_avg_sq"]
                assert row.optimizer_step == float(saved[name]["global_step"]) == number
                assert row.exp_avg_rms == pytest.approx(_rms(m), rel=1e-6)
                assert row.exp_avg_sq_rms == pytest.approx(_rms(v), rel=1e-6)
                assert group["betas"] == (0.8, 0.99)
            else:
                assert row.exp_avg_rms is None and row.optimizer_step is None
    assert [(f.kind, f.step_name, f.value) for f in report.findings] == [
        ("cannot-pair", name, 5.0) for name in STEPS
    ]  # nothing else flagged on this healthy run


def test_health_walks_deepspeed_tags() -> None:
    """ZeRO-2 in fp32 with the final norm frozen: the weights of each tag as DeepSpeed's
    zero_to_fp32 rebuilds them, the update between the tags, and only the norm flagged."""
    report = health(DEEPSPEED / "run")
    assert [(s.name, s.number) for s in report.steps] == [("global_step1", 1), ("global_step2", 2)]
    held = [load_file(DEEPSPEED / f"run.global_step{n}.fp32.safetensors") for n in (1, 2)]
    for step, weights in enumerate(held, start=1):
        rows = {r.key: r for r in report.rows if r.step == step}
        assert {k.removeprefix("model.") for k in weights} == set(rows)
        for key, value in weights.items():
            row, w = rows[key.removeprefix("model.")], value.double()
            assert row.l2 == pytest.approx(float(w.norm()), rel=1e-6)
            if step == 2:
                delta = (w - held[0][key].double()).norm()
                ratio = float(delta / held[0][key].double().norm())
                assert row.update_ratio == pytest.approx(ratio, rel=1e-6, abs=1e-12)
            own_state = key not in {"model.norm.weight", "lm_head.weight"}  # frozen; tied
            assert (row.optimizer_step == step) if own_state else row.optimizer_step is None
    (frozen,) = report.findings
    assert (frozen.kind, frozen.key, frozen.step_name) == ("frozen", "norm.weight", "global_step2")
