"""The torch_checkpointing fixtures are genuine and the values beside them are right.

Reads go through the library's own reader and loader: acceptable here because these are
our own freshly written folders (the inspector itself must never unpickle them this way).
"""

from __future__ import annotations

import io
import json
import math
import pickle
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.fixtures import torch_checkpointing as tc
from tests.fixtures.formats import same

SUFFIX_FORMATS = {".pt": None, ".safetensors": "safetensors", ".json": "json", ".bin": "raw"}


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert same(got[key], value), key


def rank_layouts(folder: Path, rank: int) -> dict:
    """Each item's file for ``rank`` by the name rule ``<item>_<rank>.<ext>``, any subfolder."""
    from torch_checkpointing.checkpoint_layout import (
        JsonSerialization,
        LayoutInfo,
        RawSerialization,
        SafetensorsSerialization,
    )

    formats = {
        "safetensors": SafetensorsSerialization(),
        "json": JsonSerialization(),
        "raw": RawSerialization(),
    }
    layouts = {}
    for path in folder.rglob(f"*_{rank}.*"):
        item = path.stem.rsplit("_", 1)[0]
        kind = SUFFIX_FORMATS[path.suffix]
        relative = str(path.relative_to(folder))
        layouts[item] = None if kind is None else LayoutInfo(relative, formats[kind])
    return layouts


def library_read(folder: Path, rank: int, world_size: int) -> dict:
    """The library's direct read of one rank's files (no resharding, no process group)."""
    from torch_checkpointing.checkpoint_base import CheckpointInfo, CheckpointItem
    from torch_checkpointing.checkpoint_reader import CheckpointReader
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
    from torch_checkpointing.types import RankInfo

    reader = CheckpointReader(
        rank_info=RankInfo(rank, world_size, rank, world_size),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
    )
    items = {k: CheckpointItem(layout=v) for k, v in rank_layouts(folder, rank).items()}
    state, missing = reader.read(str(folder), CheckpointInfo(items).for_reads())
    assert missing == []
    return tc.flatten_state(state)


def split_read(flat: dict) -> tuple[dict[str, torch.Tensor], dict]:
    from torch.distributed.tensor import DTensor

    tensors = {
        k: v._local_tensor if isinstance(v, DTensor) else v
        for k, v in flat.items()
        if torch.is_tensor(v)
    }
    return tensors, {k: v for k, v in flat.items() if not torch.is_tensor(v)}


def sharding(record: dict):
    """The library's ``DTensorShardingMetadata`` from its JSON-decoded ``to_dict()``."""
    from torch_checkpointing.dtensor_metadata import DTensorShardingMetadata

    mesh = {k: tuple(v) if isinstance(v, list) else v for k, v in record["mesh_spec"].items()}
    return DTensorShardingMetadata.from_dict({**record, "mesh_spec": mesh})


def global_indices(meta, rank: int) -> list[list[int]]:
    """Per tensor dim, the global indices ``rank`` holds: torch's own per-placement rule,
    applied left to right over mesh dims (``_compute_local_shape_and_global_offset``)."""
    from torch.distributed.tensor._utils import _StridedShardOffsetMode
    from torch.distributed.tensor.placement_types import Shard, _StridedShard
    from torch_checkpointing.default_resharder import _to_dtensor_placements

    coordinate = meta.mesh_spec.get_coordinate(rank)
    index = [list(range(n)) for n in meta.global_shape]
    for mesh_dim, placement in enumerate(_to_dtensor_placements(meta)):
        chunks, at = meta.mesh_spec.mesh_shape[mesh_dim], coordinate[mesh_dim]
        if isinstance(placement, _StridedShard):
            _, picked = placement.local_shard_size_and_offset(
                len(index[placement.dim]), chunks, at, _StridedShardOffsetMode.ALL
            )
        elif isinstance(placement, Shard):
            size, start = Shard.local_shard_size_and_offset(len(index[placement.dim]), chunks, at)
            picked = range(start, start + size)
        else:
            continue
        index[placement.dim] = [index[placement.dim][i] for i in picked]
    return index


def take(full: torch.Tensor, index: list[list[int]]) -> torch.Tensor:
    for dim, rows in enumerate(index):
        full = full.index_select(dim, torch.tensor(rows, dtype=torch.long))
    return full


