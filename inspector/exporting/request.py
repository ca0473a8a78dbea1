"""One export as a frozen record (:class:`ExportRequest`), checked once, before anything is
opened, read or written; and the table of the options the CLI and the app offer
(:data:`OPTIONS`: help text, choices, command-line flag), so both build the same record.

``inspector.export(ck, out, **options)`` builds the record; every writer takes it whole.
Each refusal names the option and, for a choice, the values it may take.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from inspector import dtypes
from inspector.errors import ExportError, UsageError
from inspector.exporting import plan
from inspector.exporting.base import Meter, Progress
from inspector.exporting.fp8 import FP8_MODES
from inspector.exporting.quantize import DEFAULT_SCHEME, SCHEME_HELP, SCHEMES
from inspector.keys.generations import GENERATIONS
from inspector.storage.remote import is_url

if TYPE_CHECKING:
    from inspector.checkpoint import Checkpoint

# The tensor-export options a model-folder export refuses, and their defaults.
TENSOR_OPTIONS = {
    "model_only": True,
    "flatten": True,
    "nested": False,
    "include": None,
    "exclude": None,
    "rename": None,
    "on_error": "fail",
}
MODEL_FOLDER_OPTIONS = ("arch", "naming", "hf_config", "hf_assets")
# Target file suffixes and the format each names (a folder target names none).
FILE_SUFFIXES = {".safetensors": "safetensors", ".pt": "pt", ".pth": "pt", ".bin": "pt"}


@dataclass(frozen=True)
class ExportRequest:
    """What to export, where and how (see :func:`inspector.export` for each option).

    ``dtype`` is held as a dtype name, ``include`` / ``exclude`` as tuples and a local
    ``target`` as an expanded Path (a URL stays a string); an invalid combination is
    refused when the record is made, so a writer never sees one.
    """

    source: Checkpoint | str | os.PathLike[str]
    target: str | os.PathLike[str]
    format: str = "auto"
    dtype: str | None = None
    fp8: str = "dequantize"
    fp8_scheme: str = DEFAULT_SCHEME
    model_only: bool = True
    flatten: bool = True
    nested: bool = False
    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] | None = None
    rename: plan.Rename = None
    arch: str | None = None
    naming: str | None = None
    hf_config: Mapping[str, Any] | str | os.PathLike[str] | None = None
    hf_assets: str | os.PathLike[str] | None = None
    max_shard_size: int | str = plan.DEFAULT_SHARD_SIZE
    overwrite: bool = False
    verify: bool = True
    on_error: str = "fail"
    progress: bool = True
    on_progress: Callable[[Progress], None] | None = None
    storage_options: Mapping[str, Any] | None = None
    target_options: Mapping[str, Any] | None = None
    workers: int = 1
    distributed: bool = False

    @classmethod
    def build(
        cls, source: Checkpoint | str | os.PathLike[str], target: str | os.PathLike[str],
        **options: Any,
    ) -> ExportRequest:
        """The record of ``inspector.export(source, target, **options)``; an option that does
        not exist is refused with the list of those that do."""
        known = [f.name for f in dataclasses.fields(cls)][2:]
        for name in options:
            if name not in known:
                raise UsageError(f"export has no option {name!r}; the options are "
                                 + ", ".join(known))
        return cls(source, target, **options)

    def __post_init__(self) -> None:
        target = self.target if is_url(self.target) else Path(self.target).expanduser()
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "format", _format_for(self.format, target))
        object.__setattr__(self, "dtype", dtypes.optional_name(self.dtype))
        object.__setattr__(self, "include", _tuple(self.include))
        object.__setattr__(self, "exclude", _tuple(self.exclude))
        self._check_values()
        if self.format in plan.MODEL_FOLDER_FORMATS:
            self._check_model_folder()
        else:
            self._check_tensor_file()

    def _check_values(self) -> None:
        plan.check_choice("format", self.format, plan.EXPORT_FORMATS)
        plan.check_choice("on_error", self.on_error, plan.ON_ERROR)
        plan.check_choice("fp8", self.fp8, FP8_MODES)
        plan.check_choice("fp8_scheme", self.fp8_scheme, SCHEMES)
        if self.fp8_scheme != DEFAULT_SCHEME and self.fp8 != "quantize":
            raise UsageError(f"fp8_scheme={self.fp8_scheme!r} applies to fp8='quantize', not "
                             f"fp8={self.fp8!r}", option=("fp8_scheme", "fp8_scheme"))
        for name in ("model_only", "flatten", "nested", "overwrite", "verify", "progress",
                     "distributed"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name} must be True or False, not {getattr(self, name)!r}")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise UsageError(f"workers must be at least 1, got {self.workers}",
                             option=("workers", "workers"))
        try:
            plan.parse_size(self.max_shard_size)
        except UsageError as exc:
            raise UsageError(f"max_shard_size: {exc.reason}",
                             option=("max_shard_size", "max_shard_size")) from None
        if self.is_remote and self.distributed:
            raise UsageError("a URL output is written by one process or by workers, not by "
                             "torchrun ranks yet; write to a shared folder, then upload")

    def _check_model_folder(self) -> None:
        if self.workers > 1 or self.distributed:
            raise UsageError(
                f"format={self.format!r} is written by one process (its plan needs the whole "
                "model's config and tied-weight check first); use workers with safetensors or pt"
            )
        changed = [k for k, default in TENSOR_OPTIONS.items() if getattr(self, k) != default]
        if changed:
            raise UsageError(f"{', '.join(changed)} do not apply to format={self.format!r}: "
                             "it writes the whole model")
        if self.format == "hf" and self.naming is not None:
            raise UsageError("naming applies to format='dcp' (hf reads either generation)")
        if self.format != "hf" and self.max_shard_size != plan.DEFAULT_SHARD_SIZE:
            raise UsageError(f"max_shard_size applies to safetensors and hf, not {self.format}")
        if self.format == "megatron" and self.naming is not None:
            raise UsageError("naming applies to format='dcp' (megatron writes Megatron's names)")
        if self.naming is not None:
            plan.check_choice("naming", self.naming, tuple(GENERATIONS))

    def _check_tensor_file(self) -> None:
        given = [k for k in MODEL_FOLDER_OPTIONS if getattr(self, k) is not None]
        if given:
            raise UsageError(f"{', '.join(given)} only apply to format='hf', 'dcp' or 'megatron'")
        if self.nested and (self.format != "pt" or self.rename is not None):
            raise ExportError("nested=True writes the stored nesting of a .pt; rename does not "
                              "apply")

    @property
    def is_remote(self) -> bool:
        """Whether the target is an s3://, gs:// or hf:// URL (written locally, then uploaded)."""
        return is_url(self.target)

    @property
    def out(self) -> Path:
        """The local target."""
        assert isinstance(self.target, Path), "a URL target is written through a local one"
        return self.target

    @property
    def shard_limit(self) -> int:
        return plan.parse_size(self.max_shard_size)

    def open(self) -> Checkpoint:
        from inspector.checkpoint import as_checkpoint

        return as_checkpoint(self.source, self.storage_options)

    def meter(self, total: int, phase: str = "write", shown: bool = True) -> Meter:
        """Progress of one phase: a bar (with ``progress``, where ``shown``) and the callback."""
        return Meter(total, self.progress and shown, self.on_progress, phase)

    def locally(self, ck: Checkpoint, local: Path) -> ExportRequest:
        """This export into the local folder a URL target is uploaded from."""
        return dataclasses.replace(self, source=ck, target=local, overwrite=True,
                                   storage_options=None, target_options=None)


