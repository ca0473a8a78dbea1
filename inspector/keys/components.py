"""Which component a key belongs to, the checkpoint's layout, and its key spellings per view.

torchtitan stored model weights under ``model.`` before its PR #1347 (July 2025) and at
top level since; other components (optimizer, lr_scheduler, dataloader, train_state)
keep their prefix. The nested path a key was saved under (DCP ``planner_data``, ``.pt``
dict nesting) tells which is which; dotted names are only a fallback, since model FQNs
contain dots and Hugging Face names start with ``model.`` themselves.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase

from inspector.entry import COMPONENTS, Entry
from inspector.errors import InspectorError

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
MODEL_PREFIX = "model."
WRAPPER_ORIGINS = {
    "_orig_mod.": "torch.compile",
    "_checkpoint_wrapped_module.": "activation checkpointing (checkpoint_wrapper)",
    "_fsdp_wrapped_module.": "FSDP1 (FullyShardedDataParallel)",
    "module.": "DDP / nn.DataParallel",
}
WRAPPER_PREFIXES = tuple(WRAPPER_ORIGINS)
MODEL_PREFIX_ORIGIN = (
    "torchtitan stored model weights under 'model.' before PR #1347 (July 2025) "
    "and at top level since"
)
_EXTRA_STATE = "_extra_state"


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
    named = component_name(path[0]) if len(path) > 1 else None
    if named is not None:
        return named
    if (entry.kind == "tensor" and len(path) == 1) or _is_extra_state(path):
        return "model"
    return "other"


def _is_extra_state(path: tuple) -> bool:
    """A module's ``get_extra_state()`` value (e.g. TransformerEngine FP8 metadata)."""
    return any(_EXTRA_STATE in str(part).split(".") for part in path)


def model_fqn(entry: Entry) -> str | None:
    """The model parameter name without any component prefix; None for non-model entries."""
    if entry.component != "model":
        return None
    path = entry.nested_path
    if len(path) > 1 and component_name(path[0]) == "model":
        return ".".join(str(p) for p in path[1:])
    return entry.key


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
    if prefixed and top:
        evidence.append(
            "model keys under both spellings: ck.consistency() lists duplicate spellings"
        )
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


def has_segment(key: str, prefix: str) -> bool:
    """Whether ``prefix`` (a dotted segment such as ``"_orig_mod."``) occurs in ``key``."""
    return key.startswith(prefix) or f".{prefix}" in key


def strip_segments(key: str, prefixes: Iterable[str]) -> str:
    """``key`` without the given wrapper segments, wherever they sit."""
    present = {p[:-1] for p in prefixes if has_segment(key, p)}
    if not present:
        return key
    return ".".join(part for part in key.split(".") if part not in present)


def canonical_fqn(key: str) -> str:
    """The weight's name once wrapper segments and a leading ``model.`` are gone."""
    return strip_segments(key, WRAPPER_PREFIXES).removeprefix(MODEL_PREFIX)


@dataclass(frozen=True)
class OptimizerRef:
    """An optimizer entry's reference to a parameter.

    ``fqn`` is exact when the nested path kept it apart (``("optimizer", "state", fqn,
    "exp_avg")``); after DCP's flattening (``"state.<fqn>.exp_avg"``) only ``text``, the
    FQN followed by the state's own name, is known.
    """

    section: str
    text: str
    fqn: str | None

    @property
    def guessed_fqn(self) -> str:
        """The exact FQN, or the text without its last segment (the state's name)."""
        return self.fqn if self.fqn is not None else self.text.rpartition(".")[0]


_OPTIMIZER_SECTIONS = ("state", "param_groups")


def optimizer_ref(entry: Entry) -> OptimizerRef | None:
    """The parameter an optimizer entry belongs to; None when it names none (or by index)."""
    if entry.component != "optimizer":
        return None
    path = entry.nested_path
    if len(path) >= 4 and path[1] in _OPTIMIZER_SECTIONS:
        if not isinstance(path[2], str) or path[2].isdigit():
            return None
        return OptimizerRef(path[1], ".".join(str(p) for p in path[2:]), path[2])
    if len(path) != 2 or not isinstance(path[1], str):
        return None
    section, _, text = path[1].partition(".")
    if section not in _OPTIMIZER_SECTIONS or "." not in text or text.split(".", 1)[0].isdigit():
        return None
    return OptimizerRef(section, text, None)


def resolve_optimizer_fqn(ref: OptimizerRef, fqns: set[str] | frozenset[str]) -> str | None:
    """The FQN in ``fqns`` the reference names (longest dotted prefix of its text); else None."""
    if ref.fqn is not None:
        return ref.fqn if ref.fqn in fqns else None
    text = ref.text
    while "." in text:
        text = text.rpartition(".")[0]
        if text in fqns:
            return text
    return None


# --- filtering keys -------------------------------------------------------------------------
FILTER_MODES = ("substring", "glob", "regex")


def key_filter(pattern: str, mode: str = "substring") -> Callable[[str], bool]:
    """A test for keys: ``substring`` (case-insensitive), ``glob`` (whole key, ``*`` / ``?``
    / ``[...]``) or ``regex`` (searched anywhere in the key); an empty pattern passes all."""
    if mode not in FILTER_MODES:
        raise ValueError(f"filter mode must be one of {FILTER_MODES}, not {mode!r}")
    if not pattern:
        return lambda key: True
    if mode == "substring":
        folded = pattern.casefold()
        return lambda key: folded in key.casefold()
    if mode == "glob":
        return lambda key: fnmatchcase(key, pattern)
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise InspectorError(f"not a valid regular expression {pattern!r}: {exc}") from None
    return lambda key: compiled.search(key) is not None


def filter_entries(entries: Iterable[Entry], view: str, pattern: str, mode: str) -> list[Entry]:
    """The entries whose key, spelled as in ``view``, passes :func:`key_filter`."""
    if not pattern:
        return list(entries)
    test = key_filter(pattern, mode)
    return [e for e in entries if test(view_key(e, view))]
