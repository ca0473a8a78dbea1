"""Megatron-Core ``torch_dist`` checkpoints (committed fixtures written by megatron-core's own
``dist_checkpointing.save``, see tests/fixtures/megatron/generate.py) read against what the
generator handed the writer. Megatron itself is not imported: it is not installed here."""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import shutil
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from safetensors.torch import load_file

import inspector
from inspector.errors import UnsafeCheckpointError
from inspector.formats import safe_pickle
from inspector.formats.safe_pickle import Opaque
from inspector.formats.safe_pickle.stdlib import EnumMember, Namespace
from tests.conftest import run_python
from tests.fixtures.formats import same

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
LABELS = {
    "tp1": FIXTURES / "tp1",
    "tp2": FIXTURES / "tp2",
    "legacy_common": FIXTURES / "legacy_common",
    "run_iter_0000001": FIXTURES / "run" / "iter_0000001",
    "run_iter_0000003": FIXTURES / "run" / "iter_0000003",
}


def expected(label: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return (
        load_file(FIXTURES / "expected" / f"{label}.safetensors"),
        json.loads((FIXTURES / "expected" / f"{label}.json").read_text()),
    )


def common_key(ck: inspector.Checkpoint) -> str:
    return next(k for k in ck.keys() if k.startswith("common_state/") or k == "common.pt")


def matches(got: Any, want: Any) -> bool:
    """A decoded value against the generator's JSON rendering of the saved value."""
    if isinstance(want, dict) and "__tensor__" in want:
        raw = got.reshape(-1).contiguous().view(torch.uint8).numpy()
        return (
            isinstance(got, torch.Tensor)
            and (str(got.dtype), list(got.shape)) == (want["__tensor__"], want["shape"])
            and hashlib.sha256(raw).hexdigest() == want["sha256"]
        )
    if isinstance(want, dict) and "__ndarray__" in want:  # decoded as numpy's own array
        return (
            isinstance(got, numpy.ndarray)
            and (str(got.dtype), list(got.shape)) == (want["__ndarray__"], want["shape"])
            and hashlib.sha256(got.tobytes(order="A")).hexdigest() == want["sha256"]
        )
    if isinstance(want, dict) and "__sequence__" in want:
        items = json.dumps(list(got)).encode()
        return (type(got).__name__, len(got), hashlib.sha256(items).hexdigest()) == (
            want["__sequence__"],
            want["length"],
            want["sha256"],
        )
    if isinstance(want, dict) and want.get("__class__") == "argparse.Namespace":
        fields = {k: v for k, v in want.items() if k != "__class__"}
        return isinstance(got, Namespace) and matches(dict(got.fields), fields)
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and sorted(map(str, got)) == sorted(want)
            and all(matches(v, want[str(k)]) for k, v in got.items())
        )
    if isinstance(want, list):
        return (
            isinstance(got, (list, tuple))
            and len(got) == len(want)
            and all(matches(g, w) for g, w in zip(got, want, strict=True))
        )
    if isinstance(got, EnumMember):
        return repr(got) == want
    if isinstance(got, Opaque):  # an enum of megatron's: its class, called with its value
        return want.rsplit(".", 1)[0] == got.global_name and len(got.args) == 1
    if isinstance(got, torch.dtype):
        return str(got) == want
    if isinstance(got, float) and not math.isfinite(got):
        return repr(got) == want
    return type(got) is type(want) and got == want


@pytest.mark.parametrize("label", list(LABELS))
def test_every_tensor_bit_exact(label: str) -> None:
    tensors, facts = expected(label)
    ck = inspector.open(LABELS[label])
    assert (ck.format, ck.producer, ck.ranks) == ("dcp", "megatron-core", facts["world_size"])
    assert {e.key for e in ck.entries() if e.kind == "tensor"} == set(tensors)
    for key, want in tensors.items():
        entry = ck.entry(key)
        assert sorted((c.offsets, c.sizes) for c in entry.chunks) == sorted(
            (tuple(c["offsets"]), tuple(c["sizes"])) for c in facts["tensors"][key]["chunks"]
        ), key
        assert same(ck.read(key), want), key


@pytest.mark.parametrize("label", list(LABELS))
def test_sharded_objects_and_common_state(label: str) -> None:
    _, facts = expected(label)
    ck = inspector.open(LABELS[label])
    objects = {e.key for e in ck.entries() if e.kind == "object"}
    assert objects == {*facts["objects"], common_key(ck)}
    for key, want in facts["objects"].items():
        assert matches(ck.read_object(key), want), key
    common = ck.read_object(common_key(ck))
    assert matches(common, facts["common_state"])
    args = common["args"]
    assert isinstance(args, Namespace) and args.num_layers == 2
    assert args.tensor_model_parallel_size == facts["shown"]["args"]["tensor_model_parallel_size"]
    with pytest.raises(TypeError, match="immutable"):
        args.num_layers = 3


@pytest.mark.parametrize("label", list(LABELS))
def test_metadata_shows_the_run(label: str) -> None:
    _, facts = expected(label)
    ck = inspector.open(LABELS[label])
    shown = facts["shown"]
    for name in ("iteration", "checkpoint_version", "num_floating_point_operations_so_far"):
        assert ck.metadata[name] == str(shown[name]), name
    for name, value in shown["args"].items():
        assert ck.metadata[f"args.{name}"] == str(value), name
    assert "6 decoder.layers.* tensors are stacked over 2 layers" in " ".join(ck.source.notes)
    assert ck.entry("decoder.layers.self_attention.linear_qkv.weight").shape == (2, 48, 16)


