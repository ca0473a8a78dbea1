"""torch_checkpointing folders read against what their writers held (``full_tensor()``), the
library's own loads and its HF consolidation; damage named, the rest still readable."""

from __future__ import annotations

import os
import pickle
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import inspector
from inspector.errors import CorruptCheckpointError, UnfinishedSaveError, UnsafeCheckpointError
from inspector.formats import safe_pickle
from inspector.formats.torch_checkpointing import PerRank
from tests.conftest import run_python
from tests.fixtures import torch_checkpointing as tc
from tests.fixtures.formats import same

ASSEMBLED = ("fsdp", "hsdp", "fsdp-tp", "placements", "fsdp-uncommitted")


@pytest.fixture(scope="module")
def written(tc_single_written: dict, tc_distributed_written: dict) -> dict[str, tc.TcWritten]:
    return {**tc_single_written, **tc_distributed_written}


def copied(fixture: tc.TcWritten, tmp_path: Path) -> Path:
    """A private copy of the checkpoint folder, free to damage."""
    target = tmp_path / fixture.path.name
    shutil.copytree(fixture.path, target)
    return target


def object_keys(fixture: tc.TcWritten) -> set[str]:
    return {key for per_rank in fixture.objects for key in per_rank}


@pytest.mark.parametrize("name", [*tc.SINGLE, *ASSEMBLED])
def test_every_tensor_bit_exact_and_every_key_listed(written: dict, name: str) -> None:
    fixture = written[name]
    ck = inspector.open(fixture.path)
    assert (ck.format, ck.producer, ck.ranks) == (
        "torch-checkpointing",
        "torch_checkpointing",
        fixture.world_size,
    )
    assert set(ck.keys()) == set(fixture.tensors) | object_keys(fixture)
    for key, want in fixture.tensors.items():
        assert ck.entry(key).error is None, (key, ck.entry(key).error)
        assert same(ck.read(key), want), key
        if fixture.library is not None:  # the library's own load into live targets
            assert same(ck.read(key), fixture.library[key]), key


@pytest.mark.parametrize("name", [*tc.SINGLE, *tc.DISTRIBUTED])
def test_objects_equal_what_each_rank_saved(written: dict, name: str) -> None:
    fixture = written[name]
    ck = inspector.open(fixture.path)
    for key in object_keys(fixture):
        got = ck.read_object(key)
        for rank, saved in enumerate(fixture.objects):
            value = got[rank] if isinstance(got, PerRank) else got
            assert value == saved[key], (key, rank)
        differs = len({repr(saved[key]) for saved in fixture.objects}) > 1
        assert isinstance(got, PerRank) == differs, key


def test_keys_nested_paths_and_components(written: dict) -> None:
    ck = inspector.open(written["single"].path)
    assert ck.entry("optimizer.state.0.exp_avg").nested_path == ("optimizer", "state", 0, "exp_avg")
    assert ck.entry("model.embed.weight").nested_path == ("model", "embed.weight")
    assert ck.entry("ema.shadow.embed.weight").nested_path == ("ema", "shadow", "embed.weight")
    assert ck.entry("step").nested_path == ("step",) and ck.read_object("step") == 3
    assert ck.entry("optimizer.param_groups.0.betas.1").kind == "object"
    named = {"model": "model", "optimizer": "optimizer", "train_state": "train_state"}
    wanted = Counter(named.get(key.split(".")[0], "other") for key in ck.keys())
    assert ck.components() == dict(wanted) and wanted["model"] == 6
    assert ck.layout == "prefixed"
    assert ck.metadata == {
        "items": "config, ema, blob, model, optimizer, step, train_state",  # by file name
        "world_size": "1",
        "version": "2.0",
    }
    assert set(ck.source_files) == {*written["single"].facts["files"]}


def test_layouts_json_raw_and_safetensors(written: dict) -> None:
    ck = inspector.open(written["single"].path)
    assert ck.read_object("blob") == tc.RAW_BLOB
    assert ck.read_object("config.model.vocab") == 7
    assert ck.entry("ema.decay").files == ("ema_0.safetensors",)
    assert ck.byte_ranges("ema.shadow.embed.weight")[0].name == "ema_0.safetensors"


