"""Which component a key belongs to: model, optimizer, lr_scheduler, dataloader, train_state,
common or rng (Megatron-Core's common state and sharded rng objects).

The nested path a key was saved under (DCP ``planner_data``, ``.pt`` dict nesting) tells;
dotted names are only a fallback, since model FQNs contain dots and Hugging Face names
start with ``model.`` themselves.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from inspector.entry import COMPONENTS, Entry, make_entry

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
    # Megatron-Core: the common state (args, iteration, ...), sharded rng and rerun objects.
    "common_state": "common",
    "rerun_state_machine_state": "common",
    "rng_state": "rng",
}
_SHARDED_OBJECT = "/shard_"  # Megatron's ShardedObject keys: ``<key>/shard_<offsets>_<shape>``
_EXTRA_STATE = "_extra_state"


def component_name(head: object) -> str | None:
    """The component a nested path's first element names (``"MODEL"`` counts as model)."""
    return _ALIASES.get(head.lower()) if isinstance(head, str) else None


def with_components(entries: list[Entry]) -> list[Entry]:
    """The entries with ``component`` set (and a guessed ``nested_path`` where the format
    lost it); records are rebuilt, never changed."""
    guess_model_prefix = any(
        not e.nested_path and component_name(e.key.split(".", 1)[0]) not in (None, "model")
        for e in entries
    )
    out = []
    for e in entries:
        path = e.nested_path or _guess_path(e.key, guess_model_prefix)
        component = _component(e.kind, path)
        if component == e.component and path is e.nested_path:
            out.append(e)
        else:
            out.append(
                make_entry(e.key, e.kind, e.dtype, e.shape, e.chunks, path, component, e.error)
            )
    return out


def _guess_path(key: str, model_prefix_plausible: bool) -> tuple[str, ...]:
    base, slash, shard = key.partition(_SHARDED_OBJECT)
    if slash and "." not in base and component_name(base) is not None:
        return (base, slash[1:] + shard)
    head, _, rest = key.partition(".")
    name = component_name(head)
    if rest and name is not None and (name != "model" or model_prefix_plausible):
        return (head, rest)
    return (key,)


def _component(kind: str, path: tuple) -> str:
    named = component_name(path[0]) if len(path) > 1 else None
    if named is not None:
        return named
    if (kind == "tensor" and len(path) == 1) or _is_extra_state(path):
        return "model"
    return "other"


def _is_extra_state(path: tuple) -> bool:
    """A module's ``get_extra_state()`` value (e.g. TransformerEngine FP8 metadata), whole or
    one layer's piece of it (Megatron)."""
    return any(_EXTRA_STATE in str(part).partition(_SHARDED_OBJECT)[0].split(".") for part in path)


def component_counts(entries: Iterable[Entry]) -> dict[str, int]:
    """Number of keys per component, in the canonical component order."""
    counts = Counter(e.component for e in entries)
    order = [*COMPONENTS, "other"]
    return {c: counts[c] for c in order if counts[c]}
