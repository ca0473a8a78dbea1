"""Where checkpoint bytes live, behind one small interface (:mod:`.base`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from inspector.errors import NotACheckpointError
from inspector.storage.base import IOCount, Storage
from inspector.storage.local import LocalStorage
from inspector.storage.remote import RemoteStorage, is_url, open_url

__all__ = ["IOCount", "LocalStorage", "RemoteStorage", "Storage", "is_url", "open_location"]


def open_location(
    path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
) -> tuple[Storage, str]:
    """The storage holding ``path`` (a local path, or an s3://, gs://, hf://, http(s):// URL
    read with fsspec ``storage_options``; a local path ignores them, so one set serves a call
    given a local path and a URL) and the name of what was asked for inside it: a
    folder is its own storage (name ``""``), a file is a name in its parent's."""
    if is_url(path):
        return open_url(str(path), storage_options)
    root = Path(path).expanduser()
    if root.is_dir():
        return LocalStorage(root), ""
    if not root.exists() and not root.is_symlink():
        raise NotACheckpointError("no such file or folder", file=root)
    return LocalStorage(root.parent), root.name