def test_hf_consolidation_matches(written: dict) -> None:
    """The library's own HF consolidation of the safetensors item, name for name."""
    fixture = written["single"]
    ck = inspector.open(fixture.path)
    consolidated = load_file(fixture.path.parent / "library-hf" / "ema-00001-of-00001.safetensors")
    assert consolidated
    for name, value in consolidated.items():
        assert same(ck.read(f"ema.{name}"), value), name


def test_fsdp_shards_padded_uneven_and_empty(written: dict) -> None:
    fixture = written["fsdp"]
    facts = fixture.facts["tensors"]["model.embed.weight"]
    assert facts["local_storage_numels"][1] > 3 * 4  # FSDP2 pads rank 1's storage
    ck = inspector.open(fixture.path)
    chunks = ck.entry("model.embed.weight").chunks
    assert [(c.offsets, c.sizes, c.file) for c in chunks] == [
        ((0, 0), (4, 4), "model_0.pt"),
        ((4, 0), (3, 4), "model_1.pt"),
    ]
    assert [c.file for c in ck.entry("model.gain").chunks] == ["model_0.pt"]  # rank 1: empty
    assert ck.entry("model.mask").files == ("model_0.pt",)  # plain: the lowest rank's copy
    ranges = ck.byte_ranges("model.embed.weight")
    assert [r.length for r in ranges] == [64, 48]


def test_interleaved_strided_shard_is_several_blocks(written: dict) -> None:
    ck = inspector.open(written["placements"].path)
    chunks = ck.entry("tensors.strided").chunks
    assert sorted((c.offsets[0], c.sizes[0], c.file) for c in chunks) == [
        (0, 2, "tensors_0.pt"),
        (2, 1, "tensors_1.pt"),
        (3, 2, "tensors_0.pt"),
        (5, 1, "tensors_1.pt"),
    ]
    assert ck.byte_ranges("tensors.strided") is None  # not one contiguous run per file
    assert [len(c.sizes) for c in ck.entry("tensors.scalar").chunks] == [0]


def test_replicated_copies_are_read_once(written: dict) -> None:
    ck = inspector.open(written["hsdp"].path)
    for key in written["hsdp"].tensors:
        assert len(ck.entry(key).chunks) == 1, key
    tp = inspector.open(written["fsdp-tp"].path)
    assert [c.file for c in tp.entry("model.embed.weight").chunks] == ["model_0.pt"]
    assert len(tp.entry("model.head.weight").chunks) == 2


def test_per_rank_safetensors_without_metadata(written: dict) -> None:
    """No metadata.pkl: the global shapes are unknown, each rank's local shard is its own key."""
    fixture = written["fsdp-safetensors"]
    ck = inspector.open(fixture.path)
    assert set(ck.keys()) == {
        f"{key}@rank{rank}" for rank, local in enumerate(fixture.local) for key in local
    } | {"step"}
    for rank, local in enumerate(fixture.local):
        for key, want in local.items():
            assert same(ck.read(f"{key}@rank{rank}"), want)
            assert same(ck.read(f"{key}@rank{rank}"), fixture.library_local[rank][key])
    assert any("<key>@rank<r>" in note for note in ck.source.notes)


