"""What matters about a checkpoint before the first click: FP8 and subclass tensors and what
torch's own tools do with them, the layout with its consequence and the rewrite that fixes
it, the audit's verdict, the producer and step, where it is and what was read.

:func:`at_once` needs metadata only (the app's first view); :func:`find` adds what needs a
scan of the model tensors' chunk records, the FQN doctor and a quick audit, and runs in a
worker thread (:mod:`.jobs`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from inspector.analysis.audit import AuditReport, audit
from inspector.analysis.findings import SEVERITIES
from inspector.analysis.fqn import KeyReport, check_keys
from inspector.checkpoint import Checkpoint
from inspector.errors import InspectorError
from inspector.exporting.fp8 import FP8_MODE_HELP
from inspector.formats.producers import LayoutNote
from inspector.keys.spellings import (
    WRAPPER_ORIGINS,
    WRAPPER_PREFIXES,
    has_segment,
    model_fqn,
    strip_segments,
)
from inspector.keys.training import is_train_step
from inspector.progress import check
from inspector.tensors.detection import Detection
from inspector.ui.views.text import human_bytes

TONES = ("ok", "info", "warn", "bad")


@dataclass(frozen=True)
class Finding:
    """One line of the header: a ``tone`` (ok / info / warn / bad), what was found, what it
    means, and what fixes it (None when nothing needs fixing)."""

    topic: str
    tone: str
    title: str
    consequence: str = ""
    fix: str | None = None


# --- FP8 ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fp8Facts:
    """FP8 and other subclass tensors among the scanned keys: class -> count per kind
    (``wrappers``: high-precision weights wrapped for FP8 training; ``payloads``: quantized
    data with scales; ``unknown``: other subclasses), plain float8 weights paired with a
    scale entry (``scaled``), and the keys of all of them."""

    scanned: int
    wrappers: Counter[str] = field(default_factory=Counter)
    payloads: Counter[str] = field(default_factory=Counter)
    unknown: Counter[str] = field(default_factory=Counter)
    scaled: int = 0
    keys: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return sum(self.wrappers.values()) + sum(self.payloads.values()) + self.scaled

    @property
    def mode(self) -> str:
        """The export's FP8 handling that makes them plain tensors: ``unwrap`` when there
        are only training wrappers (their master weights, as stored), else ``dequantize``."""
        return "unwrap" if not (self.payloads or self.scaled) else "dequantize"

    def finding(self) -> Finding:
        if not self.count and not self.unknown:
            return Finding("fp8", "ok", f"no FP8 or subclass tensors in {self.scanned:,} scanned")
        parts = [
            *(f"{n} {cls} (FP8 training wrapper)" for cls, n in self.wrappers.most_common()),
            *(f"{n} {cls} (quantized payload)" for cls, n in self.payloads.most_common()),
            *([f"{self.scaled} plain float8 weights with scales"] if self.scaled else []),
            *(f"{n} {cls} (unknown subclass)" for cls, n in self.unknown.most_common()),
        ]
        classes = [*self.wrappers, *self.payloads, *self.unknown]
        consequence = []
        if classes:
            consequence.append(
                f"Their chunks pickle {', '.join(classes)}: torch's own readers "
                "(dcp_to_torch_save, torch.load) unpickle the class, so they fail unless "
                "torchao is installed and imported first."
            )
        if self.scaled:
            consequence.append(
                "Plain float8 weights load as raw float8 with their scales beside them: a "
                "high-precision model needs them dequantized."
            )
        fix = None
        if self.count:
            fix = f"Export with fp8={self.mode!r}: {FP8_MODE_HELP[self.mode]}; plain tensors, "
            fix += "no torchao needed to load them."
        tone = "warn" if self.count else "bad"
        return Finding("fp8", tone, "; ".join(parts), " ".join(consequence), fix)


def fp8_facts(ck: Checkpoint, keys: list[str]) -> Fp8Facts:
    """Sort the detections of ``keys`` (scanned already) and the checkpoint's scale pairs."""
    kinds: dict[str, Counter[str]] = {k: Counter() for k in ("wrapper", "payload", "unknown")}
    flagged = []
    for key in keys:
        detection = ck.detection(key)
        kind = subclass_kind(detection)
        if kind is not None:
            kinds[kind][_outer(detection.subclass)] += 1
            flagged.append(key)
    pairs = ck.scale_pairs.by_weight
    return Fp8Facts(
        len(keys),
        kinds["wrapper"],
        kinds["payload"],
        kinds["unknown"],
        len(pairs),
        tuple(dict.fromkeys([*flagged, *pairs])),
    )


