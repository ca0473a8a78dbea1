"""Checkpoints the app is tried on besides the demo: damaged copies and a training-run root."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import inspector
from tests.fixtures.damage import flip_byte

WQ = "layers.0.attention.wq.weight"


@pytest.fixture
def flipped(demo_dir: Path, tmp_path: Path) -> Path:
    """The flat demo with one byte of WQ's rank-1 rows flipped: only CRC-32s tell."""
    path = tmp_path / "flipped"
    shutil.copytree(demo_dir / "flat", path)
    where = inspector.open(path).byte_ranges(WQ)[1]
    flip_byte(path / where.name, where.offset + 37 * 4 + 2)
    return path


@pytest.fixture
def truncated(demo_dir: Path, tmp_path: Path) -> tuple[Path, set[str]]:
    """The flat demo with rank 0's file cut 20 kB short, and the keys cut off."""
    path = tmp_path / "truncated"
    shutil.copytree(demo_dir / "flat", path)
    shard = path / "__0_0.distcp"
    size = shard.stat().st_size - 20_000
    os.truncate(shard, size)
    cut = {
        e.key
        for e in inspector.open(path).entries()
        for c in e.chunks
        if c.file == shard.name and c.byte_offset + c.byte_length > size
    }
    return path, cut


@pytest.fixture
def run_root(demo_dir: Path, tmp_path: Path) -> Path:
    """A torchtitan run folder: the seed checkpoint as step-9, the flat demo as step-10."""
    root = tmp_path / "checkpoint"
    shutil.copytree(demo_dir / "seed", root / "step-9")
    shutil.copytree(demo_dir / "flat", root / "step-10")
    return root