def mark(covered: torch.Tensor, index: list[list[int]]) -> None:
    if covered.dim() == 0:
        covered[...] = True
        return
    rows = [torch.tensor(i, dtype=torch.long) for i in index]
    covered[torch.meshgrid(*rows, indexing="ij")] = True


# --- one process ---------------------------------------------------------------------------


def test_single_reloads_bit_exactly_with_the_library(tc_single_written: dict) -> None:
    written = tc_single_written["single"]
    manager = tc.make_manager(tc.single_items())
    try:
        loaded = tc.library_load_single(manager, written.path)
    finally:
        manager.close()
    assert_same_tensors(loaded, written.tensors)
    assert_same_tensors(written.library, written.tensors)
    tensors, objects = split_read(library_read(written.path, 0, 1))
    assert_same_tensors(tensors, written.local[0])
    assert objects == written.objects[0]
    assert objects["blob"] == tc.RAW_BLOB and objects["config.optimizer.betas.1"] == 0.999
    assert objects["optimizer.param_groups.0.param_names.1"] == "embed.weight"


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise AssertionError(f"metadata.pkl names a global: {module}.{name}")


def test_single_metadata_pkl_is_globals_free_and_lists_resharded_tensors(
    tc_single_written: dict,
) -> None:
    written = tc_single_written["single"]
    raw = (written.path / "metadata.pkl").read_bytes()
    assert raw[:2] == b"\x80\x04"
    meta = _NoGlobals(io.BytesIO(raw)).load()
    assert (meta["version"], meta["world_size"]) == ("2.0", 1)
    assert set(meta["metadata"]) == {"model", "optimizer", "ema"}
    listed = {}
    for item, entry in meta["metadata"].items():
        for path, groups in entry["nested_path_to_metadata"].items():
            (group,) = groups
            assert group["ranks"] == (0,)
            assert group["sharding_metadata"]["type"] == "DTensorShardingMetadata"
            listed[tc.flat_key(item, tuple(json.loads(path)))] = group["sharding_metadata"]["data"]
    assert sorted(listed) == sorted(written.tensors)
    for key, data in listed.items():
        assert data["global_shape"] == written.facts["tensors"][key]["shape"]
        assert data["placements"] == [{"type": "Replicate"}]
    assert meta["metadata"]["model"]["rank_to_layout_info"] == {0: None}
    assert meta["metadata"]["ema"]["rank_to_layout_info"] == {
        0: {
            "file_path": "ema_0.safetensors",
            "serialization_format": {
                "type": "SafetensorsSerialization",
                "metadata": {"producer": "tc-fixture"},
            },
        }
    }


def test_single_json_raw_and_safetensors_layouts_hold_the_written_bytes(
    tc_single_written: dict,
) -> None:
    written = tc_single_written["single"]
    config = {k.removeprefix("config."): v for k, v in written.objects[0].items()}
    text = (written.path / "config_0.json").read_text()
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=4)
    assert json.loads(text)["optimizer"]["betas"] == [config["optimizer.betas.0"], 0.999]
    assert (written.path / "extra" / "blob_0.bin").read_bytes() == tc.RAW_BLOB
    with safe_open(written.path / "ema_0.safetensors", "pt") as f:
        assert f.metadata() == {"producer": "tc-fixture"}
    ema = {f"ema.{k}": v for k, v in load_file(written.path / "ema_0.safetensors").items()}
    assert_same_tensors(ema, {k: v for k, v in written.tensors.items() if k.startswith("ema.")})


