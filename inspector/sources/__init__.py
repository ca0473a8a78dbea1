"""On-disk formats. ``open_source`` sniffs a path and returns the matching reader."""

from __future__ import annotations

import os
from pathlib import Path

from inspector.errors import NotACheckpointError
from inspector.sources.base import Source


def open_source(path: str | os.PathLike) -> Source:
    """Pick the reader for ``path`` by its content (not by its name alone)."""
    from inspector.sources import dcp

    root = Path(path).expanduser()
    if not root.exists():
        raise NotACheckpointError("no such file or folder", file=root)
    if dcp.is_dcp_dir(root):
        return dcp.DcpSource(root)
    raise NotACheckpointError(
        "not a checkpoint: no DCP .metadata, torch.save archive or safetensors file found",
        file=root,
    )
