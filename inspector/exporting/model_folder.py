"""The model-folder exports behind ``inspector.export``: format="hf" (:mod:`.hf_folder`) and
format="dcp" (:mod:`.dcp_folder`), and the options they refuse (they write a whole model)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from inspector.errors import UsageError
from inspector.exporting import plan

if TYPE_CHECKING:
    from inspector.checkpoint import Checkpoint
    from inspector.exporting.run import ExportResult


def export_model_folder(
    ck: Checkpoint,
    out: Path,
    format: str,
    changed: dict[str, bool],
    *,
    naming: str | None,
    max_shard_size: int | str,
    workers: int = 1,
    distributed: bool = False,
    **kw: Any,
) -> ExportResult:
    """Export ``ck`` as ``format``; ``changed``: which tensor-export options the caller set."""
    if workers > 1 or distributed:
        raise UsageError(
            f"format={format!r} is written by one process (its plan needs the whole model's "
            "config and tied-weight check first); use workers with safetensors or pt"
        )
    names = [name for name, was_changed in changed.items() if was_changed]
    if names:
        raise UsageError(
            f"{', '.join(names)} do not apply to format={format!r}: it writes the whole model"
        )
    if format == "hf":
        from inspector.exporting.hf_folder import export_hf

        if naming is not None:
            raise UsageError("naming applies to format='dcp' (hf reads either generation)")
        return export_hf(ck, out, max_shard_size=max_shard_size, **kw)
    if format == "megatron":
        from inspector.exporting.megatron_folder import export_megatron

        if naming is not None or max_shard_size != plan.DEFAULT_SHARD_SIZE:
            raise UsageError("naming and max_shard_size do not apply to format='megatron'")
        return export_megatron(ck, out, **kw)
    from inspector.exporting.dcp_folder import export_dcp

    if max_shard_size != plan.DEFAULT_SHARD_SIZE:
        raise UsageError("max_shard_size applies to safetensors and hf, not dcp")
    return export_dcp(ck, out, naming=naming or "torchtitan", **kw)