def _format_for(given: str, target: str | os.PathLike[str]) -> str:
    """The format asked for; for "auto", the one the target's suffix names (``out.pt``),
    else safetensors. A target whose suffix names another format is refused."""
    suffix = PurePosixPath(str(target)).suffix.lower()
    named = FILE_SUFFIXES.get(suffix)
    if given == "auto":
        return named or plan.EXPORT_FORMATS[0]
    if named is not None and named != given:
        raise UsageError(
            f"the target {target} is a {suffix} file, which format={given!r} does not write: "
            f"leave the format out, or give a target that fits it"
        )
    return given


def _tuple(patterns: Iterable[str] | None) -> tuple[str, ...] | None:
    return None if patterns is None else tuple(patterns)


@dataclass(frozen=True)
class Option:
    """An export option as the command line and the app offer it: help text, choices and
    CLI flag, and the app's label. A flag with a ``flag_value`` takes no argument and sets
    the option to it. Each front end spells the option in messages its own way (the flag,
    the label), see :meth:`inspector.errors.InspectorError.worded`."""

    name: str
    help: str
    flag: str
    choices: tuple[str, ...] | None = None
    flag_value: Any = None
    metavar: str | None = None
    repeated: bool = False
    type: Callable[[str], Any] = str
    label: str = ""

    @property
    def shown(self) -> str:
        """The app's label (the name, in words, where none is given)."""
        return self.label or self.name.replace("_", " ")

    @property
    def default(self) -> Any:
        return next(f.default for f in dataclasses.fields(ExportRequest) if f.name == self.name)

    def argument(self) -> dict[str, Any]:
        """``add_argument``'s keywords for this option (it stores the option's value)."""
        keywords: dict[str, Any] = {"dest": self.name, "help": self.help, "default": self.default}
        if self.flag_value is not None:
            return keywords | {"action": "store_const", "const": self.flag_value}
        keywords |= {"type": self.type, "metavar": self.metavar, "choices": self.choices}
        return keywords | ({"action": "append"} if self.repeated else {})