def subclass_kind(detection: Detection) -> str | None:
    """``wrapper`` (FP8 training), ``payload`` (quantized), ``unknown`` (another subclass)
    or None (plain, unreadable, or a DTensor's local shard)."""
    if detection.kind == "wrapper":
        return "wrapper" if (detection.fp8 or "").startswith("wrapper") else None
    return detection.kind if detection.kind in ("payload", "unknown") else None


def _outer(subclass: str | None) -> str:
    """The outermost class of a ``A > B`` subclass chain."""
    return (subclass or "subclass").split(" > ")[0]


def model_tensors(ck: Checkpoint) -> list[str]:
    """The model's tensor keys: what the header's scan reads the chunk records of."""
    return [e.key for e in ck.entries() if e.component == "model" and e.kind == "tensor"]


# --- layout ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayoutFacts:
    """The layout, and when its model keys are not what a current loader expects (flat
    torchtitan names, no wrapper segments), the FQN doctor's report on them: ``report.best``
    is the rewrite that fixes them."""

    layout: str
    reason: str
    wrappers: tuple[str, ...] = ()
    report: KeyReport | None = None
    note: LayoutNote | None = None  # what the layout means for the producer's own loader

    def finding(self) -> Finding:
        if self.report is not None and self.report.best is not None:
            best = self.report.best
            fix = (
                f"Rewrite {best.description}: it resolves {best.resolves} of "
                f"{best.resolves + best.remaining} key mismatches (the Export tab applies it)."
            )
        else:
            fix = None
        if self.layout == "prefixed" and (self.note is None or not self.note.fine):
            example = self.report.missing[0] if self.report and self.report.missing else ""
            consequence = (
                self.note.consequence
                if self.note is not None
                else "A loader that expects model weights at top level reports every model "
                "key missing"
            ) + (f" (e.g. {example!r})." if example else ".")
            return Finding("layout", "warn", f"prefixed: {self.reason}", consequence, fix)
        if self.wrappers:
            origins = ", ".join(f"{w!r} ({WRAPPER_ORIGINS[w]})" for w in self.wrappers)
            consequence = (
                f"Model keys hold wrapper segments {origins}: a model without those wrappers "
                "reports them missing."
            )
            return Finding("layout", "warn", f"{self.layout}: {self.reason}", consequence, fix)
        tone = {"flat": "ok", "prefixed": "ok", "model-only": "info"}.get(self.layout, "bad")
        consequence = {
            "flat": "Model weights at top level beside the other training state.",
            "model-only": "Model weights only: they load as weights; nothing to resume from.",
        }.get(self.layout, "No model weights recognised: there is nothing to load or export.")
        if self.note is not None:
            consequence = self.note.consequence
        return Finding("layout", tone, f"{self.layout}: {self.reason}", consequence)


def layout_facts(ck: Checkpoint) -> LayoutFacts:
    """The layout and, when keys need rewriting for a current loader, the doctor's report."""
    fqns = {e.key: model_fqn(e) or e.key for e in ck.entries() if e.component == "model"}
    wrappers = tuple(
        w for w in WRAPPER_PREFIXES if any(has_segment(fqn, w) for fqn in fqns.values())
    )
    note = ck.profile.layouts.get(ck.layout)
    if (ck.layout != "prefixed" or (note is not None and note.fine)) and not wrappers:
        return LayoutFacts(ck.layout, ck.layout_reason, note=note)
    expected = [strip_segments(fqn, WRAPPER_PREFIXES) for fqn in fqns.values()]
    report = check_keys(ck, expected)
    return LayoutFacts(ck.layout, ck.layout_reason, wrappers, report, note)


# --- audit -------------------------------------------------------------------------------
def audit_finding(report: AuditReport) -> Finding:
    """``ok`` or ``N problems`` (by severity), with the first error's message."""
    counts = report.counts()
    checked = report.checked.text() if report.checked else "nothing could be checked"
    serious = counts["error"] + counts["warning"]
    if not serious:
        return Finding("audit", "ok", "ok", f"Checked {checked}.")
    summary = ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items() if n)
    worst = next(p for s in SEVERITIES for p in report.problems if p.severity == s)
    where = f"key {worst.key!r}: " if worst.key else f"{worst.file}: " if worst.file else ""
    tone = "bad" if counts["error"] else "warn"
    noun = "problem" if serious == 1 else "problems"
    return Finding("audit", tone, f"{serious} {noun} ({summary})", f"{where}{worst.message}")


