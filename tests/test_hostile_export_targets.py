"""Class 3, an export target that is, or passes through, a symlink into the source: every
export format refuses it before writing a byte, and the source stays byte-identical."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import inspector
from inspector.errors import ExportError
from tests.fixtures.damage import tree_hash

FOLDER_FORMATS = ["safetensors", "hf", "dcp", "megatron"]
FILE_FORMATS = {"pt": "out.pt", "safetensors": "out.safetensors"}


def _link(link: Path, to: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(to, link)
    return link


def _targets(source: Path, tmp: Path, leaf: str | None) -> dict[str, Path]:
    """Ways to reach inside ``source`` from ``tmp``: a link to it (or to a file of it), a
    path through a link to it, through a chain of two links, and through a link to an
    ancestor of it."""
    into = _link(tmp / "into", source)
    chain = _link(tmp / "chain", _link(tmp / "hop", into))
    above = _link(tmp / "above", source.parent)
    name = leaf or "out"
    found = {
        "through-link": into / name,
        "through-chain": chain / "deeper" / name,
        "through-ancestor-link": above / source.name / name,
    }
    if leaf is None:
        found["is-link"] = into
    else:
        found["is-link-to-file"] = _link(tmp / f"alias-{leaf}", source / "__0_0.distcp")
    return found


@pytest.mark.parametrize("format", FOLDER_FORMATS + [f"{f}-file" for f in FILE_FORMATS])
def test_symlinked_target_into_the_source_is_refused(demo_copy, tmp_path: Path,
                                                     format: str) -> None:
    source = demo_copy("seed")
    before = tree_hash(source)
    kind = format.removesuffix("-file")
    leaf = FILE_FORMATS[kind] if format.endswith("-file") else None
    for how, target in _targets(source, tmp_path / "links", leaf).items():
        with pytest.raises(ExportError, match="source checkpoint") as err:
            inspector.export(source, target, format=kind, progress=False)
        assert str(target) in str(err.value), (how, err.value)
    assert tree_hash(source) == before
    assert sorted(p.name for p in source.iterdir()) == [".metadata", "__0_0.distcp"]


def test_single_file_source_behind_a_link_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "ckpt" / "state.pt"
    source.parent.mkdir()
    torch.save({"w": torch.arange(4.0)}, source)
    before = source.read_bytes()
    alias = _link(tmp_path / "alias.pt", source)
    over = _link(tmp_path / "dir-link", source.parent) / "state.pt"
    for target in (alias, over):
        with pytest.raises(ExportError, match="overwrite a file of the source"):
            inspector.export(source, target, format="pt", progress=False)
    assert source.read_bytes() == before
    assert sorted(p.name for p in source.parent.iterdir()) == ["state.pt"]
