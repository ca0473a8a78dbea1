"""``ckpt-inspect health``: text, the documented JSON shape and the exit codes, on runs a real
AdamW training loop saved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inspector.demo.run import RunPlan, build_run
from inspector.ui.cli import main
from tests.conftest import FAULTS

# A learning rate of 1e37 for one step: the weights overflow and the run diverges to NaN.
DIVERGED = RunPlan(steps=4, save_every=2, spike_layer=2, spike_at=3, spike_factor=1e40)


def test_healthy_run_exits_0_with_the_json_shape(healthy_run: Path, capsys) -> None:
    assert main(["health", str(healthy_run), "--json", "--steps", "10", "20"]) == 0
    shape = json.loads(capsys.readouterr().out)
    assert shape["ok"] is True and shape["findings"] == []
    assert [s["name"] for s in shape["steps"]] == ["step-10", "step-20"]
    layer = next(r for r in shape["layers"] if r["group"] == "layer 0" and r["step"] == 20)
    assert layer["parameters"] == 9 and 0 < layer["update_ratio"] < 1
    for documented in ("update_cosine", "exp_avg_rms", "exp_avg_sq_rms", "effective_step_rms"):
        assert documented in layer


def test_help_documents_the_shape(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["health", "--help"])
    text = capsys.readouterr().out
    assert '"findings": [{"kind", "severity"' in text and "Exit code" in text


def test_faults_are_warnings_exit_0(faulty_run: Path, capsys) -> None:
    keys = ["--keys", "layers.*.attention.wq.weight"]
    assert main(["health", str(faulty_run), *keys, "--workers", "2"]) == 0
    text = capsys.readouterr().out
    assert f"layers.{FAULTS.spike_layer}.attention.wq.weight changed by" in text
    assert f"layers.{FAULTS.frozen_layer}.attention.wq.weight did not change up to step-30" in text


def test_a_diverged_run_exits_1(tmp_path: Path, capsys) -> None:
    run = build_run(tmp_path / "diverged", DIVERGED)
    assert main(["health", str(run), "--json"]) == 1
    shape = json.loads(capsys.readouterr().out)
    errors = [f for f in shape["findings"] if f["severity"] == "error"]
    assert errors and {f["kind"] for f in errors} == {"non-finite"}
    assert {f["step_name"] for f in errors} == {"step-4"}


def test_an_unopenable_run_exits_2(tmp_path: Path, capsys) -> None:
    assert main(["health", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err
