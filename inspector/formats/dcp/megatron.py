"""Megatron-Core ``torch_dist`` checkpoints: DCP folders that Megatron's ``dist_checkpointing``
marks with ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``).

Beyond plain DCP they hold the common state (the ``common_state/shard_0_1`` item, or a
``common.pt`` file in versions that still wrote one) and sharded objects
(``<key>/shard_<offsets>_<shape>``: rng state, rerun state, modules' extra state), each
stored as a one-element list. Homogeneous layers are stacked on a leading layer axis
(``decoder.layers.*``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from inspector.entry import ChunkInfo, Entry
from inspector.errors import InspectorError
from inspector.formats.safe_pickle import DtypeName
from inspector.reprs import bounded_repr
from inspector.storage.base import Storage

MARKER = "metadata.json"
LEGACY_COMMON = "common.pt"
COMMON_PREFIX = "common_state/"
_MAX_MARKER_BYTES = 1 << 16
_SHARDED_OBJECT = re.compile(r"/shard_[0-9.]+_[0-9.]+$")
_STACKED = "decoder.layers."
# The run's facts worth showing next to the checkpoint (from the common state's ``args``).
SHOWN_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "padded_vocab_size",
    "seq_length",
    "max_position_embeddings",
    "params_dtype",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "world_size",
    "lr",
    "min_lr",
    "train_iters",
    "consumed_train_samples",
    "seed",
    "ckpt_format",
)
SHOWN_FIELDS = ("iteration", "checkpoint_version", "num_floating_point_operations_so_far")


def read_marker(storage: Storage) -> dict[str, Any] | None:
    """``metadata.json`` of a Megatron dist checkpoint, or None when the folder has none."""
    if storage.kind(MARKER) != "file" or storage.size(MARKER) > _MAX_MARKER_BYTES:
        return None
    try:
        marker = json.loads(storage.read(MARKER).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return marker if isinstance(marker, dict) and "sharded_backend" in marker else None


def is_sharded_object(key: str) -> bool:
    """``<key>/shard_<offsets>_<shape>``: one piece of a Megatron ShardedObject."""
    return bool(_SHARDED_OBJECT.search(key))


def unwrap(key: str, value: Any) -> Any:
    """The object itself: Megatron saves sharded objects as one-element lists."""
    if is_sharded_object(key) and isinstance(value, list) and len(value) == 1:
        return value[0]
    return value


def legacy_common_entry(storage: Storage) -> Entry | None:
    """``common.pt`` (older Megatron-Core) as an object entry of the common component."""
    if storage.kind(LEGACY_COMMON) != "file":
        return None
    chunk = ChunkInfo((), (), LEGACY_COMMON, 0, storage.size(LEGACY_COMMON))
    return Entry(
        LEGACY_COMMON, "object", chunks=(chunk,), nested_path=("common_state", LEGACY_COMMON)
    )


def common_entry(entries: Iterable[Entry]) -> Entry | None:
    """The entry holding the common state (iteration, args, optimizer step, ...)."""
    return next(
        (e for e in entries if e.key.startswith(COMMON_PREFIX) or e.key == LEGACY_COMMON), None
    )


def describe(
    entries: list[Entry], load: Callable[[Entry], Any]
) -> tuple[dict[str, str], list[str]]:
    """Metadata worth showing (iteration, the run's arguments) and notes, from the common
    state as ``load`` decodes it (unwrapped; tensors left as descriptions); damage there is
    a note, not a failure."""
    notes = [f"{MARKER} names Megatron-Core dist checkpointing (torch_dist)"]
    common = common_entry(entries)
    if common is None:
        return {}, [*notes, "no common state found (common_state/ item or common.pt)"]
    try:
        state = load(common)
    except InspectorError as exc:
        return {}, [*notes, f"the common state {common.key} cannot be decoded: {exc.reason}"]
    if not isinstance(state, dict):
        return {}, [*notes, f"the common state {common.key} is a {type(state).__name__}"]
    shown = {name: _text(state[name]) for name in SHOWN_FIELDS if name in state}
    args = state.get("args")
    fields = getattr(args, "fields", {})
    shown |= {f"args.{name}": _text(fields[name]) for name in SHOWN_ARGS if name in fields}
    notes.append(f"common state decoded from {common.key}")
    stacked = _stacked_note(entries, fields.get("num_layers"))
    return shown, [*notes, *([stacked] if stacked else [])]


def run_args(entries: list[Entry], load: Callable[[Entry], Any]) -> dict[str, Any]:
    """The run's arguments (the common state's ``args``) as plain values: numbers, strings,
    booleans and None as saved, a dtype as its name; other values are left out. Empty when
    there is no decodable common state."""
    common = common_entry(entries)
    try:
        state = load(common) if common is not None else None
    except InspectorError:
        return {}
    fields = getattr(state.get("args") if isinstance(state, dict) else None, "fields", {})
    plain = (bool, int, float, str, type(None))
    return {
        name: str(value) if isinstance(value, DtypeName) else value
        for name, value in fields.items()
        if isinstance(value, plain)
    }


def _stacked_note(entries: list[Entry], num_layers: Any) -> str | None:
    stacked = [e for e in entries if e.key.startswith(_STACKED) and e.shape]
    if not stacked:
        return None
    layers = num_layers if type(num_layers) is int else stacked[0].shape[0]  # type: ignore[index]
    return (
        f"{len(stacked)} {_STACKED}* tensors are stacked over {layers} layers: their leading "
        "axis is the layer index"
    )


def _text(value: Any) -> str:
    if isinstance(value, DtypeName):
        return repr(value)
    return value[:200] if isinstance(value, str) else bounded_repr(value, 200)
