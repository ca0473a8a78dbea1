"""The checkpoint's layout (flat / prefixed / model-only / unknown) and the evidence for it.

What a prefix means comes from the producer's profile (torchtitan's ``model.`` before its PR
#1347, Lightning's ``state_dict.``, ...); the layout itself is judged from the entries.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from inspector.entry import Entry
from inspector.formats.producers import UNKNOWN, Producer

LAYOUTS = ("flat", "prefixed", "model-only", "unknown")


@dataclass(frozen=True)
class Layout:
    """The layout name (flat / prefixed / model-only / unknown) and the evidence for it."""

    name: str
    evidence: tuple[str, ...]

    @property
    def verdict(self) -> str:
        """The evidence line that decided the layout (why it is what it is)."""
        return self.evidence[-1]

    def describe(self) -> str:
        return f"layout: {self.name}\n" + "\n".join(f"- {line}" for line in self.evidence)


def detect_layout(entries: Iterable[Entry], *, nesting: str, profile: Producer = UNKNOWN) -> Layout:
    """Decide flat / prefixed / model-only / unknown; ``nesting`` says where paths came from,
    ``profile`` what the producer's prefixes and layouts mean."""
    entries = list(entries)
    counts = Counter(e.component for e in entries)
    model = [e for e in entries if e.component == "model"]
    prefixed = [e for e in model if len(e.nested_path) > 1]
    top = [e for e in model if len(e.nested_path) == 1]
    others = {c: n for c, n in counts.items() if c not in ("model", "other")}
    evidence = [f"nested paths from {nesting}"]
    if others:
        evidence.append(
            "other components: " + ", ".join(f"{c} ({n} keys)" for c, n in sorted(others.items()))
        )
    if prefixed:
        evidence.append(
            f"{len(prefixed)} model keys stored under the {prefixed[0].nested_path[0]!r} prefix, "
            f"e.g. {prefixed[0].key!r} saved as {prefixed[0].nested_path!r}"
        )
    if top:
        evidence.append(f"{len(top)} model keys stored at top level, e.g. {top[0].key!r}")
    if prefixed and top:
        evidence.append(
            "model keys under both spellings: ck.consistency() lists duplicate spellings"
        )
    if prefixed:
        name = "prefixed"
        head = str(prefixed[0].nested_path[0])
        meaning = profile.prefixes.get(head)
        evidence.append(f"model weights under {head + '.'!r}" + (f": {meaning}" if meaning else ""))
    elif top and others:
        name = "flat"
        note = profile.layouts.get("flat")
        called = note.called if note is not None else None
        evidence.append(
            "model weights at top level beside prefixed components"
            + (f": {called}" if called else "")
        )
    elif top:
        name = "model-only"
        evidence.append("model weights only (seed checkpoint, last-step or Hugging Face export)")
    else:
        name = "unknown"
        evidence.append("no model weights recognised")
    return Layout(name, tuple(evidence))
