"""Shared fixtures: real checkpoints written by real torch code paths, built once per session."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from inspector.demo import build_demo
from inspector.demo.run import RunPlan, build_run
from tests.fixtures import formats
from tests.fixtures.servers import SERVERS, CountedServer


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``flat/``, ``prefixed/``, ``fp8/`` (2 gloo ranks, FSDP2) and ``seed/`` (1 process)."""
    out = tmp_path_factory.mktemp("demo")
    build_demo(out)
    return out


# The faults run health must find: one layer's learning rate x300 for training step 25, another
# layer frozen after step 15 (saves every 10 steps up to 40).
FAULTS = RunPlan(spike_layer=1, spike_at=25, frozen_layer=0, freeze_after=15)


@pytest.fixture(scope="session")
def healthy_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torchtitan-style run (step-10/ ... step-40/, model + AdamW state) trained normally."""
    return build_run(tmp_path_factory.mktemp("healthy_run"))


@pytest.fixture(scope="session")
def faulty_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run with the ``FAULTS`` injected."""
    return build_run(tmp_path_factory.mktemp("faulty_run"), FAULTS)


@pytest.fixture
def demo_copy(demo_dir: Path, tmp_path: Path):
    """A private copy of one demo checkpoint, free to damage."""

    def copy(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(demo_dir / name, target)
        return target

    return copy


def run_python(code: str, *args: str, block_torchao: bool = False) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (optionally one where ``import torchao`` fails)."""
    prelude = "import sys\nsys.modules['torchao'] = None\n" if block_torchao else ""
    return subprocess.run(
        [sys.executable, "-c", prelude + code, *args], capture_output=True, text=True, timeout=300
    )


# --- checkpoints in every format, from the real producers (tests/fixtures/formats.py) ---


@pytest.fixture(scope="session")
def safetensors_written(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``single`` (save_file), ``sharded`` and ``bin-sharded`` (huggingface_hub)."""
    return formats.write_safetensors(tmp_path_factory.mktemp("safetensors"))


@pytest.fixture(scope="session")
def torch_save_written(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``nested`` training state, ``state_dict`` (pytorch_model.bin), ``legacy`` (pre-1.6)."""
    return formats.write_torch_save(tmp_path_factory.mktemp("torch_save"))


@pytest.fixture(scope="session")
def dcp_single_written(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One-process DCP saves: ``hf``, ``hf-two-files``, ``distcp-safetensors``."""
    return formats.write_dcp_single(tmp_path_factory.mktemp("dcp_single"))


@pytest.fixture(scope="session")
def dcp_distributed_written(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two gloo ranks: ``distcp-safetensors``, ``hf-distributed``, ``hf-export``,
    ``per-rank-metadata`` (``use_collectives=False``: one ``__<rank>.metadata`` per rank)."""
    return formats.write_dcp_distributed(tmp_path_factory.mktemp("dcp_distributed"))


@pytest.fixture(scope="session")
def dcp_torch_save(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """torch's ``dcp_to_torch_save`` output of each demo checkpoint."""
    return formats.write_dcp_to_torch_save(demo_dir, tmp_path_factory.mktemp("dcp_to_torch"))


# --- checkpoints saved in this process (keys, tree and doctor tests) ------------------------
def save_dcp(state: dict, path: Path, **save_kwargs) -> Path:
    """``dcp.save`` of ``state`` to ``path`` from this one process, without collectives."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True, **save_kwargs)
    return path


# --- a tiny transformers Llama saved by DCP from two FSDP2 ranks (tests/fixtures/hf_llama.py)


@pytest.fixture(scope="session")
def hf_llama_dcp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.fixtures import hf_llama

    root = tmp_path_factory.mktemp("hf_llama")
    return {
        "plain": hf_llama.build(root / "plain", fp8=False),
        "fp8": hf_llama.build(root / "fp8", fp8=True),
    }


# --- torch_checkpointing ("DCPv2") folders from the library's own CheckpointManager -------
# (tests/fixtures/torch_checkpointing.py; expected values lie beside each checkpoint folder)


@pytest.fixture(scope="session")
def tc_single_written(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process: ``single`` (every layout, ``metadata.pkl``), ``single-uncommitted``."""
    from tests.fixtures import torch_checkpointing as tc

    return tc.write_single(tmp_path_factory.mktemp("tc_single"))


@pytest.fixture(scope="session")
def tc_distributed_written(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two gloo ranks: ``fsdp``, ``fsdp-safetensors``, ``fsdp-uncommitted``, ``hsdp``,
    ``fsdp-tp`` (``_StridedShard``) and ``placements`` (every placement, no ``metadata.pkl``)."""
    from tests.fixtures import torch_checkpointing as tc

    return tc.write_distributed(tmp_path_factory.mktemp("tc_distributed"))


# --- storage servers on 127.0.0.1 (tests/fixtures/servers.py): one per session and backend,
# stats and faults reset around every test that asks for one ---------------------------------
def _session_server(kind: str):
    @pytest.fixture(scope="session", name=f"{kind}_server_session")
    def fixture() -> Iterator[CountedServer]:
        with SERVERS[kind]() as server:
            yield server

    @pytest.fixture(name=f"{kind}_server")
    def per_test(request: pytest.FixtureRequest) -> Iterator[CountedServer]:
        server = request.getfixturevalue(f"{kind}_server_session")
        server.reset()
        yield server
        server.reset()

    return fixture, per_test


s3_server_session, s3_server = _session_server("s3")
gcs_server_session, gcs_server = _session_server("gcs")
http_server_session, http_server = _session_server("http")
hf_server_session, hf_server = _session_server("hf")


@pytest.fixture(params=sorted(SERVERS))
def remote_server(request: pytest.FixtureRequest) -> CountedServer:
    """Each backend in turn (s3, gcs, http, hf), reset for this test."""
    return request.getfixturevalue(f"{request.param}_server")


# --- tiny transformers models saved as torchtitan checkpoints (fixtures/torchtitan_models.py)


@pytest.fixture(scope="session")
def torchtitan_models(tmp_path_factory: pytest.TempPathFactory):
    """llama3, qwen3 (tied) and qwen3_moe: HF folders, HF assets, and DCP saves in both
    torchtitan namings (flat and ``model.``-prefixed; llama3 also FSDP2 and FP8 on 2 ranks)."""
    from tests.fixtures import torchtitan_models

    return torchtitan_models.build(tmp_path_factory.mktemp("torchtitan_models"))


# --- hostile input (tests/hostile/): genuine starting points, and the counts in the summary --


@pytest.fixture(scope="session")
def genuine(
    demo_dir: Path,
    safetensors_written: dict,
    torch_save_written: dict,
    dcp_single_written: dict,
    tmp_path_factory: pytest.TempPathFactory,
):
    """The genuine checkpoints hostile cases and fuzzing damage copies of, each run through
    every entry point once (so no lazy import happens inside a guarded block)."""
    from tests.hostile.case import Genuine
    from tests.hostile.pipeline import warm_up

    found = Genuine(
        seed=demo_dir / "seed",
        flat=demo_dir / "flat",
        safetensors=safetensors_written["single"].path,
        hub=safetensors_written["sharded"].path,
        pt=torch_save_written["nested"].path,
        model_bin=torch_save_written["state_dict"].path,
        legacy=torch_save_written["legacy"].path,
        distcp_safetensors=dcp_single_written["distcp-safetensors"].path,
    )
    warm_up(vars(found), tmp_path_factory.mktemp("warm_up"))
    return found


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print how many hostile cases and fuzz examples ran, and how many failed."""
    from tests.hostile.tally import TALLY

    failed = [report.nodeid for report in terminalreporter.stats.get("failed", [])]
    for line in TALLY.summary(failed):
        terminalreporter.write_line(line)