# --- producer, step, location --------------------------------------------------------------
def producer_finding(ck: Checkpoint, step: int | None) -> Finding:
    """Who wrote it and at which step (the folder's, the metadata's or ``train_state``)."""
    opened = next((s for s in ck.steps if s.opened), None)
    known = ck.profile.name != "unknown"
    parts = [f"written by {ck.producer}" if known else "producer unknown"]
    if step is not None:
        parts.append(f"step {step:,}")
    if opened is not None:
        parts.append(f"{opened.name} of {len(ck.steps)} saved steps")
    return Finding("producer", "info", ", ".join(parts))


def saved_step(ck: Checkpoint) -> int | None:
    """The training step: the run folder's step name, the metadata's iteration, else
    ``train_state.step`` (one small read)."""
    opened = next((s for s in ck.steps if s.opened), None)
    if opened is not None and opened.number is not None:
        return opened.number
    if ck.metadata.get("iteration", "").isdigit():
        return int(ck.metadata["iteration"])
    entry = next((e for e in ck.entries() if is_train_step(e)), None)
    if entry is None or entry.error:
        return None
    try:
        value = ck.read_objects([entry.key])[entry.key]
        return int(value.reshape(-1)[0]) if entry.kind == "tensor" else int(value)
    except (InspectorError, TypeError, ValueError):
        return None


def location_text(ck: Checkpoint) -> str:
    """Where it is and what was read from there so far: bytes, and for remote storage the
    requests they took (a local file's reads are not requests anyone pays for)."""
    io = ck.io
    if ck.is_local:
        return f"{ck.location} · read from disk so far: {human_bytes(io.bytes)}"
    return f"{ck.location} · read so far: {human_bytes(io.bytes)} in {io.requests:,} requests"


# --- everything -------------------------------------------------------------------------
@dataclass(frozen=True)
class Findings:
    """The header's findings. ``fp8`` and ``audit`` are None until :func:`find` has run;
    ``layout`` holds the doctor's report once it has."""

    layout: LayoutFacts
    producer: Finding
    fp8: Fp8Facts | None = None
    audit: AuditReport | None = None

    @property
    def complete(self) -> bool:
        return self.fp8 is not None and self.audit is not None

    def lines(self) -> list[Finding]:
        """The findings in the order shown: FP8, layout, audit, producer."""
        found = [self.fp8.finding()] if self.fp8 is not None else []
        found.append(self.layout.finding())
        if self.audit is not None:
            found.append(audit_finding(self.audit))
        return [*found, self.producer]


def at_once(ck: Checkpoint) -> Findings:
    """What metadata alone tells (no per-key work): layout verdict, producer, run step."""
    opened = next((s for s in ck.steps if s.opened), None)
    step = opened.number if opened is not None else None
    note = ck.profile.layouts.get(ck.layout)
    return Findings(LayoutFacts(ck.layout, ck.layout_reason, note=note), producer_finding(ck, step))


def find(
    ck: Checkpoint,
    report: Callable[[int, int, str], None],
    cancel: threading.Event,
    early: Callable[[Findings], None] | None = None,
) -> Findings:
    """Everything: scans the model tensors' chunk records (``report(done, total, text)``
    after each), asks the FQN doctor about the layout, audits without reading tensor bytes
    (files, sizes, unfinished saves, completeness; CRC-32s are the Audit tab's).
    ``early(findings)`` hears FP8 and layout before the audit (many small reads remotely)."""
    keys = model_tensors(ck)
    for done, key in enumerate(keys, 1):
        check(cancel)
        ck.detection(key)
        report(done, len(keys), "scanning the model's chunk records")
    fp8 = fp8_facts(ck, keys)
    check(cancel)
    report(0, 1, "checking the layout and auditing")
    layout = layout_facts(ck)
    if early is not None:
        early(Findings(layout, at_once(ck).producer, fp8))
    audited = audit(ck, checksums=False, cancel=cancel)
    check(cancel)
    producer = producer_finding(ck, saved_step(ck))
    report(1, 1, "done")
    return Findings(layout, producer, fp8, audited)