def test_components() -> None:
    ck = inspector.open(LABELS["tp2"])
    assert ck.components() == {"model": 17, "optimizer": 18, "common": 3, "rng": 2}
    assert ck.entry("rng_state/shard_0.1_1.2").nested_path == ("rng_state", "shard_0.1_1.2")
    extra = "decoder.layers.mlp.linear_fc1._extra_state/shard_1_2"
    assert ck.entry(extra).component == "model"
    assert ck.entry("optimizer.state.exp_avg.output_layer.weight").component == "optimizer"
    legacy = inspector.open(LABELS["legacy_common"])
    assert legacy.entry("common.pt").component == "common"
    assert legacy.components() == {"model": 17, "optimizer": 18, "common": 1, "rng": 1}


def test_all_local_plans_decode_as_inert_records() -> None:
    md = safe_pickle.load_metadata((LABELS["tp1"] / ".metadata").read_bytes(), file=".metadata")
    [plan] = md.all_local_plans
    kinds = [item.type.name for item in plan.items]
    assert (kinds.count("SHARD"), kinds.count("BYTE_IO")) == (51, 11)
    shard = next(item for item in plan.items if item.type.name == "SHARD")
    index = shard.index
    assert index.fqn == "embedding.word_embeddings.weight" and index.offset == (0, 0)
    chunks = md.state_dict_metadata[index.fqn].chunks
    assert shard.tensor_data.chunk is chunks[0]  # memo-shared with the metadata table
    byte_item = next(item for item in plan.items if item.type.name == "BYTE_IO")
    assert byte_item.index.offset is None  # absent from the pickle: the stand-in's default
    info = next(iter(md.storage_data.values()))
    assert info.transform_descriptors is None


def test_planner_records_pass_only_in_metadata() -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import SavePlan

    decoded = safe_pickle.load_data_pickle(pickle.dumps(SavePlan(items=[])), file="data.pkl")
    assert isinstance(decoded, Opaque)  # a placeholder in data.pkl, never the stand-in
    md = FileSystemReader(str(LABELS["tp1"])).read_metadata()
    md.all_local_plans = [__import__("argparse").Namespace(x=1)]
    with pytest.raises(UnsafeCheckpointError, match=r"argparse\.Namespace"):
        safe_pickle.load_metadata(pickle.dumps(md), file=".metadata")


def test_opening_needs_no_torch() -> None:
    code = (
        "import sys, inspector\nck = inspector.open(sys.argv[1])\nck.tree().children\n"
        "print(ck.metadata['iteration'], sorted(m for m in ('torch',) if m in sys.modules))\n"
    )
    result = run_python(code, str(LABELS["tp2"]))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "2 []"


def test_damaged_common_state_is_a_note(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    shutil.copytree(LABELS["legacy_common"], path)
    (path / "common.pt").write_bytes(b"PK\x03\x04 not a zip")
    ck = inspector.open(path)
    assert any(
        n.startswith("the common state common.pt cannot be decoded") for n in ck.source.notes
    )
    assert "iteration" not in ck.metadata
    tensors, _ = expected("legacy_common")
    assert same(ck.read("output_layer.weight"), tensors["output_layer.weight"])


# --- the layers above formats/ work on it unchanged ------------------------------------------


def test_export_safetensors_and_pt(tmp_path: Path) -> None:
    tensors, _ = expected("tp2")
    model = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    ck = inspector.open(LABELS["tp2"])
    inspector.export(ck, tmp_path / "st", progress=False)
    exported = load_file(tmp_path / "st" / "model.safetensors")
    assert set(exported) == set(model) and all(same(exported[k], v) for k, v in model.items())
    inspector.export(ck, tmp_path / "model.pt", format="pt", progress=False)
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(same(loaded[k], v) for k, v in model.items())
    extra = {k: v for k, v in loaded.items() if k not in model}  # modules' extra state, kept
    assert extra and all("._extra_state/shard_" in k and v is None for k, v in extra.items())


def test_doctor_diff_stats_and_cli(capsys: pytest.CaptureFixture) -> None:
    from inspector.ui.cli import main

    tensors, facts = expected("tp1")
    ck = inspector.open(LABELS["tp1"])
    # What GPTModel.sharded_state_dict() names: its tensors and its modules' extra state.
    model = [k for k in [*tensors, *facts["objects"]] if k.startswith(("decoder.", "embedding."))]
    model += ["output_layer.weight"]
    report = inspector.check_keys(ck, model)
    assert (report.missing, report.unexpected) == ([], [])
    table = inspector.diff(LABELS["tp1"], LABELS["tp2"], progress=False)  # TP=1 and TP=2
    rows = table.set_index("key")["status"].to_dict()
    assert {rows[k] for k in tensors} == {"same"}
    stats = ck.stats("embedding.word_embeddings.weight")
    want = tensors["embedding.word_embeddings.weight"]
    assert (stats.min, stats.max) == (want.min().item(), want.max().item())
    assert main(["ls", "--json", str(FIXTURES / "run")]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["producer"] == "megatron-core" and payload["path"].endswith("iter_0000003")
    assert payload["metadata"]["iteration"] == "3"


@pytest.mark.parametrize("label", ["tp1", "tp2", "run_iter_0000003"])
def test_run_args_are_the_saved_args_plain_values(label) -> None:
    _, description = expected(label)
    saved = {k: v for k, v in description["common_state"]["args"].items() if k != "__class__"}
    args = inspector.open(LABELS[label]).run_args
    plain = {k: v for k, v in saved.items() if isinstance(v, (bool, int, float, str, type(None)))}
    assert len(args) > 700 and set(args) <= set(plain)  # enums and containers left out
    for key, value in args.items():  # dtypes by name (the JSON writes "torch.float32")
        assert value == plain[key] or plain[key] == f"torch.{value}", key
    assert args["params_dtype"] == "float32"
    assert args["num_layers"] == 2 and args["untie_embeddings_and_output_weights"] is True
