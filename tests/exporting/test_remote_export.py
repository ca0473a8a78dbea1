"""Exports from and to remote storage (moto's S3 on 127.0.0.1): the same files as from a
local copy, memory-bounded streaming copies, and remote targets that appear only whole."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import inspector
from inspector.errors import ExportError, StorageAccessError, UsageError
from tests.fixtures.servers import CountedServer
from tests.storage.uploads import uploaded

SHARD = "300KB"  # the FP8 demo's model weights in 2 shards


def split_safetensors(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header (parsed) and its data bytes."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + size]), raw[8 + size :]


def without_source(header: dict) -> dict:
    meta = {k: v for k, v in header.get("__metadata__", {}).items() if k != "source"}
    return {**header, "__metadata__": meta}


def test_export_from_s3_equals_the_local_export(s3_server: CountedServer, demo_dir: Path,
                                                tmp_path: Path) -> None:
    url = uploaded(s3_server, demo_dir / "fp8", "fp8")
    local = inspector.export(demo_dir / "fp8", tmp_path / "local", max_shard_size=SHARD,
                             progress=False)
    ck = inspector.open(url, s3_server.storage_options)
    s3_server.stats.reset()
    remote = inspector.export(ck, tmp_path / "remote", max_shard_size=SHARD, verify=False,
                              progress=False)
    model_items = sum(c.byte_length for e in ck.entries() if e.component == "model"
                      for c in e.chunks)
    assert s3_server.stats.bytes <= 1.1 * model_items  # each item once, plus its zip records
    assert [Path(p).name for p in remote.files] == [Path(p).name for p in local.files]
    assert len(local.files) == 2
    for ours, theirs in zip(remote.files, local.files, strict=True):
        (h1, d1), (h2, d2) = split_safetensors(Path(ours)), split_safetensors(Path(theirs))
        assert d1 == d2 and without_source(h1) == without_source(h2)
        assert h1["__metadata__"]["source"] == url
    assert Path(remote.index).read_bytes() == Path(local.index).read_bytes()


def test_export_to_s3_appears_whole(s3_server: CountedServer, demo_dir: Path,
                                    tmp_path: Path) -> None:
    source = uploaded(s3_server, demo_dir / "fp8", "fp8")
    target = s3_server.address("remote-tests/exports/fp8-hf")
    s3_server.stats.reset()
    result = inspector.export(source, target, max_shard_size=SHARD, progress=False,
                              storage_options=s3_server.storage_options)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert result.files == [f"{target}/{n}" for n in names]
    assert result.index == f"{target}/model.safetensors.index.json"
    assert result.verification is not None and result.verification.ok
    puts = [h.path.rsplit("/", 1)[1] for h in s3_server.stats.hits if h.method == "PUT"]
    assert puts == [*names, "model.safetensors.index.json"]  # the index last
    fs = s3_server.filesystem()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(target)) == sorted(
        [*names, "model.safetensors.index.json"])
    local = inspector.export(demo_dir / "fp8", tmp_path / "local", max_shard_size=SHARD,
                             progress=False)
    back = inspector.open(target, s3_server.storage_options)
    expected = {}
    for path in local.files:
        expected |= load_file(path)
    assert back.keys() == list(expected)
    for key, value in expected.items():
        assert torch.equal(back.read(key), value), key

    s3_server.stats.reset()
    with pytest.raises(ExportError, match="already exists; pass overwrite=True"):
        inspector.export(source, target, max_shard_size=SHARD, progress=False, verify=False,
                         storage_options=s3_server.storage_options)
    assert not [h for h in s3_server.stats.hits if h.method == "PUT"]
    again = inspector.export(source, target, max_shard_size=SHARD, overwrite=True,
                             verify=False, progress=False,
                             storage_options=s3_server.storage_options)
    assert again.files == result.files
    with pytest.raises(ExportError, match="overwrite a file of the source checkpoint"):
        inspector.export(back, target, overwrite=True, progress=False)
    with pytest.raises(ExportError, match="inside the source checkpoint"):
        inspector.export(source, source + "/export", progress=False,
                         storage_options=s3_server.storage_options)


def test_single_file_targets_and_refusals(s3_server: CountedServer, http_server: CountedServer,
                                          demo_dir: Path) -> None:
    source = inspector.open(uploaded(s3_server, demo_dir / "fp8", "fp8"),
                            s3_server.storage_options)
    target = s3_server.address("remote-tests/exports/fp8.pt")
    result = inspector.export(source, target, format="pt", progress=False,
                              target_options=s3_server.storage_options)
    assert result.files == [target] and result.index is None
    back = inspector.open(target, s3_server.storage_options)
    assert back.format == "torch-save" and len(back.keys()) == result.tensors
    with pytest.raises(UsageError, match="cannot write to http"):
        inspector.export(source, f"{http_server.url}/out", progress=False)


def test_a_failed_upload_leaves_nothing(s3_server: CountedServer, demo_dir: Path) -> None:
    source = inspector.open(uploaded(s3_server, demo_dir / "fp8", "fp8"),
                            s3_server.storage_options)
    target = s3_server.address("remote-tests/exports/refused")
    s3_server.faults.fail("*/refused/model-00002-of-00002.safetensors", 403, methods=["PUT"])
    with pytest.raises(StorageAccessError, match="access denied") as err:
        inspector.export(source, target, max_shard_size=SHARD, progress=False, verify=False,
                         storage_options=s3_server.storage_options)
    assert err.value.file == f"{target}/model-00002-of-00002.safetensors"
    assert not s3_server.filesystem().exists(target + "/model-00001-of-00002.safetensors")


def test_hf_folder_on_s3_to_dcp_finds_its_config(s3_server: CountedServer, torchtitan_models,
                                                  tmp_path: Path) -> None:
    """HF -> torchtitan DCP from a URL: the config.json beside the weights is read there, as
    it is for a local folder, and the tensors are those of the local export."""
    url = uploaded(s3_server, torchtitan_models.hf("llama3"), "hf-llama3")
    local = inspector.export(torchtitan_models.hf("llama3"), tmp_path / "local", format="dcp",
                             progress=False)
    remote = inspector.export(url, tmp_path / "remote", format="dcp", progress=False,
                              storage_options=s3_server.storage_options)
    assert remote.verification.ok and remote.arch == local.arch == "llama3"
    ours, theirs = inspector.open(tmp_path / "remote"), inspector.open(tmp_path / "local")
    assert ours.keys() == theirs.keys() and len(ours.keys()) == remote.tensors
    for key in theirs.keys():
        assert torch.equal(ours.read(key), theirs.read(key)), key
