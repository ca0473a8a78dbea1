"""Folders of shards: huggingface_hub output, DCP's HuggingFaceStorageWriter (one and two
processes), a torchtitan-style consolidated export, and how a folder's files are chosen."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import inspector
from inspector.dtypes import name_of
from inspector.errors import (
    CorruptCheckpointError,
    InspectorError,
    NotACheckpointError,
)
from tests.fixtures.damage import copy, edit_header, write_header
from tests.fixtures.formats import FLOAT8, distributed_state, same


def check_tensors(ck, state: dict) -> None:
    assert set(ck.keys()) == set(state)
    for key, want in state.items():
        entry = ck.entry(key)
        assert (entry.kind, entry.dtype, entry.shape, entry.error) == (
            "tensor",
            name_of(want.dtype),
            want.shape,
            None,
        ), key
        assert same(ck.read(key), want), key


def weight_map(folder: Path, index: str = "model.safetensors.index.json") -> dict[str, str]:
    return json.loads((folder / index).read_text())["weight_map"]


# --- huggingface_hub.save_torch_state_dict ---------------------------------------------------


def test_hub_sharded_safetensors(safetensors_written: dict) -> None:
    written = safetensors_written["sharded"]
    ck = inspector.open(written.path)
    mapping = weight_map(written.path)
    assert ck.format == "safetensors-sharded"
    assert len(set(mapping.values())) > 2
    assert ck.source_files == ("model.safetensors.index.json", *sorted(set(mapping.values())))
    check_tensors(ck, written.state)
    assert {ck.entry(k).files for k in ck.keys()} == {(mapping[k],) for k in ck.keys()}
    assert all(ck.entry(k).files == (mapping[k],) for k in ck.keys())
    assert ck.metadata["run"] == "7" and ck.metadata["format"] == "pt"
    assert int(ck.metadata["total_size"]) == sum(ck.entry(k).nbytes for k in ck.keys())
    assert f"found model.safetensors.index.json ({len(set(mapping.values()))} shards)" in (
        ck.describe_layout()
    )


def test_index_file_opens_the_same(safetensors_written: dict) -> None:
    folder = safetensors_written["sharded"].path
    by_index = inspector.open(folder / "model.safetensors.index.json")
    by_folder = inspector.open(folder)
    assert by_index.keys() == by_folder.keys()
    assert by_index.format == by_folder.format == "safetensors-sharded"
    assert torch.equal(by_index.read("zoo.int64"), by_folder.read("zoo.int64"))


def test_hub_sharded_bin(safetensors_written: dict) -> None:
    written = safetensors_written["bin-sharded"]
    ck = inspector.open(written.path)
    mapping = weight_map(written.path, "pytorch_model.bin.index.json")
    assert ck.format == "torch-save"
    assert ck.source_files[0] == "pytorch_model.bin.index.json"
    check_tensors(ck, written.state)
    assert all(ck.entry(k).files == (mapping[k],) for k in ck.keys())


# --- index and shards that disagree: reported, the rest readable ---------------------------


@pytest.fixture
def sharded_copy(safetensors_written: dict, tmp_path: Path) -> Path:
    return copy(safetensors_written["sharded"].path, tmp_path)


def test_index_line_with_missing_shard(sharded_copy: Path, safetensors_written: dict) -> None:
    mapping = weight_map(sharded_copy)
    gone = mapping["zoo.float32"]
    os.remove(sharded_copy / gone)
    ck = inspector.open(sharded_copy)
    lost = sorted(k for k, f in mapping.items() if f == gone)
    assert sorted(e.key for e in ck.entries() if e.error) == lost
    assert ck.facts("zoo.float32").error == f"shard {gone} is missing"
    with pytest.raises(CorruptCheckpointError, match=rf"'zoo\.float32'.*{gone} is missing"):
        ck.read("zoo.float32")
    kept = {k: v for k, v in safetensors_written["sharded"].state.items() if k not in lost}
    for key, want in kept.items():
        assert same(ck.read(key), want), key


def test_index_pointing_outside_the_folder(sharded_copy: Path, tmp_path: Path) -> None:
    outside = tmp_path / "evil.safetensors"
    save_file({"zoo.float32": torch.full((8, 6), 666.0)}, outside)
    index = json.loads((sharded_copy / "model.safetensors.index.json").read_text())
    index["weight_map"]["zoo.float32"] = "../evil.safetensors"
    (sharded_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    ck = inspector.open(sharded_copy)
    assert "outside the checkpoint folder" in ck.facts("zoo.float32").error
    with pytest.raises(InspectorError, match=r"'zoo\.float32'.*evil\.safetensors.*outside"):
        ck.read("zoo.float32")
    assert ck.read("zoo.int64").shape == (6, 8)


def test_shard_symlinked_out_of_the_folder(sharded_copy: Path, tmp_path: Path) -> None:
    mapping = weight_map(sharded_copy)
    shard = sharded_copy / mapping["zoo.bool"]
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    ck = inspector.open(sharded_copy)
    assert "outside the checkpoint folder" in ck.facts("zoo.bool").error


def test_tensor_missing_from_the_index(sharded_copy: Path, safetensors_written: dict) -> None:
    index = json.loads((sharded_copy / "model.safetensors.index.json").read_text())
    del index["weight_map"]["zoo.int8"]
    (sharded_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    ck = inspector.open(sharded_copy)
    assert "1 tensors are in shards but not in the index: zoo.int8" in ck.describe_layout()
    assert same(ck.read("zoo.int8"), safetensors_written["sharded"].state["zoo.int8"])


def test_index_line_naming_the_wrong_shard(sharded_copy: Path) -> None:
    mapping = weight_map(sharded_copy)
    other = next(f for f in mapping.values() if f != mapping["zoo.int16"])
    index = json.loads((sharded_copy / "model.safetensors.index.json").read_text())
    index["weight_map"]["zoo.int16"] = other
    (sharded_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    ck = inspector.open(sharded_copy)
    assert ck.facts("zoo.int16").error == (
        f"model.safetensors.index.json puts it in {other}, which does not hold it"
    )


def test_index_not_json(sharded_copy: Path) -> None:
    (sharded_copy / "model.safetensors.index.json").write_text('{"weight_map": {')
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors\.index\.json.*JSON"):
        inspector.open(sharded_copy)


def test_one_damaged_shard_header(sharded_copy: Path) -> None:
    mapping = weight_map(sharded_copy)
    shard = sharded_copy / mapping["zoo.float64"]
    write_header(shard, b"{not json", b"")
    ck = inspector.open(sharded_copy)
    assert "not valid JSON" in ck.facts("zoo.float64").error
    assert {e.key for e in ck.entries() if e.error} == {
        k for k, f in mapping.items() if f == mapping["zoo.float64"]
    }


# --- torch DCP with HuggingFaceStorageWriter ----------------------------------------------


@pytest.mark.parametrize("name", ["hf", "hf-two-files"])
def test_dcp_hf_writer_one_process(dcp_single_written: dict, name: str) -> None:
    written = dcp_single_written[name]
    ck = inspector.open(written.path)
    assert ck.format == "dcp-safetensors"
    files = sorted(set(weight_map(written.path).values()))
    assert len(files) == (2 if name == "hf-two-files" else 1)
    assert ck.source_files == ("model.safetensors.index.json", *files)
    check_tensors(ck, written.state)
    assert {ck.entry(f"zoo.{str(dt).removeprefix('torch.')}").dtype for dt in FLOAT8} == set(
        map(name_of, FLOAT8)
    )
    assert ck.metadata == {
        "format": "pt",
        "DCP_VERSION": "1.0",
        "total_size": ck.metadata["total_size"],
    }
    assert "DCP_SHARDING_INFO" in ck.describe_layout()


def test_dcp_hf_writer_two_processes(dcp_distributed_written: dict) -> None:
    written = dcp_distributed_written["hf-distributed"]
    ck = inspector.open(written.path)
    assert ck.format == "dcp-safetensors"
    shards = (
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
    )
    assert ck.source_files == shards
    check_tensors(ck, written.state)
    rows = ck.entry("layers.0.w.weight")  # 7 rows split 4 + 3
    assert [(c.offsets, c.sizes, c.file) for c in rows.chunks] == [
        ((0, 0), (4, 6), shards[0]),
        ((4, 0), (3, 6), shards[1]),
    ]
    assert [c.offsets for c in ck.entry("layers.0.e5m2").chunks] == [(0, 0), (0, 3)]
    assert len(ck.entry("norm.weight").chunks) == 1  # replicated: written once


def test_dcp_hf_writer_missing_rank_file(dcp_distributed_written: dict, tmp_path: Path) -> None:
    folder = copy(dcp_distributed_written["hf-distributed"].path, tmp_path)
    os.remove(folder / "shard-00001-model-00001-of-00001.safetensors")
    ck = inspector.open(folder)
    assert "chunks hold 18 of its 42 elements" in ck.facts("layers.0.w.weight").error
    with pytest.raises(CorruptCheckpointError, match=r"'layers\.0\.w\.weight'"):
        ck.read("layers.0.w.weight")
    state = distributed_state()
    readable = [e.key for e in ck.entries() if not e.error]
    assert readable and all(same(ck.read(k), state[k]) for k in readable)


def test_dcp_hf_writer_chunk_without_offsets(dcp_distributed_written: dict, tmp_path: Path) -> None:
    folder = copy(dcp_distributed_written["hf-distributed"].path, tmp_path)
    shard = folder / "shard-00002-model-00001-of-00001.safetensors"

    def forget(header: dict) -> None:
        info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        del info["counts"]
        header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)

    edit_header(shard, forget)
    ck = inspector.open(folder)
    assert "gives no saved_offsets" in ck.facts("counts").error
    assert same(ck.read("layers.0.cols"), distributed_state()["layers.0.cols"])


def test_torchtitan_hf_export_with_leftover_sharded(dcp_distributed_written: dict) -> None:
    written = dcp_distributed_written["hf-export"]
    assert (written.path / "sharded").is_dir()
    ck = inspector.open(written.path)
    assert ck.format == "safetensors-sharded"
    assert ck.source_files == (
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    )
    check_tensors(ck, written.state)
    assert "ignored leftover sharded/ folder (4 per-rank files" in ck.describe_layout()
    assert all(len(ck.entry(k).chunks) == 1 for k in ck.keys())


def test_only_the_sharded_folder_left(dcp_distributed_written: dict, tmp_path: Path) -> None:
    folder = tmp_path / "export"
    shutil.copytree(dcp_distributed_written["hf-export"].path / "sharded", folder / "sharded")
    ck = inspector.open(folder)
    assert ck.format == "dcp-safetensors"
    assert "using the per-rank files in sharded/" in ck.describe_layout()
    check_tensors(ck, dcp_distributed_written["hf-export"].state)


# --- choosing among a folder's files, by content --------------------------------------------


def test_safetensors_preferred_over_bin(tmp_path: Path) -> None:
    weights = {"w": torch.arange(6.0)}
    save_file(weights, tmp_path / "model.safetensors")
    torch.save(weights, tmp_path / "pytorch_model.bin")
    torch.save({"lr": 0.1}, tmp_path / "training_args.bin")
    ck = inspector.open(tmp_path)
    assert (ck.format, ck.source_files) == ("safetensors", ("model.safetensors",))
    notes = ck.describe_layout()
    assert "the folder's safetensors file: model.safetensors" in notes
    assert "also found pytorch_model.bin (ignored)" in notes
    assert "also found training_args.bin (ignored)" in notes


def test_pytorch_model_bin_picked_among_pickles(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    torch.save({"lr": 0.1}, tmp_path / "training_args.bin")
    ck = inspector.open(tmp_path)
    assert (ck.format, ck.source_files, ck.keys()) == ("torch-save", ("pytorch_model.bin",), ["w"])


def test_several_unrelated_pickles_refused(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "b.pt")
    with pytest.raises(NotACheckpointError, match=r"several torch\.save files.*a\.pt, b\.pt"):
        inspector.open(tmp_path)


def test_content_decides_not_the_extension(tmp_path: Path) -> None:
    save_file({"w": torch.arange(3.0)}, tmp_path / "weights.bin")
    torch.save({"v": torch.arange(2)}, tmp_path / "looks.safetensors")
    assert inspector.open(tmp_path / "weights.bin").format == "safetensors"
    assert inspector.open(tmp_path / "looks.safetensors").format == "torch-save"
    (tmp_path / "notes.pt").write_text("hello")
    with pytest.raises(NotACheckpointError, match=r"notes\.pt.*judged by its content"):
        inspector.open(tmp_path / "notes.pt")


def test_distcp_without_metadata(tmp_path: Path) -> None:
    (tmp_path / "__0_0.distcp").write_bytes(b"PK")
    with pytest.raises(NotACheckpointError, match=r"\.distcp files but no \.metadata"):
        inspector.open(tmp_path)


def hub_cache(source: Path, cache: Path, repo: str = "models--tiny--llama") -> Path:
    """Lay ``source``'s files out as the hub cache does: blobs, and a snapshot of links."""
    blobs, snapshot = cache / repo / "blobs", cache / repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        blob = blobs / f"blob{len(list(blobs.iterdir()))}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    return snapshot


