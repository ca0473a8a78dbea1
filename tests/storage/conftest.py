"""Fixtures of the storage tests."""

from __future__ import annotations

from pathlib import Path

import pytest

import inspector


@pytest.fixture(scope="session")
def fp8_local(demo_dir: Path) -> inspector.Checkpoint:
    """The FP8 demo checkpoint (2 ranks, FSDP2, torchao wrappers), opened locally."""
    return inspector.open(demo_dir / "fp8")
