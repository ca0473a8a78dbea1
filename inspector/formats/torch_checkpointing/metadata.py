"""``metadata.pkl``: torch_checkpointing's record of how resharded items' tensors are laid out.

It is ``pickle.dumps(DistributedMetadata.to_dict())``: plain dicts, lists, tuples, strings,
ints and None, decoded by safe_pickle's plain-data unpickler (every global refused).
Version ``"2.0"`` groups records by item: ``{"metadata": {item: {"nested_path_to_metadata":
{json path: [group, ...]}, "rank_to_layout_info": {rank: layout | None}}}, "world_size",
"version"}``; version ``"1.0"`` is flat by whole checkpoint path. A group is
``{"sharding_metadata": {"type", "data"}, "ranks": (...)}``. Only tensor leaves of items
with a resharder are listed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from inspector import dtypes
from inspector.errors import CorruptCheckpointError
from inspector.formats import safe_pickle
from inspector.formats.torch_checkpointing.placements import Place
from inspector.storage.base import Storage

METADATA_PKL = "metadata.pkl"
_MAX_BYTES = 1 << 30
NestedPath = tuple[str | int, ...]


@dataclass(frozen=True)
class Sharding:
    """One group's record: the global tensor and, per rank of the group, where its shard is.

    ``kind`` is ``dtensor`` (mesh + placements), ``default`` (explicit shard boxes) or the
    record's own type name when unknown (then only ``raw`` is kept)."""

    kind: str
    ranks: tuple[int, ...]
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    mesh_shape: tuple[int, ...] = ()
    mesh_ranks: tuple[int, ...] = ()
    placements: tuple[Place, ...] = ()
    # default_tensor_v1: per shard (global offsets, local offsets, sizes)
    shards: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = ()
    raw: Any = None

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Where ``rank`` sits in the record's mesh (ValueError when it is not in it)."""
        if rank not in self.mesh_ranks:
            raise ValueError(f"rank {rank} is not in the mesh {list(self.mesh_ranks)}")
        flat, coordinate = self.mesh_ranks.index(rank), []
        for size in reversed(self.mesh_shape):
            flat, at = divmod(flat, size)
            coordinate.append(at)
        return tuple(reversed(coordinate))


@dataclass(frozen=True)
class Layout:
    """Where an item's file of one rank is and how it is serialised (``torch``, ``json``,
    ``raw``, ``safetensors``)."""

    file_path: str
    format: str


@dataclass(frozen=True)
class ItemMetadata:
    records: dict[NestedPath, tuple[Sharding, ...]] = field(default_factory=dict)
    layouts: dict[int, Layout | None] = field(default_factory=dict)


@dataclass(frozen=True)
class TcMetadata:
    version: str
    world_size: int | None
    items: dict[str, ItemMetadata]


_FORMATS = {
    "TorchSerialization": "torch",
    "JsonSerialization": "json",
    "RawSerialization": "raw",
    "SafetensorsSerialization": "safetensors",
}


def read_metadata(storage: Storage) -> TcMetadata:
    """Decode and check ``metadata.pkl`` (CorruptCheckpointError naming the file and the
    item or path that is malformed; UnsafeCheckpointError if it names any global)."""
    label = storage.describe(METADATA_PKL)
    size = storage.size(METADATA_PKL)
    if size > _MAX_BYTES:
        raise CorruptCheckpointError(f"{size} bytes: larger than any genuine metadata", file=label)
    raw = safe_pickle.load_plain(storage.read(METADATA_PKL), file=label)
    if not isinstance(raw, dict) or not isinstance(raw.get("metadata"), dict):
        raise CorruptCheckpointError("holds no 'metadata' table", file=label)
    version = raw.get("version") or "1.0"
    world = raw.get("world_size")
    if world is not None and (type(world) is not int or not 0 < world < 1 << 20):
        raise CorruptCheckpointError(f"world_size {world!r} is not a rank count", file=label)
    try:
        if version == "2.0":
            items = {_item_name(item): _item(entry) for item, entry in raw["metadata"].items()}
        elif version == "1.0":
            items = _from_v1(raw)
        else:
            raise ValueError(f"unknown metadata version {version!r}")
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise CorruptCheckpointError(f"malformed metadata ({exc})", file=label) from exc
    return TcMetadata(str(version), world, items)


def _item_name(item: Any) -> str:
    if not isinstance(item, str) or not item:
        raise ValueError(f"item key {item!r} is not a name")
    return item


