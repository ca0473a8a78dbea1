"""Export: settings, an Export button, a progress bar fed by a worker thread, the result."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ipywidgets as w

from inspector.analysis.fqn import KeyReport
from inspector.checkpoint import Checkpoint
from inspector.exporting.base import ExportResult, Progress
from inspector.exporting.fp8 import FP8_MODE_HELP
from inspector.exporting.hf import ARCHITECTURES
from inspector.exporting.options import (
    FORM_OPTIONS,
    ExportForm,
    app_spelling,
    arch_auto,
    default_out,
)
from inspector.exporting.plan import CAST_DTYPES, suggested_workers
from inspector.exporting.quantize import SCHEME_HELP
from inspector.exporting.request import OPTION
from inspector.ui.views.text import human_bytes
from inspector.ui.widgets.errors import ErrorBox, error_html
from inspector.ui.widgets.markup import badge, esc, heading, note, pre, table

# Progress messages at most this often (seconds), so a many-tensor export does not flood.
UPDATE_EVERY = 0.1
_WIDE = {"description_width": "120px"}
FORMATS = ((".safetensors", "safetensors"), (".pt", "pt"), ("Hugging Face folder", "hf"))


@dataclass(frozen=True)
class Preset:
    """A button that fills the form's fields for one common export (``fields``: field name
    -> value); ``quantized_only``: offered only when the checkpoint holds quantized or FP8
    weights."""

    label: str
    help: str
    fields: dict[str, Any]
    quantized_only: bool = False


PRESETS = {
    "dequantize": Preset(
        "Dequantize",
        "quantized and FP8 weights as plain tensors (bfloat16 unless a dtype is chosen), "
        "in one .safetensors file",
        {"format": "safetensors", "fp8": "dequantize", "dtype": "", "model_only": True},
        quantized_only=True,
    ),
    "serve_fp8": Preset(
        "FP8 for serving",
        "a Hugging Face folder whose linear weights are FP8 e4m3 with per-channel scales "
        "(compressed-tensors, as vLLM loads it)",
        {"format": "hf", "fp8": "quantize", "dtype": ""},
    ),
}


def labelled(name: str, **style: Any) -> dict[str, Any]:
    """A form field's description and tooltip, from the shared table of export options."""
    label = app_spelling(name)
    return {"description": label[0].upper() + label[1:], "tooltip": OPTION[name].help} | style


def result_html(result: ExportResult) -> str:
    """The verdict, the files written with their sizes, and the exporter's own summary."""
    check = result.verification
    if check is None:
        verdict = badge("written, not verified", "warn")
    else:
        verdict = badge("ok", "ok") if check.ok else badge("failed", "bad")  # check says what
    files = [*result.files, *([result.index] if result.index else [])]
    rows = [
        (str(p), human_bytes(Path(p).stat().st_size) if isinstance(p, Path) else "") for p in files
    ]
    return (
        f"<div>{verdict} {esc(check) if check is not None else ''}</div>"
        + table(("file", "size"), rows)
        + heading("summary")
        + pre(result.summary())
    )


