"""Which component a key belongs to, from the nested path it was saved under: model,
optimizer, lr_scheduler, dataloader, train_state, common or rng (Megatron-Core's common
state and sharded rng objects), loops or callbacks (Lightning), else other.

The first element of a nested path (DCP ``planner_data``, ``.pt`` dict nesting) names it;
a lone tensor is the model's (a bare state dict). A record, so formats can set it while
they build entries; :mod:`inspector.keys.components` guesses paths where a format lost them.
"""

from __future__ import annotations

from typing import Any

_ALIASES = {
    "model": "model",
    "state_dict": "model",
    "model_state_dict": "model",
    "optimizer": "optimizer",
    "optim": "optimizer",
    "optimizer_state_dict": "optimizer",
    "optimizers": "optimizer",
    "optimizer_states": "optimizer",  # Lightning
    "lr_scheduler": "lr_scheduler",
    "lr_schedulers": "lr_scheduler",
    "scheduler": "lr_scheduler",
    "dataloader": "dataloader",
    "train_state": "train_state",
    "loops": "loops",  # Lightning's fit / validate loop progress
    "callbacks": "callbacks",  # Lightning's callbacks' states (ModelCheckpoint, ...)
    # Megatron-Core: the common state (args, iteration, ...), sharded rng and rerun objects.
    "common_state": "common",
    "rerun_state_machine_state": "common",
    "rng_state": "rng",
}
SHARDED_OBJECT = "/shard_"  # Megatron's ShardedObject keys: ``<key>/shard_<offsets>_<shape>``
EXTRA_STATE = "_extra_state"


def component_name(head: object) -> str | None:
    """The component a nested path's first element names (``"MODEL"`` counts as model)."""
    return _ALIASES.get(head.lower()) if isinstance(head, str) else None


def component_of(kind: str, path: tuple[Any, ...]) -> str:
    """The component of an entry of ``kind`` saved under ``path`` (a non-empty path)."""
    named = component_name(path[0]) if len(path) > 1 else None
    if named is not None:
        return named
    if (kind == "tensor" and len(path) == 1) or _is_extra_state(path):
        return "model"
    return "other"


def _is_extra_state(path: tuple) -> bool:
    """A module's ``get_extra_state()`` value (e.g. TransformerEngine FP8 metadata), whole or
    one layer's piece of it (Megatron)."""
    return any(EXTRA_STATE in str(part).partition(SHARDED_OBJECT)[0].split(".") for part in path)