def test_single_hf_consolidation_equals_the_expected_ema(tc_single_written: dict) -> None:
    root = tc_single_written["single"].path.parent / "library-hf"
    index = json.loads((root / "ema.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"ema-00001-of-00001.safetensors"}
    got = {f"ema.{k}": v for k, v in load_file(root / "ema-00001-of-00001.safetensors").items()}
    want = {k: v for k, v in tc_single_written["single"].tensors.items() if k.startswith("ema.")}
    assert_same_tensors(got, want)


# --- uncommitted saves ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["single-uncommitted", "fsdp-uncommitted"])
def test_uncommitted_saves_leave_only_a_tmp_folder_with_the_written_values(
    name: str, tc_single_written: dict, tc_distributed_written: dict
) -> None:
    written = (tc_single_written | tc_distributed_written)[name]
    root = written.path.parent
    assert written.path.name.startswith("tmp_step_") and not written.facts["committed"]
    assert [p.name for p in root.iterdir() if p.is_dir()] == [written.path.name]
    for rank in range(written.world_size):
        tensors, objects = split_read(library_read(written.path, rank, written.world_size))
        assert_same_tensors(tensors, written.local[rank])
        assert objects == written.objects[rank]


# --- two gloo ranks ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fsdp", "hsdp", "fsdp-tp", "placements"])
def test_library_load_into_live_dtensors_equals_the_full_expected_values(
    name: str, tc_distributed_written: dict
) -> None:
    written = tc_distributed_written[name]
    assert written.facts["committed"] and not written.facts["metadata_pkl"]
    assert_same_tensors(written.library, written.tensors)


@pytest.mark.parametrize("name", tc.DISTRIBUTED)
def test_each_rank_file_holds_that_ranks_local_shards(
    name: str, tc_distributed_written: dict
) -> None:
    written = tc_distributed_written[name]
    assert sorted(written.facts["files"]) == sorted(
        str(p.relative_to(written.path)) for p in written.path.rglob("*") if p.is_file()
    )
    for rank in range(written.world_size):
        tensors, objects = split_read(library_read(written.path, rank, written.world_size))
        assert_same_tensors(tensors, written.local[rank])
        assert objects == written.objects[rank]
    if written.library_local is not None:
        for got, want in zip(written.library_local, written.local, strict=True):
            assert_same_tensors(got, want)


@pytest.mark.parametrize("name", tc.DISTRIBUTED)
def test_placements_and_torch_offsets_rebuild_the_full_values(
    name: str, tc_distributed_written: dict
) -> None:
    """The per-rank record (what metadata.pkl would store) plus torch's offset rule place
    every local shard inside the full tensor, and together they cover it."""
    written = tc_distributed_written[name]
    for key, fact in written.facts["tensors"].items():
        full = written.tensors[key]
        covered = torch.zeros(full.shape, dtype=torch.bool)
        for rank, record in enumerate(fact["shardings"]):
            if record is None:
                assert same(written.local[rank][key], full), key
                covered[...] = True
                continue
            index = global_indices(sharding(record), rank)
            assert same(take(full, index), written.local[rank][key]), (key, rank)
            mark(covered, index)
        assert bool(covered.all()), key


def test_strided_shard_rows_interleave_and_fsdp2_pads_rank_storages(
    tc_distributed_written: dict,
) -> None:
    strided = tc_distributed_written["placements"].facts["tensors"]["tensors.strided"]
    assert [global_indices(sharding(r), i)[0] for i, r in enumerate(strided["shardings"])] == [
        [0, 1, 3, 4],
        [2, 5],
    ]
    facts = tc_distributed_written["fsdp"].facts["tensors"]
    for key, fact in facts.items():
        if fact["shardings"][0] is None:
            continue
        rows, *rest = fact["shape"]
        chunk = math.ceil(rows / 2) * math.prod(rest)
        if key.startswith("model."):
            assert fact["local_storage_numels"] == [chunk, chunk], key
        else:
            numels = [math.prod(shape) for shape in fact["local_shapes"]]
            assert fact["local_storage_numels"] == numels, key
    assert facts["model.gain"]["local_shapes"] == [[1], [0]]
    assert facts["model.embed.weight"]["local_shapes"] == [[4, 4], [3, 4]]


def test_names_follow_the_item_and_nested_path_rule(tc_distributed_written: dict) -> None:
    fsdp = tc_distributed_written["fsdp"]
    assert {"model.embed.weight", "optimizer.state.embed.weight.exp_avg"} <= set(fsdp.tensors)
    assert [o["dataloader.cursor"] for o in fsdp.objects] == [100, 107]
    assert fsdp.objects[0]["optimizer._optimizer_state_format_version"] == 1
    assert "optimizer.state.1.exp_avg_sq" in tc_distributed_written["hsdp"].tensors
    assert "tensors.pair.0" in tc_distributed_written["placements"].tensors