def _item(entry: Any) -> ItemMetadata:
    records = {
        _path(key): _groups(groups, key)
        for key, groups in dict(entry.get("nested_path_to_metadata") or {}).items()
    }
    layouts = {
        _rank(r): _layout(v) for r, v in dict(entry.get("rank_to_layout_info") or {}).items()
    }
    return ItemMetadata(records, layouts)


def _from_v1(raw: dict) -> dict[str, ItemMetadata]:
    """Version 1.0: records keyed by the whole path (item first), layouts per rank per item."""
    records: dict[str, dict[NestedPath, tuple[Sharding, ...]]] = {}
    for key, groups in raw["metadata"].items():
        item, *path = _path(key)
        records.setdefault(_item_name(item), {})[tuple(path)] = _groups(groups, key)
    layouts: dict[str, dict[int, Layout | None]] = {}
    for rank, per_item in dict(raw.get("rank_to_layout_info_mappings") or {}).items():
        for item, layout in dict(per_item).items():
            layouts.setdefault(_item_name(item), {})[_rank(rank)] = _layout(layout)
    return {
        item: ItemMetadata(records.get(item, {}), layouts.get(item, {}))
        for item in dict.fromkeys([*records, *layouts])
    }


def _path(key: Any) -> NestedPath:
    """A record's nested path: compact JSON of a list of names and indices."""
    path = json.loads(key) if isinstance(key, str) else None
    if (
        not isinstance(path, list)
        or len(path) > 256
        or not all(isinstance(p, str) or (type(p) is int and 0 <= p < 1 << 31) for p in path)
    ):
        raise ValueError(f"nested path {key!r} is not a JSON list of names and indices")
    return tuple(path)


def _rank(value: Any) -> int:
    rank = int(value) if isinstance(value, str) and value.isdigit() else value
    if type(rank) is not int or not 0 <= rank < 1 << 20:
        raise ValueError(f"rank {value!r} is not a rank")
    return rank


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(
        type(v) is int and 0 <= v < 1 << 62 for v in value
    ):
        raise ValueError(f"{what} {value!r} is not a list of sizes")
    return tuple(value)


def _layout(value: Any) -> Layout | None:
    if value is None:
        return None
    path, fmt = value["file_path"], value["serialization_format"]["type"]
    if not isinstance(path, str) or fmt not in _FORMATS:
        raise ValueError(f"layout {value!r} names no file or an unknown format")
    return Layout(path, _FORMATS[fmt])


def _groups(groups: Any, key: str) -> tuple[Sharding, ...]:
    if not isinstance(groups, list):
        raise ValueError(f"records of {key} are not a list")
    return tuple(_sharding(g["sharding_metadata"], g.get("ranks", ())) for g in groups)


def _sharding(record: Any, ranks: Any) -> Sharding:
    kind, data = record["type"], record.get("data")
    ranks = tuple(_rank(r) for r in ranks)
    if kind == "DTensorShardingMetadata":
        mesh = data["mesh_spec"]
        mesh_shape = _ints(mesh["mesh_shape"], "mesh shape")
        mesh_ranks = tuple(_rank(r) for r in mesh["mesh_data"])
        if len(mesh_ranks) != math.prod(mesh_shape):
            raise ValueError(f"mesh {list(mesh_shape)} lists {len(mesh_ranks)} ranks")
        placements = tuple(_place(p) for p in data["placements"])
        return Sharding(
            "dtensor",
            ranks,
            _ints(data["global_shape"], "global shape"),
            _dtype(data["dtype"]),
            mesh_shape,
            mesh_ranks,
            placements,
        )
    if kind == "default_tensor_v1":
        shards = tuple(
            (_ints(g, "global offsets"), _ints(lo, "local offsets"), _ints(n, "local sizes"))
            for g, lo, n in zip(
                data["global_offsets"], data["local_offsets"], data["local_sizes"], strict=True
            )
        )
        shape = _ints(data["global_shape"], "global shape")
        return Sharding("default", ranks, shape, _dtype(data["dtype"]), shards=shards)
    return Sharding(str(kind)[:100], ranks, raw=record)


def _place(value: Any) -> Place:
    kind = value["type"]
    if kind == "Shard":
        return Place("shard", _ints([value["dim"]], "dim")[0])
    if kind == "StridedShard":
        dim, factor = _ints([value["dim"], value["split_factor"]], "strided shard")
        return Place("strided", dim, factor)
    if kind in ("Replicate", "Partial"):
        return Place(kind.lower())
    raise ValueError(f"unknown placement {kind!r}")


def _dtype(value: Any) -> str:
    name = str(value).removeprefix("torch.")
    if not dtypes.is_known(name):
        raise ValueError(f"unknown dtype {value!r}")
    return dtypes.name_of(name)
