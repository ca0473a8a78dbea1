"""Where checkpoint bytes live, behind one small interface (:mod:`.base`)."""

from __future__ import annotations

import os
from pathlib import Path

from inspector.errors import NotACheckpointError
from inspector.storage.base import IOCount, Storage
from inspector.storage.local import LocalStorage

__all__ = ["IOCount", "LocalStorage", "Storage", "open_location"]


def open_location(path: str | os.PathLike) -> tuple[Storage, str]:
    """The storage holding ``path`` and the name of what was asked for inside it: a folder
    is its own storage (name ``""``), a file is a name in its parent's."""
    root = Path(path).expanduser()
    if root.is_dir():
        return LocalStorage(root), ""
    if not root.exists() and not root.is_symlink():
        raise NotACheckpointError("no such file or folder", file=root)
    return LocalStorage(root.parent), root.name
