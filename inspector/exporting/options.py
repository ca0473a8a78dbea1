"""Export settings as a form or command line holds them (names, text), and the export they run.

:class:`ExportOptions` turns them into :func:`inspector.export` arguments, including a
key rename taken from the FQN doctor's best rewrite (:meth:`ExportOptions.use_rewrite`).
``workers`` above 1 is passed on as ``export(workers=n)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from inspector import dtypes
from inspector.errors import InspectorError
from inspector.exporting.base import ExportResult, Progress
from inspector.exporting.fp8 import FP8_MODES
from inspector.exporting.plan import (
    DEFAULT_SHARD_SIZE,
    EXPORT_FORMATS,
    MODEL_FOLDER_FORMATS,
    check_choice,
    parse_size,
)
from inspector.exporting.run import export
from inspector.keys.spellings import view_key
from inspector.storage.remote import is_url

if TYPE_CHECKING:
    from inspector.analysis.fqn import KeyReport
    from inspector.checkpoint import Checkpoint

PT_SUFFIXES = (".pt", ".pth", ".bin")
PT_FILE = "model.pt"


def default_out(ck: Checkpoint, folder: str | os.PathLike = "exports") -> Path:
    """``exports/<checkpoint name>``: a fresh folder beside the notebook, not in the source
    (for a remote checkpoint too: named after the URL's last part)."""
    if not ck.is_local:
        return Path(folder) / PurePosixPath(ck.location.rstrip("/").rsplit("/", 1)[-1]).stem
    return Path(folder) / (ck.path.stem if ck.path.is_file() else ck.path.name)


@dataclass
class ExportOptions:
    """What to export where; ``dtype`` None keeps stored dtypes, ``rename`` maps stored keys.

    ``out`` is a folder (safetensors: ``model.safetensors`` or shards + index inside it; pt:
    ``model.pt`` inside it; hf: the model folder) or a file name with the format's suffix.
    ``arch`` and ``hf_assets`` are for the hf format, which writes the whole model under
    its HF names (``model_only``, ``flatten`` and ``rename`` do not apply to it).
    ``target_options``: fsspec options for a URL ``out`` (default: the checkpoint's own).
    """

    out: str
    format: str = "safetensors"
    dtype: str | None = None
    fp8: str = "dequantize"
    model_only: bool = True
    flatten: bool = True
    max_shard_size: str = DEFAULT_SHARD_SIZE
    overwrite: bool = False
    verify: bool = True
    rename: dict[str, str] | None = None
    rename_source: str | None = None
    arch: str = "auto"
    hf_assets: str | None = None
    hf_config: str | None = None
    workers: int = 1
    target_options: dict[str, Any] | None = None

    def target(self) -> Path | str:
        """What the exporter is handed: a .pt file for pt, the folder (or file) otherwise;
        a URL (s3://, gs://, hf://) stays a URL."""
        if is_url(self.out.strip()):
            url = self.out.strip().rstrip("/")
            pt_file = PurePosixPath(url).suffix in PT_SUFFIXES
            return f"{url}/{PT_FILE}" if self.format == "pt" and not pt_file else url
        out = Path(self.out).expanduser()
        if self.format == "pt" and out.suffix not in PT_SUFFIXES:
            return out / PT_FILE
        return out

    def arguments(self) -> dict[str, Any]:
        """Keyword arguments of :func:`inspector.export` (besides the checkpoint and target)."""
        if not str(self.out).strip():
            raise InspectorError("no output folder given")
        check_choice("format", self.format, EXPORT_FORMATS)
        check_choice("FP8 handling", self.fp8, FP8_MODES)
        try:
            parse_size(self.max_shard_size)
        except InspectorError as exc:
            raise InspectorError(f"max shard size: {exc.reason}") from None
        common = {
            "format": self.format,
            "dtype": dtypes.optional_name(self.dtype or None),
            "fp8": self.fp8,
            "max_shard_size": self.max_shard_size,
            "overwrite": self.overwrite,
            "verify": self.verify,
        } | self._workers()
        if self.format == "hf":
            return common | {
                "arch": self.arch,
                "hf_assets": (self.hf_assets or "").strip() or None,
                "hf_config": (self.hf_config or "").strip() or None,
            }
        return common | {
            "model_only": self.model_only,
            "flatten": self.flatten,
            "rename": self.rename,
        }

    def _workers(self) -> dict[str, int]:
        """``{"workers": n}`` for more than one worker; nothing for one (the default) nor for
        an HF or DCP folder (written by one process)."""
        if self.workers < 1:
            raise InspectorError(f"workers must be at least 1, not {self.workers}")
        parallel = self.workers > 1 and self.format not in MODEL_FOLDER_FORMATS
        return {"workers": self.workers} if parallel else {}

    def run(
        self, ck: Checkpoint, on_progress: Callable[[Progress], None] | None = None
    ) -> ExportResult:
        """Export ``ck`` with these settings (no progress bar; ``on_progress`` is called)."""
        arguments = self.arguments()
        return export(
            ck,
            self.target(),
            **arguments,
            progress=False,
            on_progress=on_progress,
            target_options=self.target_options,
        )

    def use_rewrite(self, ck: Checkpoint, report: KeyReport) -> None:
        """Rename model keys as the report's best rewrite does (see :func:`rewrite_rename`)."""
        best = report.best
        if best is None:
            why = "the keys already match" if report.ok else "no rewrite explains the difference"
            raise InspectorError(f"the FQN check has no rewrite to apply: {why}")
        self.rename = rewrite_rename(ck, report)
        changed = sum(k != v for k, v in report.mapping().items())
        self.rename_source = f"{best.description} ({changed} keys renamed)"

    def clear_rename(self) -> None:
        self.rename = self.rename_source = None


def rewrite_rename(ck: Checkpoint, report: KeyReport) -> dict[str, str]:
    """Stored key -> model key after the report's best rewrite, for every model entry of ``ck``.

    ``report.mapping()`` is keyed by the report's spelling; keyed by stored keys the rename
    means the same whether the export flattens the ``model.`` prefix or keeps it.
    """
    mapping = report.mapping()
    renamed = {}
    for entry in ck.entries():
        spelled = view_key(entry, report.spelling) if entry.component == "model" else None
        if spelled in mapping:
            renamed[entry.key] = mapping[spelled]
    if not renamed:
        raise InspectorError(
            f"the FQN check was about {report.checkpoint}, not this checkpoint", file=ck.location
        )
    return renamed


def arch_auto(ck: Checkpoint, fp8: str = "dequantize") -> tuple[bool, str]:
    """What ``arch="auto"`` decides for an hf export of ``ck`` and why, or (False, why no
    architecture is decided): the exporter's own detection, before anything is written."""
    from inspector.exporting import hf
    from inspector.exporting.model_weights import ADAPTED_FP8_MODES, ModelWeights

    mode = fp8 if fp8 in ADAPTED_FP8_MODES else ADAPTED_FP8_MODES[0]
    try:
        found = hf.detect(ModelWeights(ck, mode, None).metas())
    except InspectorError as exc:
        return False, exc.reason
    return True, found.reason + (": names kept" if found.naming == "hf" else "")