OPTIONS: tuple[Option, ...] = (
    Option("format", "what to write (auto, the default: pt for a .pt/.pth/.bin target, else "
           "safetensors)", "--format", ("auto", *plan.EXPORT_FORMATS)),
    Option("arch", "hf, dcp: auto (default) or " + ", ".join(plan.ARCHITECTURE_NAMES), "--arch",
           label="architecture"),
    Option("hf_assets", "hf: tokenizer, config.json, ... to copy", "--hf-assets", metavar="DIR",
           label="HF assets"),
    Option("hf_config", "hf, dcp: the config.json to use", "--hf-config", metavar="FILE",
           label="HF config"),
    Option("naming", "dcp: torchtitan (0.3, default) or torchtitan-2025", "--naming",
           tuple(GENERATIONS)),
    Option("dtype", "cast floating tensors, e.g. bfloat16", "--dtype"),
    Option("fp8", "how FP8 tensors are written", "--fp8", FP8_MODES, label="FP8 handling"),
    Option("fp8_scheme", "with fp8 quantize: " + "; ".join(f"{k}: {v}" for k, v in
           SCHEME_HELP.items()), "--fp8-scheme", SCHEMES, label="FP8 scheme"),
    Option("max_shard_size", "e.g. 5GB (decimal), 500MiB", "--max-shard-size"),
    Option("flatten", "keep the 'model.' prefix", "--keep-prefix", flag_value=False,
           label="model. prefix"),
    Option("model_only", "not only the model", "--all-components", flag_value=False,
           label="model weights only"),
    Option("nested", "pt: keep the stored nesting", "--nested", flag_value=True),
    Option("include", "keys to keep", "--include", metavar="GLOB", repeated=True),
    Option("exclude", "keys to leave out", "--exclude", metavar="GLOB", repeated=True),
    Option("overwrite", "replace existing output", "--overwrite", flag_value=True,
           label="overwrite existing output"),
    Option("verify", "skip re-reading the output", "--no-verify", flag_value=False),
    Option("on_error", "leave damaged keys out", "--skip-unreadable", flag_value="skip"),
    Option("workers", "processes writing the export (same bytes as 1); under torchrun each "
           "rank writes its share", "--workers", metavar="N", type=int),
)
OPTION = {o.name: o for o in OPTIONS}
