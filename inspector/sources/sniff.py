"""What a file holds, judged by its first bytes (never by its name alone), and its reader."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from inspector.errors import CorruptCheckpointError, NotACheckpointError
from inspector.sources.archive import is_legacy_torch, is_tar, is_zip
from inspector.sources.safetensors_file import looks_like_safetensors

if TYPE_CHECKING:
    from inspector.sources.safetensors_file import SafetensorsSource
    from inspector.sources.torch_save import TorchSaveSource

_HEAD_BYTES = 512


def file_kind(path: Path) -> str | None:
    """``"safetensors"``, ``"torch-save"``, ``"json"`` (an index) or None (something else)."""
    with open(path, "rb") as f:
        head = f.read(_HEAD_BYTES)
    if looks_like_safetensors(head):
        return "safetensors"
    if is_zip(head) or is_tar(head) or is_legacy_torch(head):
        return "torch-save"
    if head.lstrip()[:1] == b"{":
        return "json"
    return None


def open_file(path: Path, name: str | None = None) -> SafetensorsSource | TorchSaveSource:
    """The reader for one checkpoint file (``name``: how to show it, relative to its folder)."""
    from inspector.sources.safetensors_file import SafetensorsSource
    from inspector.sources.torch_save import TorchSaveSource

    kind = file_kind(path)
    if kind == "safetensors":
        return SafetensorsSource(path, name)
    if kind == "torch-save":
        return TorchSaveSource(path, name)
    if path.stat().st_size == 0:
        raise CorruptCheckpointError("the file is empty (0 bytes)", file=path)
    if path.name.endswith(".safetensors"):
        return SafetensorsSource(path, name)  # named so: its header check says what is wrong
    raise NotACheckpointError(
        "neither a safetensors file nor a torch.save archive (judged by its content)", file=path
    )
