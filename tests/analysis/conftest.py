"""The demo's real training state, loaded by torch's own DCP reader, to re-save changed."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from inspector.analysis import health_pass
from inspector.analysis.health import HealthReport, health


def load_state(path: Path) -> dict[str, Any]:
    """The checkpoint's whole nested state as torch's DCP loader returns it (what
    ``dcp_to_torch_save`` does; the demo is our own, trusted output)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(
        state,
        storage_reader=FileSystemReader(path),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    return state


@pytest.fixture(scope="session")
def flat_state(demo_dir: Path) -> dict[str, Any]:
    """The 2-rank ``flat`` demo's state: model keys at top level, ``optimizer`` (flattened,
    ``state.<fqn>.exp_avg``), ``lr_scheduler``, ``dataloader``, ``train_state``."""
    return load_state(demo_dir / "flat")


@pytest.fixture
def resave(flat_state: dict[str, Any], tmp_path: Path) -> Callable[..., Path]:
    """``resave(name, change)``: the flat demo's state changed by ``change(state)`` (a deep
    copy) and saved by torch DCP from this one process into a new folder."""
    import torch.distributed.checkpoint as dcp

    def save(name: str, change: Callable[[dict[str, Any]], None] | None = None) -> Path:
        state = copy.deepcopy(flat_state)
        if change is not None:
            change(state)
        path = tmp_path / name
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
        return path

    return save


def health_by_torch(run: Path) -> HealthReport:
    """health as an install without a C compiler takes it: torch ops on each block."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(health_pass, "_health", None)
        return health(run)
