"""checkpoint-inspector: open PyTorch training checkpoints lazily and safely.

``import inspector`` is cheap, and so is opening and listing a checkpoint: torch, pandas
and ipywidgets load only when used (a tensor read, a table, the app).
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
    StorageAccessError,
    UnfinishedSaveError,
    UnsafeCheckpointError,
    UnsupportedError,
    UsageError,
)
from inspector.gc_pause import paused_gc as _paused_gc
from inspector.version import __version__

if TYPE_CHECKING:
    from types import ModuleType

    from inspector.analysis.audit import AuditReport, audit
    from inspector.analysis.diff import diff
    from inspector.analysis.error_text import explain_error
    from inspector.analysis.fingerprint import Fingerprint, fingerprint
    from inspector.analysis.fqn import KeyReport, check_keys
    from inspector.analysis.health import HealthReport, health
    from inspector.analysis.stats import Histogram, TensorStats, histogram, stats
    from inspector.checkpoint import Checkpoint
    from inspector.exporting.run import ExportResult, export
    from inspector.ui.widgets import Inspector

    fp8: ModuleType

__all__ = [
    "AuditReport",
    "Checkpoint",
    "CheckpointFileMissingError",
    "CorruptCheckpointError",
    "ExportError",
    "ExportResult",
    "Fingerprint",
    "HealthReport",
    "Histogram",
    "Inspector",
    "InspectorError",
    "KeyReport",
    "MissingKeyError",
    "NotACheckpointError",
    "StorageAccessError",
    "TensorStats",
    "UnfinishedSaveError",
    "UnsafeCheckpointError",
    "UnsupportedError",
    "UsageError",
    "__version__",
    "audit",
    "check_keys",
    "diff",
    "explain_error",
    "export",
    "fingerprint",
    "fp8",
    "health",
    "histogram",
    "open",
    "stats",
]


def open(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> Checkpoint:
    """Open a checkpoint (DCP folder, .pt/.pth/.bin, .safetensors, HF sharded folder or index)
    from a local path or an s3://, gs://, hf://, http(s):// URL; ``storage_options`` are the
    fsspec filesystem's (endpoint_url, key, secret, token, anon, ...), for URLs
    (``pip install checkpoint-inspector[remote]``)."""
    from inspector.checkpoint import open as open_checkpoint

    return open_checkpoint(path, storage_options)


# Public names, each loaded from its module on first use.
_LAZY = {
    "Checkpoint": "inspector.checkpoint",
    "check_keys": "inspector.analysis.fqn",
    "KeyReport": "inspector.analysis.fqn",
    "explain_error": "inspector.analysis.error_text",
    "diff": "inspector.analysis.diff",
    "audit": "inspector.analysis.audit",
    "AuditReport": "inspector.analysis.audit",
    "fingerprint": "inspector.analysis.fingerprint",
    "Fingerprint": "inspector.analysis.fingerprint",
    "health": "inspector.analysis.health",
    "HealthReport": "inspector.analysis.health",
    "stats": "inspector.analysis.stats",
    "histogram": "inspector.analysis.stats",
    "TensorStats": "inspector.analysis.stats",
    "Histogram": "inspector.analysis.stats",
    "export": "inspector.exporting.run",
    "ExportResult": "inspector.exporting.run",
    "Inspector": "inspector.ui.widgets",
}


def __getattr__(name: str) -> Any:
    """Load the public functions and classes on use (``inspector.fp8`` is the FP8 toolbox,
    :mod:`inspector.tensors`). Loading pauses the collector: a module's objects live on, and
    with torch loaded a full collection would rescan its heap (0.1-0.2 s) for nothing."""
    import importlib

    if name == "fp8":
        with _paused_gc():
            return importlib.import_module("inspector.tensors")
    if name in _LAZY:
        with _paused_gc():
            return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'inspector' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