class ExportPanel(w.VBox):
    """Export settings; the export runs in a thread so the notebook stays responsive."""

    def __init__(
        self,
        ck: Checkpoint,
        errors: ErrorBox,
        tensor_bytes: int,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        """``tensor_bytes``: the checkpoint's tensors' size (the header has counted it)."""
        self.ck = ck
        self.errors = errors
        self.options = ExportForm(
            str(default_out(ck)),
            dict(storage_options) if storage_options else None,
            workers=suggested_workers(tensor_bytes),
        )
        self.thread: threading.Thread | None = None
        self.finished: list[Callable[[], None]] = []  # run after each export, as JobBar's
        self.result: ExportResult | None = None
        self.format = w.ToggleButtons(
            options=FORMATS, **labelled("format", style=_WIDE | {"button_width": "160px"})
        )
        self.hf_assets = w.Text(
            **labelled("hf_assets"),
            placeholder="folder with config.json and tokenizer files (optional)",
            layout=w.Layout(width="560px"),
            style=_WIDE,
        )
        self.hf_config = w.Text(
            **labelled("hf_config"),
            placeholder="config.json to use instead of the assets' (optional)",
            layout=w.Layout(width="560px"),
            style=_WIDE,
        )
        self.arch = w.Dropdown(
            options=[("auto (from the key names)", "auto"), *((a, a) for a in ARCHITECTURES)],
            **labelled("arch"),
            layout=w.Layout(width="420px"),
            style=_WIDE,
        )
        self.arch_note = w.HTML()
        self.arch_note.add_class("inspector-arch")
        self.workers = w.BoundedIntText(
            value=self.options.values["workers"],
            min=1,
            max=256,
            **labelled("workers"),
            style=_WIDE,
        )
        self.preset = w.HTML()
        self.preset.add_class("inspector-export-preset")
        self.preset_buttons = {}
        for name, preset in PRESETS.items():
            button = w.Button(description=preset.label, tooltip=preset.help)
            button.add_class(f"inspector-preset-{name}")
            button.on_click(errors.guard("Choosing a preset")(lambda _, n=name: self.use(n)))
            self.preset_buttons[name] = button
        self.dtype = w.Dropdown(
            options=[("as stored", ""), *((d, d) for d in CAST_DTYPES)],  # None shows blank
            **labelled("dtype"),
            style=_WIDE,
        )
        self.fp8 = w.Dropdown(
            options=[(f"{m}: {FP8_MODE_HELP[m]}", m) for m in OPTION["fp8"].choices or ()],
            **labelled("fp8"),
            layout=w.Layout(width="560px"),
            style=_WIDE,
        )
        self.fp8_scheme = w.Dropdown(
            options=[(f"{s}: {SCHEME_HELP[s]}", s) for s in OPTION["fp8_scheme"].choices or ()],
            value=OPTION["fp8_scheme"].default,
            **labelled("fp8_scheme"),
            layout=w.Layout(width="560px"),
            style=_WIDE,
        )
        self.model_only = w.Checkbox(value=True, **labelled("model_only"))
        self.flatten = w.ToggleButtons(
            options=[("flatten", True), ("keep prefix", False)],
            **labelled("flatten"),
            style=_WIDE,
        )
        self.max_shard_size = w.Text(
            value=OPTION["max_shard_size"].default, **labelled("max_shard_size"), style=_WIDE
        )
        self.out = w.Text(
            value=self.options.out,
            description="Output",
            placeholder="a folder, a file, or a URL (s3://, gs://, hf://)",
            layout=w.Layout(width="560px"),
            style=_WIDE,
        )
        self.overwrite = w.Checkbox(value=False, **labelled("overwrite"))
        self.rename = w.HTML()
        self.clear_rename_button = w.Button(description="Clear rename", icon="times")
        self.export_button = w.Button(description="Export", button_style="success", icon="download")
        self.progress = w.FloatProgress(value=0.0, min=0.0, max=1.0, description="Progress")
        self.status = w.Label()
        self.outcome = w.HTML()
        self.outcome.add_class("inspector-export-result")
        self.out.add_class("inspector-export-out")
        self.export_button.add_class("inspector-export")
        self.clear_rename_button.on_click(errors.guard("Clearing the rename")(self._clear_rename))
        self.export_button.on_click(errors.guard("Starting the export")(lambda _: self.start()))
        self.format.observe(lambda _: self._show_format_fields(), names="value")
        self.arch.observe(lambda _: self._show_format_fields(), names="value")
        self.fp8.observe(lambda _: self._show_scheme(), names="value")
        self._arch_auto: tuple[bool, str] | None = None
        self._show_rename()
        self._show_format_fields()
        self.show_fp8(False)  # until the header's scan finds FP8 tensors
        super().__init__(
            [
                w.HBox([w.Label("Presets"), *self.preset_buttons.values()]),
                self.preset,
                self.format,
                self.arch,
                self.arch_note,
                self.hf_assets,
                self.hf_config,
                self.dtype,
                self.fp8,
                self.fp8_scheme,
                self.flatten,
                self.model_only,
                self.max_shard_size,
                self.workers,
                self.out,
                self.overwrite,
                w.HBox([self.rename, self.clear_rename_button]),
                w.HBox([self.export_button, self.progress, self.status]),
                self.outcome,
            ]
        )
        self._last_update = 0.0

    # --- settings ---------------------------------------------------------------------------
    def use_rewrite(self, report: KeyReport) -> None:
        """Rename keys on export as the FQN check's best rewrite does."""
        self.options.use_rewrite(self.ck, report)
        self._show_rename()

    def show_fp8(self, found: bool) -> None:
        """The FP8 handling field and the Dequantize preset, shown only for a checkpoint with
        FP8 or quantized tensors (the header's scan says whether it has)."""
        self.fp8.layout.display = "" if found else "none"
        self._show_scheme()
        for name, preset in PRESETS.items():
            if preset.quantized_only:
                self.preset_buttons[name].layout.display = "" if found else "none"

    def use(self, name: str) -> None:
        """Fill the form as the preset ``name`` (a key of ``PRESETS``) says."""
        preset = PRESETS[name]
        for field, value in preset.fields.items():
            getattr(self, field).value = value
        self.fp8.layout.display = ""  # the FP8 handling it chose is in sight
        self._show_scheme()
        self.preset.value = (
            f'<div style="margin-bottom:6px">{badge("preset", "info")} '
            f"<b>{esc(preset.label)}</b>: {esc(preset.help)}. Choose the output and press "
            "Export.</div>"
        )

    def preset_fp8(self, mode: str, why: str) -> None:
        """Plain safetensors of the model with ``mode`` FP8 handling (the header's finding)."""
        self.format.value = "safetensors"
        self.fp8.value = mode
        self.show_fp8(True)
        self.model_only.value = True
        self.preset.value = (
            f'<div style="margin-bottom:6px">{badge("preset", "info")} {esc(why)} '
            f"FP8: <b>{esc(mode)}</b> ({esc(FP8_MODE_HELP[mode])}). Choose the output and "
            "press Export.</div>"
        )

    def _show_scheme(self) -> None:
        """The FP8 scheme field, only while the FP8 handling in sight quantizes."""
        quantize = self.fp8.layout.display != "none" and self.fp8.value == "quantize"
        self.fp8_scheme.layout.display = "" if quantize else "none"

    def _clear_rename(self, _button: object) -> None:
        self.options.clear_rename()
        self._show_rename()

    def _show_rename(self) -> None:
        source = self.options.rename_source
        text = f"<b>Rename:</b> {esc(source)}" if source else "<b>Rename:</b> none"
        self.rename.value = text
        self.clear_rename_button.layout.display = "" if source else "none"

    def _show_format_fields(self) -> None:
        """The assets folder for an HF folder; the key options only where they apply."""
        hf = self.format.value == "hf"
        for field in (self.hf_assets, self.hf_config, self.arch, self.arch_note):
            field.layout.display = "" if hf else "none"
        for field in (self.flatten, self.model_only):
            field.layout.display = "none" if hf else ""
        if hf and self.arch.value == "auto":
            if self._arch_auto is None:
                self._arch_auto = arch_auto(self.ck, self.fp8.value)
            ok, why = self._arch_auto
            verdict = badge("arch auto", "ok") if ok else badge("no arch", "bad")
            self.arch_note.value = f'<div class="inspector-note">{verdict} {esc(why)}</div>'
        else:
            self.arch_note.value = ""

    def _read_form(self) -> ExportForm:
        """The form's fields into the options of the same names (each field is the option's
        widget, named as the option is)."""
        options = self.options
        options.values |= {
            name: getattr(self, name).value for name in FORM_OPTIONS if name != "verify"
        }
        options.values["dtype"] = options.values["dtype"] or None  # "as stored" is ""
        if self.fp8_scheme.layout.display == "none":  # a scheme chosen, then not quantizing
            options.values["fp8_scheme"] = OPTION["fp8_scheme"].default
        options.out = self.out.value
        options.arguments()
        return options

    # --- running ----------------------------------------------------------------------------
    def start(self) -> None:
        """Check the settings here, then export in a worker thread."""
        if self.thread is not None and self.thread.is_alive():
            return
        options = copy.copy(self._read_form())  # the thread's own copy: the form may change
        options.values = dict(options.values)
        self.result = None
        self.export_button.disabled = True
        self.progress.value, self.progress.bar_style = 0.0, ""
        self.status.value = "starting ..."
        self.outcome.value = note(f"exporting to {options.target()} ...")
        self.thread = threading.Thread(target=self._run, args=(options,), daemon=True)
        self.thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Block until a running export has finished (for scripts and tests)."""
        if self.thread is not None:
            self.thread.join(timeout)

    def _run(self, options: ExportForm) -> None:
        try:
            self.result = options.run(self.ck, self._on_progress)
        except Exception as exc:
            self.progress.bar_style = "danger"
            self.status.value = "failed"
            self.outcome.value = error_html("The export", exc)
            self.errors.show("The export", exc)
        else:
            ok = self.result.verification is None or self.result.verification.ok
            self.progress.value, self.progress.bar_style = 1.0, "success" if ok else "danger"
            self.status.value = "done"
            self.outcome.value = result_html(self.result)
        finally:
            self.export_button.disabled = False
            for callback in self.finished:
                callback()

    def _on_progress(self, step: Progress) -> None:
        now = time.monotonic()
        if step.done < step.total and now - self._last_update < UPDATE_EVERY:
            return
        self._last_update = now
        self.progress.value = step.done / step.total if step.total else 1.0
        self.progress.bar_style = "info" if step.phase == "verify" else ""
        self.status.value = (
            f"{step.phase}: {human_bytes(step.done)} of {human_bytes(step.total)} ({step.key})"
        )
