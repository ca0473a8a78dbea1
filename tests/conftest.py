"""Shared fixtures: real checkpoints written by real torch code paths, built once per session."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from inspector.demo import build_demo


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``flat/``, ``prefixed/``, ``fp8/`` (2 gloo ranks, FSDP2) and ``seed/`` (1 process)."""
    out = tmp_path_factory.mktemp("demo")
    build_demo(out)
    return out


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


# --- checkpoints saved in this process (keys, tree and doctor tests) ------------------------
def save_dcp(state: dict, path: Path, **save_kwargs) -> Path:
    """``dcp.save`` of ``state`` to ``path`` from this one process, without collectives."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True, **save_kwargs)
    return path
