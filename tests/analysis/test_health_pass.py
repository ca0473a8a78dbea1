"""Health's one-pass numbers (analysis/health_pass.py) where they are hard to get right:
tensors of several blocks whose rows do not divide a block, bf16 / fp16 values, NaN / Inf,
values whose squares overflow float32, dead rows and columns, a 3-D and a 0-d tensor; in a
run of three steps written by safetensors, checked against torch's float64 computations on
what safetensors loads. The same report from worker processes and from a loopback server."""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inspector.analysis import health_pass
from inspector.analysis.health import HealthReport, health
from inspector.analysis.health_pass import BLOCK
from inspector.errors import InspectorError, UsageError
from tests.analysis.conftest import health_by_torch
from tests.fixtures.servers import CountedServer
from tests.native import health_cases
from tests.storage.uploads import uploaded

STEPS = ("step-1", "step-2", "step-3")
MATRIX = "model.layers.0.mlp.weight"  # 300 x 700: 93 rows a block, 3 blocks and a rest


def _tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    w = torch.randn(300, 700, generator=g)
    w[5] = 0.0  # a dead row
    w[:, 9] = 0.0  # a dead column
    w[7, 7], w[8, 8], w[9, 9] = math.nan, math.inf, -math.inf
    w[10, 10] = 1e30 * step  # its square overflows float32; so does its update's
    w[11, 11] = -0.0
    return {
        MATRIX: w,
        "model.layers.0.attn.weight": torch.randn(64, 2 * BLOCK // 64 + 3, generator=g).bfloat16(),
        "model.layers.1.conv.weight": torch.randn(4, 50, 400, generator=g).half(),
        "model.layers.1.norm.weight": torch.randn(BLOCK + 1000, generator=g),
        "model.scale": torch.tensor(0.5 * step),
    }


@pytest.fixture(scope="module")
def edge_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("edge_run")
    for i, name in enumerate(STEPS, 1):
        (run / name).mkdir()
        save_file(_tensors(i), run / name / "model.safetensors")
    return run


@pytest.fixture(scope="module")
def edge(edge_run: Path) -> HealthReport:
    return health(edge_run)


@pytest.fixture(scope="module", params=["C", "torch"])
def report(request: pytest.FixtureRequest, edge: HealthReport, edge_run: Path) -> HealthReport:
    """The report with the numbers taken by _health.c, and by torch (no C compiler)."""
    return edge if request.param == "C" else health_by_torch(edge_run)


def test_the_c_kernel_is_built_and_agrees_with_python() -> None:
    assert health_pass._health is not None  # else every "C" case above ran torch's code
    assert health_cases.failures() == []


def _loaded(run: Path) -> list[dict[str, torch.Tensor]]:
    return [load_file(run / name / "model.safetensors") for name in STEPS]


def _finite(w: torch.Tensor) -> torch.Tensor:
    w = w.double()
    return torch.where(torch.isfinite(w), w, 0.0)


@pytest.mark.parametrize("stored", list(_tensors(1)))
def test_numbers_match_torch(report: HealthReport, edge_run: Path, stored: str) -> None:
    steps = [s[stored] for s in _loaded(edge_run)]
    name = stored.removeprefix("model.")
    rows = [r for r in report.rows if r.key == name]
    assert [r.step_name for r in rows] == list(STEPS)
    for i, (row, w) in enumerate(zip(rows, steps, strict=True)):
        clean = _finite(w)
        assert row.l2 == pytest.approx(float(clean.norm()), rel=1e-6)
        assert (row.nan, row.inf) == (int(w.isnan().sum()), int(w.isinf().sum()))
        assert row.absmax == float(clean.abs().max())
        assert row.zero_fraction == float((clean == 0).double().mean())
        if i == 0:
            assert row.update_ratio is None
            continue
        update = _finite(w.double() - steps[i - 1].double())
        before = float(_finite(steps[i - 1]).norm())
        assert row.update_l2 == pytest.approx(float(update.norm()), rel=1e-6)
        assert row.update_ratio == pytest.approx(float(update.norm()) / before, rel=1e-6)
        if i == 2 and stored != "model.scale":
            previous = _finite(steps[1].double() - steps[0].double())
            cosine = float(update.flatten() @ previous.flatten()) / float(
                update.norm() * previous.norm()
            )
            assert row.update_cosine == pytest.approx(cosine, rel=1e-5, abs=1e-7)


def test_channels_of_a_matrix_in_blocks(report: HealthReport, edge_run: Path) -> None:
    w = _finite(_loaded(edge_run)[1][MATRIX]).abs()
    rows, columns = w.amax(1), w.amax(0)
    row = next(r for r in report.rows if r.key == MATRIX.removeprefix("model.") and r.step == 2)
    assert (row.dead_rows, row.dead_columns) == (1, 1)
    ratio = max(float(rows.max() / rows.median()), float(columns.max() / columns.median()))
    assert row.channel_ratio == pytest.approx(ratio, rel=1e-6)
    assert (row.outlier_rows, row.outlier_columns) == (1, 1)  # the 2e30 one
    kinds = {(f.kind, f.key) for f in report.findings if f.step == 2}
    assert ("non-finite", "layers.0.mlp.weight") in kinds
    assert ("dead-rows", "layers.0.mlp.weight") in kinds


def test_workers_make_the_same_report(faulty_run: Path) -> None:
    one = health(faulty_run)
    two = health(faulty_run, workers=2)
    assert two.rows == one.rows
    assert two.findings == one.findings
    with pytest.raises(UsageError, match="workers must be at least 1"):
        health(faulty_run, workers=0)


class _KillsItsUnpickler:
    """A storage option each worker unpickles with its task: that worker dies by SIGKILL
    there, once started and at work (a local run ignores the option)."""

    def __reduce__(self) -> tuple:
        return signal.raise_signal, (signal.SIGKILL,)


def test_a_dead_worker_is_reported_with_its_signal(faulty_run: Path) -> None:
    with pytest.raises(InspectorError, match="health worker process died: killed by SIGKILL"):
        health(faulty_run, workers=2, storage_options={"dies": _KillsItsUnpickler()})


def test_a_remote_run_reads_ranges_and_matches(
    edge: HealthReport, edge_run: Path, s3_server: CountedServer
) -> None:
    url = uploaded(s3_server, edge_run, "health-edge-run")
    s3_server.stats.reset()
    remote = health(url, storage_options=s3_server.storage_options)
    assert [s.name for s in remote.steps] == list(STEPS)
    assert remote.rows == edge.rows  # bit for bit: the same blocks, read another way
    assert remote.findings == edge.findings
    stored = sum(p.stat().st_size for p in edge_run.rglob("*.safetensors"))
    assert s3_server.stats.bytes <= 1.05 * stored  # each tensor's bytes once per step


def test_the_workspace_reuses_its_memory_and_grows_to_the_largest() -> None:
    workspace = health_pass.Workspace()
    first = workspace.take("values", 1000)
    smaller = workspace.take("values", 10, torch.bfloat16)
    assert (first.dtype, first.numel(), smaller.dtype, smaller.numel()) == (
        torch.float32, 1000, torch.bfloat16, 10
    )  # fmt: skip
    assert smaller.data_ptr() == first.data_ptr()  # no new allocation
    grown = workspace.take("values", 5000)
    assert grown.numel() == 5000 and workspace.take("values", 4000).data_ptr() == grown.data_ptr()
    assert workspace.take("updates", 10).data_ptr() != grown.data_ptr()  # names do not share
