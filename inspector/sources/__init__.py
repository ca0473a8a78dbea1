"""On-disk formats. ``open_source`` sniffs a path and returns the matching reader."""

from __future__ import annotations

import os
from pathlib import Path

from inspector.errors import NotACheckpointError
from inspector.sources.base import Source


def open_source(path: str | os.PathLike) -> Source:
    """Pick the reader for ``path`` by its content (not by its name alone).

    A folder: DCP (``.metadata``), else what ``folder.open_folder`` finds there. A file:
    safetensors, torch.save (zip or pre-1.6), a ``*.index.json`` of shards, or a DCP
    ``.metadata`` file (its folder is opened).
    """
    from inspector.sources import dcp

    root = Path(path).expanduser()
    if not root.exists():
        raise NotACheckpointError("no such file or folder", file=root)
    if dcp.is_dcp_dir(root):
        return dcp.DcpSource(root)
    if root.is_dir():
        from inspector.sources.folder import open_folder

        return open_folder(root)
    if root.name.endswith(dcp.METADATA_FILE) and dcp.is_dcp_dir(root.parent):
        return dcp.DcpSource(root.parent)
    return _open_file(root)


def _open_file(path: Path) -> Source:
    from inspector.sources.sharded import ShardedSource
    from inspector.sources.sniff import file_kind, open_file

    if file_kind(path) == "json":
        source = ShardedSource(path.parent, [], index=path)
        source.notes = (f"opened the index {path.name}", *source.notes)
        return source
    return open_file(path)