def two_rank_metadata(fixture: tc.TcWritten) -> bytes:
    """The metadata.pkl torch_checkpointing 0.1.1 would write for this 2-rank safetensors save
    (its rank gather is CUDA-only, so CPU saves have none): the records each rank computed
    (expected.json), grouped as its metadata manager groups them, serialised by its own
    classes (``DistributedMetadata.to_dict``) and pickled as it pickles them."""
    from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
    from torch_checkpointing.distributed_metadata import (
        DistributedItemMetadata,
        DistributedMetadata,
        GlobalObjectMetadata,
        ShardingMetadata,
    )

    world = {"device_type": "cpu", "mesh_shape": [2], "mesh_data": [0, 1], "mesh_dim_names": None}
    records = {}
    for key, facts in fixture.facts["tensors"].items():
        if not key.startswith("model."):
            continue
        data = facts["shardings"][0] or {  # plain tensors: Replicate on the world mesh
            "global_shape": facts["shape"],
            "dtype": facts["dtype"],
            "stride": facts["local_strides"][0],
            "mesh_spec": world,
            "placements": [{"type": "Replicate"}],
        }
        mesh = {k: tuple(v) if isinstance(v, list) else v for k, v in data["mesh_spec"].items()}
        data = {**data, "mesh_spec": mesh}  # JSON made the library's tuples lists
        record = ShardingMetadata._unpack({"type": "DTensorShardingMetadata", "data": data})
        ranks = tuple(sorted(data["mesh_spec"]["mesh_data"]))
        records[(key.removeprefix("model."),)] = [GlobalObjectMetadata(record, ranks)]
    layouts = {r: LayoutInfo(f"model_{r}.safetensors", SafetensorsSerialization()) for r in (0, 1)}
    item = DistributedItemMetadata(records, layouts)
    return pickle.dumps(DistributedMetadata({"model": item}, world_size=2).to_dict())


def test_per_rank_safetensors_placed_by_two_rank_metadata(written: dict, tmp_path: Path) -> None:
    fixture = written["fsdp-safetensors"]
    path = copied(fixture, tmp_path)
    (path / "metadata.pkl").write_bytes(two_rank_metadata(fixture))
    ck = inspector.open(path)
    assert set(ck.keys()) == set(fixture.tensors) | {"step"}
    for key, want in fixture.tensors.items():
        assert same(ck.read(key), want), key
    assert [c.file for c in ck.entry("model.gain").chunks] == ["model_0.safetensors"]
    assert [c.file for c in ck.entry("model.mask").chunks] == ["model_0.safetensors"]


def test_version_1_metadata_and_default_records(written: dict, tmp_path: Path) -> None:
    """Version 1.0 (flat by whole path) and explicit-shard records read like version 2.0."""
    import json

    fixture = written["single"]
    path = copied(fixture, tmp_path)
    v2 = safe_pickle.load_plain((path / "metadata.pkl").read_bytes(), file="metadata.pkl")
    flat, layouts = {}, {}
    for item, entry in v2["metadata"].items():
        for key, groups in entry["nested_path_to_metadata"].items():
            flat[json.dumps([item, *json.loads(key)], separators=(",", ":"))] = groups
        for rank, layout in entry["rank_to_layout_info"].items():
            layouts.setdefault(str(rank), {})[item] = layout
    [group] = flat['["ema","shadow","embed.weight"]']
    group["sharding_metadata"] = {
        "type": "default_tensor_v1",
        "data": {
            "global_shape": [7, 4],
            "global_offsets": [[0, 0], [3, 0]],
            "local_offsets": [[0, 0], [3, 0]],
            "local_sizes": [[3, 4], [4, 4]],
            "dtype": "torch.float32",
        },
    }
    v1 = {"metadata": flat, "rank_to_layout_info_mappings": layouts, "world_size": 1}
    (path / "metadata.pkl").write_bytes(pickle.dumps(v1))
    ck = inspector.open(path)
    assert ck.metadata["version"] == "1.0"
    assert [c.offsets for c in ck.entry("ema.shadow.embed.weight").chunks] == [(0, 0), (3, 0)]
    for key, want in fixture.tensors.items():
        assert same(ck.read(key), want), key


def test_uncommitted_folder_is_named_and_the_run_root_skips_it(
    written: dict, tmp_path: Path
) -> None:
    ck = inspector.open(written["single-uncommitted"].path)
    assert any(note.startswith("uncommitted save") for note in ck.source.notes)
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(written["single-uncommitted"].path, run / "tmp_step_4")
    with pytest.raises(UnfinishedSaveError, match=r"did not finish: only uncommitted tmp_step_4/"):
        inspector.open(run)
    shutil.copytree(written["single"].path, run / "step_3")
    ck = inspector.open(run)
    assert ck.location == str(run / "step_3")
    assert "ignored tmp_step_4/: a save that was never committed" in ck.source.notes


