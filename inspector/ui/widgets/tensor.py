"""Tensor: the selected key's dtype, global shape, chunks and subclass facts; Stats on demand
in a worker thread (progress bar, Cancel), with its histogram and per-layer norms as images."""

from __future__ import annotations

import ipywidgets as w

from inspector.checkpoint import Checkpoint
from inspector.entry import Entry
from inspector.keys.tree import KeyNode
from inspector.ui.views.numbers import TensorNumbers, tensor_numbers
from inspector.ui.views.text import human_bytes, shape_text, value_text
from inspector.ui.widgets.errors import ErrorBox
from inspector.ui.widgets.jobs import JobBar
from inspector.ui.widgets.keylist import CopyButton
from inspector.ui.widgets.markup import facts, heading, limited, note, pre, table, totals_table
from inspector.words import counted

CHUNKS_SHOWN = 32
VALUE_CHARS = 4000


class TensorPanel(w.VBox):
    """Details of the selected node: an entry's facts, or a subtree's totals per dtype."""

    def __init__(self, ck: Checkpoint, errors: ErrorBox) -> None:
        self.ck = ck
        self.entry: Entry | None = None
        self.details = w.HTML()
        self.stats_button = w.Button(description="Stats", icon="bar-chart", disabled=True)
        self.value_button = w.Button(description="Value", icon="eye", disabled=True)
        self.copy_button = CopyButton()
        self.stats = w.HTML()
        self.histogram = w.Image(format="png", layout=w.Layout(display="none", width="432px"))
        self.norms = w.Image(format="png", layout=w.Layout(display="none", width="432px"))
        self.numbers: TensorNumbers | None = None
        self.stats_token: object | None = None
        self.job = JobBar(errors, "Stats")
        self.details.add_class("inspector-tensor")
        self.stats.add_class("inspector-stats")
        self.histogram.add_class("inspector-histogram")
        self.norms.add_class("inspector-norms")
        self.stats_button.on_click(errors.guard("Stats")(lambda _: self.show_stats()))
        self.value_button.on_click(errors.guard("Reading the value")(lambda _: self.show_value()))
        buttons = w.HBox([self.stats_button, self.value_button, self.copy_button])
        super().__init__([self.details, buttons, self.job, self.stats, self.histogram, self.norms])

    def show(self, node: KeyNode) -> None:
        """An entry's details when the node holds one, else the subtree's totals."""
        self.job.cancel()
        self.stats_token = None
        self.job.layout.display = "none"
        self.stats.value = ""
        self.numbers = None
        self.histogram.layout.display = self.norms.layout.display = "none"
        self.entry = node.entry
        self.copy_button.text = node.prefix if node.depth else ""
        if self.entry is None:
            self.stats_button.disabled = self.value_button.disabled = True
            self.details.value = _subtree(node)
            return
        tensor = self.entry.kind == "tensor"
        if tensor:
            self.ck.detection(self.entry.key)
        broken = bool(self.ck.facts(self.entry.key).error)
        self.stats_button.disabled = not tensor or broken
        self.value_button.disabled = tensor or broken
        self.details.value = self._describe(self.entry, node.prefix)

    def _describe(self, entry: Entry, spelled: str) -> str:
        parts = [
            heading(spelled),
            facts(
                [
                    ("stored key", entry.key if entry.key != spelled else None),
                    ("component", entry.component),
                    ("kind", entry.kind),
                    ("dtype", entry.dtype),
                    ("global shape", shape_text(entry)),
                    ("elements", f"{entry.numel:,}" if entry.kind == "tensor" else None),
                    ("size", human_bytes(entry.nbytes)),
                    ("files", ", ".join(entry.files)),
                    ("unreadable", self.ck.facts(entry.key).error),
                ]
            ),
        ]
        if entry.kind == "tensor":
            found = self.ck.detection(entry.key)
            parts.append(heading("subclass and FP8"))
            parts.append(
                facts(
                    [
                        ("holds", found.kind),
                        ("subclass", found.subclass),
                        ("fp8", found.fp8),
                        ("payload", found.payload),
                        ("scale parts", ", ".join(found.parts) or None),
                        ("classes", ", ".join(found.classes) or None),
                        ("error", found.error),
                    ]
                )
            )
            parts.append(heading(f"chunks ({len(entry.chunks)})"))
            rows = [
                (list(c.offsets), list(c.sizes), c.file, c.byte_offset, c.byte_length)
                for c in entry.chunks
            ]
            header = ("offsets", "sizes", "file", "byte offset", "bytes")
            parts.append(limited(header, rows, CHUNKS_SHOWN))
        return "".join(parts)

    def show_stats(self) -> None:
        """Read this one tensor in a worker thread: its numbers as soon as they exist, then
        its histogram, then the norm of the same parameter in every layer."""
        if self.entry is None:
            return
        key = self.entry.key
        self.stats.value = note(f"reading {key} ...")
        token = self.stats_token = object()
        self.job.run(
            lambda report, cancel: tensor_numbers(
                self.ck, key, report, cancel, on_part=lambda part: self._part(token, part)
            ),
            lambda numbers: self._part(token, numbers),
        )

    def wait(self, timeout: float | None = None) -> None:
        """Block until Stats has finished (for scripts and tests)."""
        self.job.wait(timeout)

    def _part(self, token: object, numbers: TensorNumbers) -> None:
        """Show what a Stats job has so far, unless a newer job or key replaced it."""
        if token is not self.stats_token:
            return
        shown = self.numbers
        self.numbers = numbers
        if shown is None or shown.stats is not numbers.stats:
            self.stats.value = heading("statistics") + table(("", "value"), numbers.rows())
        if numbers.histogram is not None and (shown is None or shown.histogram is None):
            self.histogram.value = numbers.histogram_png() or b""
            self.histogram.layout.display = ""
        norms = numbers.norms_png() if numbers.norms is not None else None
        if norms is not None and (shown is None or shown.norms is not numbers.norms):
            self.norms.value = norms
            self.norms.layout.display = ""

    def show_value(self) -> None:
        if self.entry is None:
            return
        text = value_text(self.ck.read_object(self.entry.key))
        cut = (
            f"\n... ({len(text) - VALUE_CHARS:,} more characters)"
            if len(text) > VALUE_CHARS
            else ""
        )
        self.stats.value = heading("value") + pre(text[:VALUE_CHARS] + cut)


def _subtree(node: KeyNode) -> str:
    """A node's totals per dtype (the root's are in the header already)."""
    if not node.depth:
        return note("Select a key in the tree for its chunks, subclass and statistics.")
    return (
        heading(node.prefix)
        + f"<div>{counted(node.count, 'key')}, {human_bytes(node.nbytes)}</div>"
        + totals_table("dtype", node.by_dtype)
        + note(f"Select a key below {node.prefix} for its chunks, subclass and statistics.")
    )