def test_hub_cache_snapshot(safetensors_written: dict, tmp_path: Path) -> None:
    written = safetensors_written["sharded"]
    ck = inspector.open(hub_cache(written.path, tmp_path))
    assert ck.format == "safetensors-sharded"
    check_tensors(ck, written.state)


def test_hub_cache_link_to_another_repo_refused(safetensors_written: dict, tmp_path: Path) -> None:
    snapshot = hub_cache(safetensors_written["sharded"].path, tmp_path)
    other = hub_cache(safetensors_written["sharded"].path, tmp_path, "models--other--repo")
    shard = snapshot / weight_map(snapshot)["zoo.int8"]
    shard.unlink()
    shard.symlink_to((other / shard.name).resolve())
    ck = inspector.open(snapshot)
    assert "outside the checkpoint folder" in ck.facts("zoo.int8").error


def test_safetensors_index_preferred_over_bin_index(
    safetensors_written: dict, tmp_path: Path
) -> None:
    folder = tmp_path / "both"
    shutil.copytree(safetensors_written["sharded"].path, folder)
    for file in safetensors_written["bin-sharded"].path.iterdir():
        shutil.copyfile(file, folder / file.name)
    ck = inspector.open(folder)
    assert ck.format == "safetensors-sharded"
    notes = ck.describe_layout()
    assert "also found pytorch_model.bin.index.json (ignored)" in notes
    assert "also found pytorch_model-00001-of-00005.bin (ignored)" in notes
    assert not any(f.endswith(".bin") for f in ck.source_files)


def test_malformed_sharding_info(dcp_distributed_written: dict, tmp_path: Path) -> None:
    folder = copy(dcp_distributed_written["hf-distributed"].path, tmp_path)
    shard = folder / "shard-00002-model-00001-of-00001.safetensors"
    edit_header(shard, lambda h: h["__metadata__"].update(DCP_SHARDING_INFO="{oops"))
    intact = inspector.open(dcp_distributed_written["hf-distributed"].path)
    ck = inspector.open(folder)
    for entry in ck.entries():
        touched = shard.name in intact.entry(entry.key).files
        assert (entry.error is not None) == touched, entry.key
        assert not touched or f"{shard.name} gives no saved_offsets" in entry.error
    alone = inspector.open(shard)
    assert "DCP_SHARDING_INFO is malformed" in alone.describe_layout()
