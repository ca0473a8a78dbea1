"""Consistency within one checkpoint: optimizer entries that name parameters the model part
lacks (typical after a layout change), and weights stored under several spellings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inspector.checkpoint import Checkpoint
from inspector.entry import Entry
from inspector.keys.optimizer import optimizer_ref, resolve_optimizer_fqn
from inspector.keys.rewrites import Spec, suggest
from inspector.keys.spellings import canonical_fqn, model_fqn
from inspector.words import counted


@dataclass(frozen=True)
class Finding:
    """One inconsistency inside a checkpoint and the stored keys involved.

    ``kind``: ``optimizer-fqn`` (optimizer state or param_groups name parameters the model
    part lacks) or ``duplicate-spelling`` (one weight stored under several keys).
    """

    kind: str
    message: str
    keys: tuple[str, ...]
    fix: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "message": self.message,
            "keys": list(self.keys),
            "fix": self.fix,
        }


@dataclass(frozen=True)
class Consistency:
    """What ``ck.consistency()`` found; empty ``findings`` means consistent."""

    checkpoint: str
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        return not self.findings

    def text(self) -> str:
        if self.ok:
            return f"{self.checkpoint}: consistent (optimizer names and model spellings agree)"
        lines = [f"{self.checkpoint}: {counted(len(self.findings), 'finding')}"]
        for f in self.findings:
            lines.append(f"- {f.message}")
            if f.fix:
                lines.append(f"  fix: {f.fix}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "ok": self.ok,
            "findings": [f.as_dict() for f in self.findings],
        }


def consistency(ck: Checkpoint) -> Consistency:
    """Check that optimizer entries name the model's parameters and no weight is stored twice."""
    entries = ck.entries()
    model = [e for e in entries if e.component == "model"]
    findings = [*_optimizer_findings(entries, model), *_duplicate_findings(model)]
    return Consistency(ck.location, tuple(findings))


def _optimizer_findings(entries: list[Entry], model: list[Entry]) -> list[Finding]:
    fqns = {fqn for e in model if (fqn := model_fqn(e)) is not None}
    if not fqns:
        return []
    named: dict[str, Spec] = {}
    unknown: dict[str, dict[str, list[str]]] = {}
    for entry in entries:
        ref = optimizer_ref(entry)
        if ref is None:
            continue
        fqn = resolve_optimizer_fqn(ref, fqns)
        if fqn is None:
            fqn = ref.guessed_fqn
            unknown.setdefault(ref.section, {}).setdefault(fqn, []).append(entry.key)
        named[fqn] = (None, None)
    if not unknown:
        return []
    found = suggest(named, dict.fromkeys(fqns, (None, None)), count_missing=False)
    fix = None
    if found:
        best = found[0]
        why = f" ({best.why})" if best.why else ""
        fix = (
            f"{best.description}{why} makes {best.resolves} of "
            f"{best.resolves + best.remaining} unknown names match the model part"
        )
    findings = []
    for section, by_fqn in unknown.items():
        fqn, keys = next(iter(by_fqn.items()))
        findings.append(
            Finding(
                "optimizer-fqn",
                f"optimizer {section} refers to {len(by_fqn)} parameter names the model part "
                f"does not have, e.g. {fqn!r} (in {keys[0]!r}); typical after a layout change",
                tuple(k for group in by_fqn.values() for k in group),
                fix,
            )
        )
    return findings


def _duplicate_findings(model: list[Entry]) -> list[Finding]:
    groups: dict[str, list[Entry]] = {}
    for entry in model:
        groups.setdefault(canonical_fqn(model_fqn(entry) or entry.key), []).append(entry)
    duplicates = [g for g in groups.values() if len(g) > 1]
    if not duplicates:
        return []
    differing = sum(len({(e.shape, e.dtype) for e in g}) > 1 for g in duplicates)
    agreement = (
        f"{differing} of them differ in shape or dtype" if differing else "shapes and dtypes agree"
    )
    example = " and ".join(repr(e.key) for e in duplicates[0])
    return [
        Finding(
            "duplicate-spelling",
            f"{len(duplicates)} weights are stored under more than one spelling, e.g. {example}; "
            f"{agreement}",
            tuple(e.key for g in duplicates for e in g),
            "keep one spelling per weight: a loader picks one of them and ignores the other",
        )
    ]
