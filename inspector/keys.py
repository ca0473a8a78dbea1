"""Which component a key belongs to, the checkpoint's layout, and its key spellings per view.

torchtitan stored model weights under ``model.`` before its PR #1347 (July 2025) and at
top level since; other components (optimizer, lr_scheduler, dataloader, train_state)
keep their prefix. The nested path a key was saved under (DCP ``planner_data``, ``.pt``
dict nesting) tells which is which; dotted names are only a fallback, since model FQNs
contain dots and Hugging Face names start with ``model.`` themselves.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from inspector.model import COMPONENTS, Entry

_ALIASES = {
    "model": "model",
    "state_dict": "model",
    "model_state_dict": "model",
    "optimizer": "optimizer",
    "optim": "optimizer",
    "optimizer_state_dict": "optimizer",
    "optimizers": "optimizer",
    "lr_scheduler": "lr_scheduler",
    "lr_schedulers": "lr_scheduler",
    "scheduler": "lr_scheduler",
    "dataloader": "dataloader",
    "train_state": "train_state",
}
VIEWS = ("stored", "flattened", "prefixed")
WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module.")


@dataclass(frozen=True)
class Layout:
    """The layout name (flat / prefixed / model-only / unknown) and the evidence for it."""

    name: str
    evidence: tuple[str, ...]

    def describe(self) -> str:
        return f"layout: {self.name}\n" + "\n".join(f"- {line}" for line in self.evidence)


def component_name(head: object) -> str | None:
    """The component a nested path's first element names (``"MODEL"`` counts as model)."""
    return _ALIASES.get(head.lower()) if isinstance(head, str) else None


def assign_components(entries: list[Entry]) -> None:
    """Fill ``entry.component`` (and a guessed ``nested_path`` where the format lost it)."""
    guess_model_prefix = any(
        not e.nested_path and component_name(e.key.split(".", 1)[0]) not in (None, "model")
        for e in entries
    )
    for entry in entries:
        if not entry.nested_path:
            entry.nested_path = _guess_path(entry.key, guess_model_prefix)
        entry.component = _component(entry)


def _guess_path(key: str, model_prefix_plausible: bool) -> tuple[str, ...]:
    head, _, rest = key.partition(".")
    name = component_name(head)
    if rest and name is not None and (name != "model" or model_prefix_plausible):
        return (head, rest)
    return (key,)


def _component(entry: Entry) -> str:
    path = entry.nested_path
    if len(path) > 1:
        return component_name(path[0]) or "other"
    return "model" if entry.kind == "tensor" else "other"


def model_fqn(entry: Entry) -> str | None:
    """The model parameter name without any component prefix; None for non-model entries."""
    if entry.component != "model":
        return None
    path = entry.nested_path
    return ".".join(str(p) for p in path[1:]) if len(path) > 1 else entry.key


def view_key(entry: Entry, view: str) -> str:
    """The key as it reads in a view: as stored, flattened (torchtitan now) or prefixed (legacy)."""
    if view == "stored":
        return entry.key
    fqn = model_fqn(entry)
    if fqn is None:
        return entry.key
    if view == "flattened":
        return fqn
    if view == "prefixed":
        return f"model.{fqn}"
    raise ValueError(f"view must be one of {VIEWS}, not {view!r}")


def detect_layout(entries: Iterable[Entry], *, nesting: str) -> Layout:
    """Decide flat / prefixed / model-only / unknown; ``nesting`` says where paths came from."""
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
    if prefixed:
        name = "prefixed"
        evidence.append("model weights under 'model.': torchtitan's layout before PR #1347")
    elif top and others:
        name = "flat"
        evidence.append(
            "model weights at top level beside prefixed components: torchtitan's current layout"
        )
    elif top:
        name = "model-only"
        evidence.append("model weights only (seed checkpoint, last-step or Hugging Face export)")
    else:
        name = "unknown"
        evidence.append("no model weights recognised")
    return Layout(name, tuple(evidence))


def component_counts(entries: Iterable[Entry]) -> dict[str, int]:
    """Number of keys per component, in the canonical component order."""
    counts = Counter(e.component for e in entries)
    order = [*COMPONENTS, "other"]
    return {c: counts[c] for c in order if counts[c]}
