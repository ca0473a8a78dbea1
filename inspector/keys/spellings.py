"""How keys are spelled: as stored, flattened (model keys at top level, torchtitan since July
2025) or prefixed (model keys under ``model.``, torchtitan before), and the wrapper prefixes
(``_orig_mod.``, ``module.``, ...) that leak into FQNs.
"""

from __future__ import annotations

from collections.abc import Iterable

from inspector.components import component_name
from inspector.entry import Entry

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
    "a checkpoint that nests the model's state dict under 'model' spells its weights "
    "'model.<name>' (torchtitan did before PR #1347, July 2025; flat since)"
)


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


def canonical_name(entry: Entry) -> str:
    """The name a tensor has whatever the layout: a model weight's FQN without component or
    wrapper prefixes (:func:`canonical_fqn`), any other entry's key without wrapper segments."""
    fqn = model_fqn(entry)
    if fqn is None:
        return strip_segments(entry.key, WRAPPER_PREFIXES)
    return canonical_fqn(fqn)
