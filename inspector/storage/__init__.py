"""Where checkpoint bytes live, behind one small interface (:mod:`.base`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from inspector.errors import NotACheckpointError, UsageError
from inspector.storage.base import IOCount, Storage
from inspector.storage.local import LocalStorage
from inspector.storage.remote import RemoteStorage, is_url, open_url

__all__ = ["IOCount", "LocalStorage", "RemoteStorage", "Storage", "is_url", "open_location"]


def open_location(
    path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
) -> tuple[Storage, str]:
    """The storage holding ``path`` (a local path, or an s3://, gs://, hf://, http(s):// URL
    read with fsspec ``storage_options``) and the name of what was asked for inside it: a
    folder is its own storage (name ``""``), a file is a name in its parent's."""
    if is_url(path):
        return open_url(str(path), storage_options)
    if storage_options:
        raise UsageError(f"storage_options apply to URLs only, not to the local path {path}")
    root = Path(path).expanduser()
    if root.is_dir():
        return LocalStorage(root), ""
    if not root.exists() and not root.is_symlink():
        raise NotACheckpointError("no such file or folder", file=root)
    return LocalStorage(root.parent), root.name
