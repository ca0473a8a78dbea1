"""checkpoint-inspector: open PyTorch training checkpoints lazily and safely.

``import inspector`` is cheap: torch, pandas and ipywidgets load only when used.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from inspector.errors import (
    CheckpointFileMissingError,
    CorruptCheckpointError,
    ExportError,
    InspectorError,
    MissingKeyError,
    NotACheckpointError,
    UnsafeCheckpointError,
    UnsupportedError,
)

if TYPE_CHECKING:
    from inspector.analysis.fqn import check_keys, explain_error
    from inspector.checkpoint import Checkpoint
    from inspector.ui.widgets import Inspector

__all__ = [
    "CheckpointFileMissingError",
    "CorruptCheckpointError",
    "ExportError",
    "Inspector",
    "InspectorError",
    "MissingKeyError",
    "NotACheckpointError",
    "UnsafeCheckpointError",
    "UnsupportedError",
    "check_keys",
    "diff",
    "explain_error",
    "export",
    "open",
]
__version__ = "0.1.0"


def open(path: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint (DCP folder, .pt/.pth/.bin, .safetensors, HF sharded folder or index)."""
    from inspector.checkpoint import Checkpoint
    from inspector.formats.detect import open_source
    from inspector.gc_pause import paused_gc

    with paused_gc():
        return Checkpoint(open_source(path))


# Public functions whose modules import torch: loaded on first use.
_LAZY = {
    "check_keys": "inspector.analysis.fqn",
    "diff": "inspector.analysis.diff",
    "explain_error": "inspector.analysis.fqn",
    "export": "inspector.exporting.run",
    "Inspector": "inspector.ui.widgets",
}


def __getattr__(name: str) -> Any:
    """Load diff, the FQN doctor, export (they need torch) and the app (ipywidgets) on use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'inspector' has no attribute {name!r}")
