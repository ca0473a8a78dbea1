"""Class 3, amplification through the pickle memo: one stored object referenced from many
places. A dict of two references to the dict below it, 40 deep, is 2^40 paths in a few
hundred bytes; a chunk list or planner path shared by thousands of keys is walked once per
key; a wrapper whose ``_tensor`` is itself never ends. The work must stay bounded by the
bytes on disk: refuse, mark the keys, or handle sharing as sharing.

Tied weights (one tensor under several keys, and views of it) are the genuine use of the
same mechanism and must keep reading exactly."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch

from tests.fixtures.damage import dcp_metadata
from tests.hostile import opcodes, plant
from tests.hostile.case import IsolatedGenerator, Sources
from tests.hostile.isolated import Spec

FP8_KEY = "layers.0.attention.wq.weight"  # a torchao float8 wrapper in the fp8 demo


def dag(depth: int, leaf: Any) -> dict:
    """``{'a': d, 'b': d}`` over the level below, ``depth`` levels: 2^depth leaf paths."""
    node = leaf
    for _ in range(depth):
        node = {"a": node, "b": node}
    return node


def _dag_pt(depth: int, sources: Sources, tmp: Path) -> Spec:
    weight = torch.arange(8.0)
    path = plant.pt_of(tmp, {"weight": weight, "tree": dag(depth, weight)})
    return Spec(path, path.name, refused=None, maybe_bad=frozenset({"tree"}))


def _dag_object(sources: Sources, tmp: Path) -> Spec:
    """A DCP object whose value is a 2^40-path DAG of ints: reading it in full is unbounded."""
    folder = plant.object_with(sources, tmp, None, value=dag(40, 1))
    file = plant.item_file(folder, plant.OBJECT)
    return Spec(folder, file, bad=frozenset({plant.OBJECT}), reference=sources.flat)


def _shared_chunks(sources: Sources, tmp: Path, keys: int = 2000, chunks: int = 20000) -> Spec:
    """``keys`` new tensors in ``.metadata`` all pointing at one list of ``chunks`` chunks
    (about 1.3 MB): without storage records they are all bad, and finding that out must not
    walk keys x chunks."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    folder = sources.copy("seed", tmp)
    metadata = dcp_metadata(folder)
    properties = metadata.state_dict_metadata[plant.TENSOR].properties
    shared = [ChunkStorageMetadata(torch.Size([i]), torch.Size([1])) for i in range(chunks)]
    added = [f"shared.{i}.weight" for i in range(keys)]
    for key in added:
        metadata.state_dict_metadata[key] = TensorStorageMetadata(
            properties, torch.Size([chunks]), shared
        )
    plant.write_metadata(folder, metadata)
    return Spec(folder, ".metadata", refused=None, bad=frozenset(added), reference=sources.seed)


def _shared_planner_path(sources: Sources, tmp: Path, keys: int = 2000) -> Spec:
    """``keys`` new objects whose planner path is one tuple of 200,000 segments."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = sources.copy("seed", tmp)
    metadata = dcp_metadata(folder)
    path = ("model", *["x"] * 200_000)
    added = [f"extra.{i}" for i in range(keys)]
    for key in added:
        metadata.state_dict_metadata[key] = BytesStorageMetadata()
        metadata.planner_data[key] = path
    plant.write_metadata(folder, metadata)
    return Spec(folder, ".metadata", refused=None, bad=frozenset(added), reference=sources.seed)


def _last_memo(data: bytes) -> int:
    """The memo slot of the pickle's top-level object (its last PUT)."""
    import pickletools

    puts = [arg for op, arg, _ in pickletools.genops(data) if "PUT" in op.name]
    return int(puts[-1])


def self_wrapped(item: bytes) -> bytes:
    """A wrapper chunk whose SubclassRef gets ``BUILD {'attrs': {'_tensor': itself}}``."""
    pkl = opcodes.data_pkl(item)
    tail = (
        opcodes.EMPTY_DICT
        + opcodes.text("attrs")
        + opcodes.EMPTY_DICT
        + opcodes.text("_tensor")
        + opcodes.get(_last_memo(pkl))
        + opcodes.SETITEM
        + opcodes.SETITEM
        + opcodes.BUILD
    )
    return opcodes.with_data_pkl(item, opcodes.append_opcodes(pkl, tail))


def _self_wrapper_dcp(sources: Sources, tmp: Path) -> Spec:
    folder = sources.copy("fp8", tmp)
    plant.rewrite_item(folder, FP8_KEY, self_wrapped)
    file = plant.item_file(folder, FP8_KEY)
    return Spec(folder, file, bad=frozenset({FP8_KEY}), reference=sources.fp8)


def _self_wrapper_pt(sources: Sources, tmp: Path) -> Spec:
    """The same wrapper chunk as a file of its own (a DCP item is a complete torch.save)."""
    item = plant.item_bytes(sources.fp8, FP8_KEY)
    path = opcodes.write(tmp / "wrapper.pt", self_wrapped(item))
    return Spec(path, path.name, refused=None, maybe_bad=frozenset({"wrapper"}))


def _cyclic_dict(sources: Sources, tmp: Path) -> Spec:
    state: dict[str, Any] = {"weight": torch.arange(6.0)}
    state["loop"] = state
    path = plant.pt_of(tmp, state)
    return Spec(path, path.name, refused=None, maybe_bad=frozenset({"loop"}))


def _cyclic_list(sources: Sources, tmp: Path) -> Spec:
    value: list[Any] = [1]
    value.append(value)
    folder = plant.object_with(sources, tmp, None, value=value)
    file = plant.item_file(folder, plant.OBJECT)
    return Spec(folder, file, maybe_bad=frozenset({plant.OBJECT}), reference=sources.flat)


def _tied(sources: Sources, tmp: Path) -> Spec:
    """Genuine sharing: must read as torch.load reads it."""
    weight = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    state = {"embed": weight, "output": weight, "rows": weight[1:3], "transposed": weight.t()}
    path = plant.pt_of(tmp, state)
    return Spec(path, path.name, then=path)


CASES: dict[str, IsolatedGenerator] = {
    "memo:dag-2^40@pt": partial(_dag_pt, 40),
    "memo:dag-2^20@pt": partial(_dag_pt, 20),
    "memo:dag-2^40@object": _dag_object,
    "memo:shared-chunks@metadata": _shared_chunks,
    "memo:shared-planner-path@metadata": _shared_planner_path,
    "memo:self-wrapper@dcp": _self_wrapper_dcp,
    "memo:self-wrapper@pt": _self_wrapper_pt,
    "memo:cyclic-dict@pt": _cyclic_dict,
    "memo:cyclic-list@object": _cyclic_list,
    "memo:tied-weights@pt": _tied,
}