def test_one_rank_file_alone_says_it_holds_a_shard(written: dict) -> None:
    ck = inspector.open(written["fsdp"].path / "model_1.pt")
    assert ck.format == "torch-save"
    assert "holds one rank's shard of [3, 4]" in ck.entry("embed.weight").error
    with pytest.raises(CorruptCheckpointError, match=r"'embed\.weight'.*open the folder"):
        ck.read("embed.weight")
    assert same(ck.read("mask"), written["fsdp"].tensors["model.mask"])
    whole = inspector.open(written["hsdp"].path / "model_1.pt")  # replicated: whole copies
    assert same(whole.read("embed.weight"), written["hsdp"].tensors["model.embed.weight"])


def test_opening_needs_no_torch(written: dict) -> None:
    code = (
        "import sys, inspector\nck = inspector.open(sys.argv[1])\nck.tree().children\n"
        "print(sorted(m for m in ('torch', 'pandas') if m in sys.modules))\n"
    )
    for name in ("single", "fsdp-tp"):
        result = run_python(code, str(written[name].path))
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[-1] == "[]"


# --- bad input ------------------------------------------------------------------------------


class _Payload:
    """Unpickling this would create ``marker``: it must never run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("payload", ["code", "harmless global"])
def test_metadata_pkl_naming_any_global_is_refused(
    written: dict, tmp_path: Path, payload: str
) -> None:
    path = copied(written["single"], tmp_path)
    marker = tmp_path / "ran"
    real = safe_pickle.load_plain((path / "metadata.pkl").read_bytes(), file="metadata.pkl")
    from collections import OrderedDict

    real["metadata"]["model"]["extra"] = _Payload(marker) if payload == "code" else OrderedDict()
    (path / "metadata.pkl").write_bytes(pickle.dumps(real))
    with pytest.raises(UnsafeCheckpointError, match=r"metadata\.pkl.*plain data only"):
        safe_pickle.load_plain(
            (path / "metadata.pkl").read_bytes(), file=str(path / "metadata.pkl")
        )
    ck = inspector.open(path)
    assert not marker.exists()
    [note] = [n for n in ck.source.notes if n.startswith("metadata.pkl not used")]
    assert "metadata.pkl" in note and ("system" in note or "OrderedDict" in note)
    for key, want in written["single"].tensors.items():  # still browsable
        assert same(ck.read(key), want), key


def test_a_record_that_does_not_tile_the_tensor(written: dict, tmp_path: Path) -> None:
    path = copied(written["single"], tmp_path)
    meta = safe_pickle.load_plain((path / "metadata.pkl").read_bytes(), file="metadata.pkl")
    [group] = meta["metadata"]["ema"]["nested_path_to_metadata"]['["shadow","embed.weight"]']
    group["sharding_metadata"]["data"]["global_shape"] = [9, 4]
    (path / "metadata.pkl").write_bytes(pickle.dumps(meta))
    ck = inspector.open(path)
    error = ck.entry("ema.shadow.embed.weight").error
    assert "metadata.pkl" in error and "[7, 4]" in error and "[9, 4]" in error
    with pytest.raises(CorruptCheckpointError, match=r"'ema\.shadow\.embed\.weight'.*\[9, 4\]"):
        ck.read("ema.shadow.embed.weight")
    assert same(
        ck.read("ema.shadow.head.weight"), written["single"].tensors["ema.shadow.head.weight"]
    )


def test_dtensor_pieces_that_do_not_tile(written: dict, tmp_path: Path) -> None:
    """Rank 0's model file copied over rank 1's: two claims on rows 0-3, nobody holds 4-6."""
    path = copied(written["fsdp"], tmp_path)
    shutil.copy(path / "model_0.pt", path / "model_1.pt")
    ck = inspector.open(path)
    error = ck.entry("model.embed.weight").error
    assert "do not tile" in error and "16 elements, the tensor has 28" in error
    with pytest.raises(CorruptCheckpointError, match=r"'model\.embed\.weight'.*do not tile"):
        ck.read("model.embed.weight")
    want = written["fsdp"].tensors
    assert same(
        ck.read("optimizer.state.embed.weight.exp_avg"),
        want["optimizer.state.embed.weight.exp_avg"],
    )


def test_missing_rank_file(written: dict, tmp_path: Path) -> None:
    path = copied(written["fsdp"], tmp_path)
    os.remove(path / "model_1.pt")
    ck = inspector.open(path)
    assert "item 'model': rank 1's file model_1.pt is missing" in ck.source.notes
    for key in ("model.embed.weight", "model.proj.weight", "model.head.weight"):
        assert "rank 1's file model_1.pt is missing" in ck.entry(key).error, key
        with pytest.raises(CorruptCheckpointError, match=rf"'{key}'.*model_1\.pt is missing"):
            ck.read(key)
    want = written["fsdp"].tensors
    assert same(ck.read("model.mask"), want["model.mask"])
    assert same(
        ck.read("optimizer.state.proj.weight.exp_avg"), want["optimizer.state.proj.weight.exp_avg"]
    )


def test_unsafe_item_file_spoils_only_its_keys(written: dict, tmp_path: Path) -> None:
    path = copied(written["fsdp"], tmp_path)
    marker = tmp_path / "ran"
    torch.save({"rank": _Payload(marker)}, path / "dataloader_1.pt")
    ck = inspector.open(path)
    assert not marker.exists()
    assert any("dataloader_1.pt" in n and "could run code" in n for n in ck.source.notes)
    assert ck.read_object("dataloader.cursor") == 100  # only rank 0's file is left
    assert same(ck.read("model.embed.weight"), written["fsdp"].tensors["model.embed.weight"])


# --- the layers above formats/ work on it unchanged ------------------------------------------


def test_export_safetensors_and_pt(written: dict, tmp_path: Path) -> None:
    fixture = written["fsdp-tp"]
    ck = inspector.open(fixture.path)
    model = {
        k.removeprefix("model."): v for k, v in fixture.tensors.items() if k.startswith("model.")
    }
    inspector.export(ck, tmp_path / "st", progress=False)
    exported = load_file(tmp_path / "st" / "model.safetensors")
    assert set(exported) == set(model)
    assert all(same(exported[k], v) for k, v in model.items())
    inspector.export(ck, tmp_path / "model.pt", format="pt", progress=False)
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(loaded) == set(model) and all(same(loaded[k], v) for k, v in model.items())


def test_doctor_diff_stats_and_cli(written: dict, capsys: pytest.CaptureFixture) -> None:
    import json

    from inspector.ui.cli import main

    fsdp = inspector.open(written["fsdp"].path)
    report = inspector.check_keys(fsdp, tc.TinyNet())
    assert (report.missing, report.unexpected) == ([], [])
    table = inspector.diff(fsdp, written["fsdp-uncommitted"].path, progress=False)
    rows = table.set_index("key")["status"].to_dict()
    assert {rows[k] for k in written["fsdp"].tensors if k.startswith("model.")} == {"same"}
    assert rows["optimizer.state.gain.exp_avg"] == "only_a"
    want = written["fsdp"].tensors["model.head.weight"]
    stats = fsdp.stats("model.head.weight")
    assert (stats.min, stats.max, stats.zeros) == (want.min().item(), want.max().item(), 0)
    assert main(["ls", "--json", str(written["placements"].path)]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert (payload["format"], payload["producer"]) == (
        "torch-checkpointing",
        "torch_checkpointing",
    )
    rows = {row["key"]: row for row in payload["entries"]}
    assert rows["tensors.strided"]["shape"] == [6, 4] and rows["tensors.strided"]["chunks"] == 4


def test_raw_and_json_items_without_metadata_are_detected(written: dict, tmp_path: Path) -> None:
    """No ``metadata.pkl``, a raw-bytes ``blob_0.bin`` and a ``config_0.json`` beside the
    ``.pt`` items: still a torch_checkpointing folder, each item read by its file's kind."""
    path = copied(written["single"], tmp_path)
    (path / "metadata.pkl").unlink()
    (path / "extra" / "blob_0.bin").rename(path / "blob_0.bin")
    ck = inspector.open(path)
    assert (ck.format, ck.producer) == ("torch-checkpointing", "torch_checkpointing")
    assert ck.read_object("blob") == tc.RAW_BLOB
    assert ck.read_object("config.model.vocab") == 7
    assert same(ck.read("model.proj.weight"), written["single"].tensors["model.proj.weight"])
