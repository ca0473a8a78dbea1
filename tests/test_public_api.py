"""The public API of DESIGN.md at runtime, and the torch-free metadata path: opening, listing,
the tree, the FQN check and ``ckpt-inspect ls/show/check`` never import torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import inspector
from inspector.demo.model import build_model
from tests.conftest import run_python

HEAVY = ("torch", "pandas", "ipywidgets")


def loaded_after(code: str, *args: str) -> list[str]:
    """Which of torch, pandas, ipywidgets a fresh interpreter has loaded after ``code``."""
    probe = (
        f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    result = run_python(probe, *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_import_is_lazy() -> None:
    assert loaded_after("import inspector") == []


@pytest.mark.parametrize("name", ["flat", "fp8"])
def test_open_table_tree_and_scan_need_no_torch(demo_dir: Path, name: str) -> None:
    code = (
        "import sys, inspector\n"
        "ck = inspector.open(sys.argv[1])\n"
        "ck.table(); ck.tree('flattened').children; ck.scan(progress=False)\n"
        "assert ck.facts('layers.0.attention.wq.weight').subclass or sys.argv[1].endswith('flat')\n"
        "report = inspector.check_keys(ck, list(ck.keys())[:3])\n"
        "assert not inspector.check_keys(ck, ck).missing\n"
        "del sys.modules['pandas']\n"  # the table's own import: pandas needs no torch either
    )
    assert "torch" not in loaded_after(code, str(demo_dir / name))


def test_formats_other_than_dcp_open_without_torch(
    safetensors_written: dict, torch_save_written: dict
) -> None:
    for path in (safetensors_written["single"].path, safetensors_written["sharded"].path):
        code = "import sys, inspector\ninspector.open(sys.argv[1]).tree()\n"
        assert loaded_after(code, str(path)) == [], path


def test_cli_metadata_commands_need_no_torch(demo_dir: Path) -> None:
    for argv in (
        ["ls", str(demo_dir / "fp8")],
        ["ls", "--json", str(demo_dir / "flat")],
        ["show", str(demo_dir / "flat"), "lr_scheduler.last_epoch"],
        ["check", str(demo_dir / "prefixed"), "--against", str(demo_dir / "flat")],
    ):
        code = f"from inspector.ui.cli import main\nmain({argv!r})\n"
        assert "torch" not in loaded_after(code), argv


def test_python_dash_m_is_the_cli(demo_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "inspector", "ls", "--json", str(demo_dir / "seed")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["format"] == "dcp" and payload["layout"] == "model-only"
    assert len(payload["entries"]) == len(build_model().state_dict())


def test_public_names_exist_at_runtime(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "flat")
    assert isinstance(ck, inspector.Checkpoint)
    assert set(inspector.__all__) <= set(dir(inspector))
    for name in inspector.__all__:
        assert getattr(inspector, name) is not None, name
    stats = inspector.stats(ck, "norm.weight")
    assert stats == ck.stats("norm.weight")
    assert stats.numel == 64 and stats.mean == pytest.approx(ck.read("norm.weight").mean().item())
    hist = inspector.histogram(demo_dir / "flat", "norm.weight", bins=8)
    assert int(hist.counts.sum()) == 64 and hist.plot() is not None
    assert inspector.fp8.dequantize(torch.ones(2, 2), dtype="float16").dtype == torch.float16
    one_step = inspector.health(ck, keys=["norm.weight"])
    assert isinstance(one_step, inspector.HealthReport)
    assert one_step.rows[0].l2 == pytest.approx(float(ck.read("norm.weight").double().norm()))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        inspector.nope  # noqa: B018


def test_dtype_names_are_accepted_everywhere(demo_dir: Path, tmp_path: Path) -> None:
    ck = inspector.open(demo_dir / "seed")
    assert ck.read("norm.weight", dtype="float16").dtype == torch.float16
    assert ck.read("norm.weight", dtype=torch.bfloat16).dtype == torch.bfloat16
    result = inspector.export(ck, tmp_path / "bf16", dtype="bfloat16", progress=False)
    assert result.verification.ok
    assert inspector.open(tmp_path / "bf16" / "model.safetensors").entry("norm.weight").dtype == (
        "bfloat16"
    )
    for bad in (
        lambda: ck.read("norm.weight", dtype="bf16x"),
        lambda: inspector.export(ck, tmp_path / "x", dtype="float33", progress=False),
    ):
        with pytest.raises(inspector.UsageError, match="unknown dtype"):
            bad()
    assert not (tmp_path / "x").exists()


def test_str_of_a_report_is_its_explanation(demo_dir: Path) -> None:
    report = inspector.check_keys(demo_dir / "prefixed", build_model())
    assert str(report) == report.explain() and "strip 'model.'" in str(report)
    assert repr(report).startswith("<KeyReport mismatch")
