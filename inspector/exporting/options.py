"""Export settings as a form or command line holds them (names, text), and the export they run.

:class:`ExportForm` holds the shared export options (the table the CLI's flags come from)
and turns them into :func:`inspector.export` arguments, including a key rename taken from
the FQN doctor's best rewrite (:meth:`ExportForm.use_rewrite`).
``workers`` above 1 is passed on as ``export(workers=n)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from inspector import dtypes
from inspector.errors import InspectorError, UsageError
from inspector.exporting.base import ExportResult, Progress
from inspector.exporting.plan import MODEL_FOLDER_FORMATS
from inspector.exporting.request import (
    MODEL_FOLDER_OPTIONS,
    OPTION,
    TENSOR_OPTIONS,
    ExportRequest,
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


# The export options the app's form holds, and its defaults where they are not the API's.
FORM_OPTIONS = ("format", "dtype", "fp8", "fp8_scheme", "model_only", "flatten", "max_shard_size",
                "overwrite", "verify", "arch", "hf_assets", "hf_config", "workers")
FORM_DEFAULTS = {"format": "safetensors", "arch": "auto"}


def app_spelling(name: str) -> str:
    """How the app names an export option in a message: its form label."""
    return OPTION[name].shown if name in OPTION else name


class ExportForm:
    """What to export where, as the app's form holds it: ``values`` of the shared export
    options (:data:`FORM_OPTIONS`, defaults from :class:`ExportRequest`), the rename the
    FQN doctor chose and fsspec ``target_options`` for a URL ``out``.

    ``out`` is a folder (safetensors: ``model.safetensors`` or shards + index inside it; pt:
    ``model.pt`` inside it; hf: the model folder) or a file name with the format's suffix.
    """

    def __init__(self, out: str, target_options: dict[str, Any] | None = None,
                 **values: Any) -> None:
        unknown = [name for name in values if name not in FORM_OPTIONS]
        if unknown:
            raise UsageError(f"the export form has no {', '.join(unknown)}")
        defaults = {name: OPTION[name].default for name in FORM_OPTIONS} | FORM_DEFAULTS
        self.out = out
        self.values = defaults | values
        self.target_options = target_options
        self.rename: dict[str, str] | None = None
        self.rename_source: str | None = None

    def __getattr__(self, name: str) -> Any:
        """An option's value, read as an attribute (``form.dtype``)."""
        if name in FORM_OPTIONS:
            return self.__dict__["values"][name]
        raise AttributeError(name)

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
        """Keyword arguments of :func:`inspector.export` (besides the checkpoint and target):
        the options that apply to the format, checked by the export's own record, each
        refusal naming the option as the form labels it."""
        if not str(self.out).strip():
            raise InspectorError("no output folder given")
        folder = self.format in MODEL_FOLDER_FORMATS
        left_out = TENSOR_OPTIONS if folder else MODEL_FOLDER_OPTIONS
        arguments = {k: v for k, v in self.values.items() if k not in left_out}
        arguments["dtype"] = dtypes.optional_name(arguments["dtype"] or None)
        if folder:
            for name in ("hf_assets", "hf_config"):
                arguments[name] = (arguments[name] or "").strip() or None
        else:
            arguments["rename"] = self.rename
        if folder or arguments["workers"] == 1:  # an HF or DCP folder: one process writes it
            del arguments["workers"]
        try:  # the source is opened by the export, not here
            ExportRequest.build("", self.target(), **arguments)
        except UsageError as exc:
            raise UsageError(exc.worded(app_spelling)) from None
        return arguments

    def run(
        self, ck: Checkpoint, on_progress: Callable[[Progress], None] | None = None
    ) -> ExportResult:
        """Export ``ck`` with these settings (no progress bar; ``on_progress`` is called)."""
        return export(ck, self.target(), **self.arguments(), progress=False,
                      on_progress=on_progress, target_options=self.target_options)

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
        return True, hf.auto_reason(ModelWeights(ck, mode, None).metas(), ck.run_args)
    except InspectorError as exc:
        return False, exc.reason
