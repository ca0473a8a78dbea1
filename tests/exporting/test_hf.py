"""HF architecture adapters against real consumers: torchtitan-named DCP checkpoints go to HF
names tensor by tensor and load into transformers with bit-identical logits; HF folders go
back to exactly what torchtitan's from_hf makes of them."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from inspector import dtypes
from inspector.errors import InspectorError
from inspector.exporting import hf
from tests.fixtures import torchtitan_models as tm

CASES = [
    (name, naming, layout) for name in tm.MODELS for naming in tm.NAMINGS for layout in tm.LAYOUTS
] + [("llama3", "torchtitan", "fsdp"), ("llama3", "torchtitan-2025", "fp8")]
DENSE = ("llama3", "qwen3")


def case_id(case: tuple) -> str:
    return "-".join(case)


def tensor_metadata(path: Path) -> dict[str, TensorStorageMetadata]:
    """Every tensor entry of a DCP checkpoint (model, optimizer, train_state, ...)."""
    entries = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: v for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}


def read_dcp(path: Path, keys, metas) -> dict[str, torch.Tensor]:
    """The named tensors, read by DCP itself (torchao imported for FP8 wrapper chunks)."""
    import torchao.float8  # noqa: F401

    state = {k: torch.empty(tuple(metas[k].size), dtype=metas[k].properties.dtype) for k in keys}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    return tm.hub_state(folder)


def checked_apply(plan: hf.Plan, read) -> dict[str, torch.Tensor]:
    """``apply_plan``, after checking every output's declared shape and dtype against what its
    transform really returns from its one source."""
    for output in plan.outputs:
        value = output.transform(read(output.source))
        declared = (output.shape, dtypes.to_torch(output.dtype))
        assert (tuple(value.shape), value.dtype) == declared, output.name
    return hf.apply_plan(plan, read)


def write_hf_folder(out: Path, weights: dict[str, torch.Tensor], config: dict) -> Path:
    from safetensors.torch import save_file

    out.mkdir()
    weights = {k: v.contiguous() for k, v in weights.items()}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), {k: v for k, v in info.items() if v}


@pytest.fixture(scope="module")
def reference_logits(torchtitan_models) -> dict[str, torch.Tensor]:
    """Logits of each original HF folder on the fixed token ids."""
    return {name: tm.logits(load_hf(torchtitan_models.hf(name))[0]) for name in tm.MODELS}


def exported(torchtitan_models, case: tuple, tmp_path: Path) -> tuple[hf.Plan, dict, Path]:
    """Plan ``case``'s checkpoint to HF (arch="auto"), run it, and write the HF folder."""
    name, naming, layout = case
    path = torchtitan_models.dcp(name, naming, layout)
    metas = tensor_metadata(path)
    plan = hf.to_hf(metas, torchtitan_models.config(name))
    sources = read_dcp(path, {o.source for o in plan.outputs}, metas)
    weights = checked_apply(plan, sources.__getitem__)
    return plan, weights, write_hf_folder(tmp_path / "hf", weights, plan.config)


# --- torchtitan -> HF ------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_export_loads_into_transformers_with_identical_logits(
    torchtitan_models, reference_logits, case, tmp_path
):
    name, naming, _ = case
    plan, _, folder = exported(torchtitan_models, case, tmp_path)
    assert (plan.arch, plan.naming, plan.direction) == (name, naming, "to_hf")
    model, problems = load_hf(folder)
    assert problems == {}
    assert torch.equal(tm.logits(model), reference_logits[name])


@pytest.mark.parametrize("name", DENSE)
def test_export_loads_strictly_into_a_fresh_model(
    torchtitan_models, reference_logits, name, tmp_path
):
    from transformers import AutoModelForCausalLM

    _, weights, _ = exported(torchtitan_models, (name, "torchtitan", "flat"), tmp_path)
    model = AutoModelForCausalLM.from_config(tm.hf_config(name), dtype=torch.float32).eval()
    if model.config.tie_word_embeddings:
        result = model.load_state_dict(weights, strict=False)
        assert (result.missing_keys, result.unexpected_keys) == (["lm_head.weight"], [])
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        model.load_state_dict(weights, strict=True)
    assert torch.equal(tm.logits(model), reference_logits[name])


@pytest.mark.parametrize("naming", tm.NAMINGS)
def test_export_leaves_out_training_state_tied_head_and_expert_bias(torchtitan_models, naming):
    qwen3 = tensor_metadata(torchtitan_models.dcp("qwen3", naming, "flat"))
    plan = hf.to_hf(qwen3, torchtitan_models.config("qwen3"))
    head = "lm_head.weight" if naming == "torchtitan" else "output.weight"
    assert "tied" in plan.left_out[head]
    assert plan.must_equal == ((head, "tok_embeddings.weight"),)
    pair = read_dcp(torchtitan_models.dcp("qwen3", naming, "flat"), plan.must_equal[0], qwen3)
    assert torch.equal(*pair.values())
    # the tensor entries only: lr_scheduler and dataloader state are bytes items
    assert {k.split(".")[0] for k in plan.left_out if k != head} == {"optimizer", "train_state"}
    assert "lm_head.weight" not in plan.tensors()
    moe = tensor_metadata(torchtitan_models.dcp("qwen3_moe", naming, "prefixed"))
    plan = hf.to_hf(moe, torchtitan_models.config("qwen3_moe"))
    bias = "expert_bias_E" if naming == "torchtitan" else "expert_bias"
    dropped = {k for k, why in plan.left_out.items() if "load-balancing" in why}
    assert dropped == {f"model.layers.{i}.moe.{bias}" for i in (0, 2)}


def test_experts_split_one_output_per_expert_from_one_source(torchtitan_models):
    metas = tensor_metadata(torchtitan_models.dcp("qwen3_moe", "torchtitan", "flat"))
    plan = hf.to_hf(metas, torchtitan_models.config("qwen3_moe"))
    source = "layers.2.moe.routed_experts.inner_experts.w2_EDF"
    outputs = [o for o in plan.outputs if o.source == source]
    assert [o.name for o in outputs] == [
        f"model.layers.2.mlp.experts.{e}.down_proj.weight" for e in range(4)
    ]
    assert {o.shape for o in outputs} == {(64, 48)}
    stacked = read_dcp(torchtitan_models.dcp("qwen3_moe", "torchtitan", "flat"), [source], metas)
    for e, output in enumerate(outputs):
        assert torch.equal(output.transform(stacked[source]), stacked[source][e])


def test_torchtitan_layout_is_what_torchtitans_llama3_computes(torchtitan_models, reference_logits):
    """The fixture's q/k rows are in torchtitan's RoPE order: torchtitan's own forward on them
    (reimplemented) gives HF's logits (float32 rounding apart)."""
    for naming in tm.NAMINGS:
        path = torchtitan_models.dcp("llama3", naming, "flat")
        metas = tensor_metadata(path)
        model_keys = [k for k in metas if k.split(".")[0] not in ("optimizer", "train_state")]
        state = read_dcp(path, model_keys, metas)
        got = tm.titan_llama3_logits(state, naming)
        torch.testing.assert_close(got, reference_logits["llama3"], rtol=0, atol=1e-5)


def test_sharded_and_fp8_fixtures_are_what_they_claim(torchtitan_models):
    fsdp = tensor_metadata(torchtitan_models.dcp("llama3", "torchtitan", "fsdp"))
    assert len(fsdp["layers.0.attention.qkv_linear.wq.weight"].chunks) == 2
    assert len(fsdp["optimizer.state.layers.0.feed_forward.w1.weight.exp_avg"].chunks) == 2
    fp8 = torchtitan_models.dcp("llama3", "torchtitan-2025", "fp8")
    for distcp in sorted(fp8.glob("*.distcp")):
        assert b"WeightWithDynamicFloat8CastTensor" in distcp.read_bytes()


# --- HF -> torchtitan ------------------------------------------------------------------------


@pytest.mark.parametrize("naming", tm.NAMINGS)
@pytest.mark.parametrize("name", tm.MODELS)
def test_from_hf_equals_torchtitans_from_hf(torchtitan_models, name, naming):
    """HF folder -> torchtitan names: the same tensors, bit for bit, as the saved checkpoint
    (made by torchtitan's from_hf, reimplemented); torchtitan's expert_bias, which HF has
    not, is written as torchtitan initialises it (zeros)."""
    folder = read_folder(torchtitan_models.hf(name))
    plan = hf.from_hf(folder, torchtitan_models.config(name), naming=naming)
    assert (plan.arch, plan.naming, plan.direction) == (name, naming, "from_hf")
    got = checked_apply(plan, folder.__getitem__)
    path = torchtitan_models.dcp(name, naming, "flat")
    metas = tensor_metadata(path)
    model_keys = [k for k in metas if k.split(".")[0] not in ("optimizer", "train_state")]
    saved = read_dcp(path, model_keys, metas)
    assert set(saved) == set(got)
    only = tm.torchtitan_only(name, naming)
    for key, value in got.items():
        expected = torch.zeros_like(saved[key]) if key in only else saved[key]
        assert torch.equal(value, expected), key


def test_from_hf_stacks_experts_as_pieces(torchtitan_models):
    folder = read_folder(torchtitan_models.hf("qwen3_moe"))
    plan = hf.from_hf(folder, torchtitan_models.config("qwen3_moe"), naming="torchtitan")
    target = "layers.0.moe.routed_experts.inner_experts.w1_EFD"
    pieces = [o for o in plan.outputs if o.name == target]
    assert [o.source for o in pieces] == [
        f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(4)
    ]
    assert [o.offsets for o in pieces] == [(e, 0, 0) for e in range(4)]
    assert {(o.shape, o.full_shape) for o in pieces} == {((1, 48, 64), (4, 48, 64))}
    assert plan.tensors()[target] == hf.TensorMeta((4, 48, 64), "float32")


@pytest.mark.parametrize("naming", tm.NAMINGS)
@pytest.mark.parametrize("name", tm.MODELS)
def test_hf_to_torchtitan_to_hf_is_the_identity(torchtitan_models, name, naming):
    folder = read_folder(torchtitan_models.hf(name))
    config = torchtitan_models.config(name)
    titan = checked_apply(hf.from_hf(folder, config, naming=naming), folder.__getitem__)
    back = checked_apply(hf.to_hf(titan, config), titan.__getitem__)
    assert set(back) == set(folder)
    for key, value in folder.items():
        assert torch.equal(back[key], value), key


def test_plans_pickle_for_worker_processes(torchtitan_models):
    folder = read_folder(torchtitan_models.hf("llama3"))
    plan = hf.from_hf(folder, torchtitan_models.config("llama3"))
    copy = pickle.loads(pickle.dumps(plan))
    first, again = hf.apply_plan(plan, folder.__getitem__), hf.apply_plan(copy, folder.__getitem__)
    assert all(torch.equal(first[k], again[k]) for k in first)
    wq = "layers.1.attention.qkv_linear.wq.weight"
    assert not torch.equal(first[wq], folder["model.layers.1.self_attn.q_proj.weight"])


# --- arch="auto" -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_detect_names_the_architecture_and_why(torchtitan_models, case):
    name, naming, layout = case
    found = hf.detect(tensor_metadata(torchtitan_models.dcp(name, naming, layout)))
    assert (found.arch.name, found.naming) == (name, naming)
    assert hf.NAMINGS[naming] in found.reason
    assert ("legacy model. prefix" in found.reason) == (layout == "prefixed")
    expected = {
        "llama3": ["not qwen3: no 'layers.{layer}.attention.q_norm.weight'"],
        "qwen3": ["layers.0.attention.q_norm.weight", "not qwen3_moe: no"],
        "qwen3_moe": ["layers.0.moe.router.gate.weight", "not qwen3: no rule for"],
        "deepseek_v3": ["layers.0.attention.wkv_a.weight", "not llama3: no rule for"],
    }[name]
    assert all(part in found.reason for part in expected), found.reason


@pytest.mark.parametrize("name", tm.MODELS)
def test_detect_hf_folders(torchtitan_models, name):
    found = hf.detect(read_folder(torchtitan_models.hf(name)))
    assert (found.arch.name, found.naming) == (name, "hf")
    assert "HF names" in found.reason


def test_detect_refuses_keys_of_no_known_architecture():
    keys = {"layers.0.attention.wqkv.weight": None, "tok_embeddings.weight": None}
    with pytest.raises(InspectorError, match=r"no known architecture.*wqkv.*pass arch="):
        hf.detect(keys)


# --- config facts: missing or contradicting the weights --------------------------------------


def llama3_metas(torchtitan_models) -> dict:
    return tensor_metadata(torchtitan_models.dcp("llama3", "torchtitan", "flat"))


def test_heads_that_do_not_divide_the_q_weight_are_refused(torchtitan_models):
    config = torchtitan_models.config("llama3") | {"num_attention_heads": 3}
    with pytest.raises(InspectorError, match=r"num_attention_heads=3 does not fit") as error:
        hf.to_hf(llama3_metas(torchtitan_models), config)
    assert error.value.key == "model.layers.0.self_attn.q_proj.weight"


def test_missing_kv_heads_is_refused_naming_the_field_and_argument(torchtitan_models):
    config = dict(torchtitan_models.config("llama3"))
    del config["num_key_value_heads"]
    with pytest.raises(InspectorError, match=r"needs num_key_value_heads .*2 heads.*hf_config"):
        hf.to_hf(llama3_metas(torchtitan_models), config)


def test_missing_heads_is_refused_naming_the_field_and_argument(torchtitan_models):
    with pytest.raises(InspectorError, match=r"llama3 export needs num_attention_heads.*hf_config"):
        hf.to_hf(llama3_metas(torchtitan_models), None)


@pytest.mark.parametrize(
    ("name", "change", "field"),
    [
        ("llama3", {"hidden_size": 32}, "hidden_size=32"),
        ("llama3", {"num_hidden_layers": 3}, "num_hidden_layers=3"),
        ("llama3", {"num_key_value_heads": 4}, "num_key_value_heads=4"),
        ("qwen3", {"head_dim": 8}, "head_dim=8"),
        ("qwen3", {"model_type": "llama"}, "model_type='llama'"),
        ("qwen3_moe", {"num_experts": 8}, "num_experts=8"),
        ("qwen3_moe", {"moe_intermediate_size": 64}, "moe_intermediate_size=64"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers=[0]"),
    ],
)
def test_config_contradicting_the_weights_names_the_field(torchtitan_models, name, change, field):
    metas = tensor_metadata(torchtitan_models.dcp(name, "torchtitan", "flat"))
    with pytest.raises(InspectorError, match=re.escape(f"hf_config {field}")):
        hf.to_hf(metas, torchtitan_models.config(name) | change)


def test_top_k_is_required_for_moe(torchtitan_models):
    metas = tensor_metadata(torchtitan_models.dcp("qwen3_moe", "torchtitan-2025", "flat"))
    config = dict(torchtitan_models.config("qwen3_moe"))
    del config["num_experts_per_tok"]
    with pytest.raises(InspectorError, match="qwen3_moe export needs num_experts_per_tok"):
        hf.to_hf(metas, config)


def test_untied_config_without_a_head_is_refused(torchtitan_models):
    folder = read_folder(torchtitan_models.hf("qwen3"))
    config = torchtitan_models.config("qwen3") | {"tie_word_embeddings": False}
    with pytest.raises(InspectorError, match="tie_word_embeddings is false"):
        hf.from_hf(folder, config)


def test_minimal_config_is_completed_from_the_shapes(torchtitan_models):
    full = torchtitan_models.config("qwen3_moe")
    minimal = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2}
    metas = tensor_metadata(torchtitan_models.dcp("qwen3_moe", "torchtitan", "flat"))
    plan = hf.to_hf(metas, minimal)
    derived = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "moe_intermediate_size",
        "head_dim",
        "mlp_only_layers",
        "tie_word_embeddings",
    )
    assert {k: plan.config[k] for k in derived} == {k: full[k] for k in derived}
    assert plan.config["num_experts"] == full["num_local_experts"] == 4
    assert plan.config["model_type"] == "qwen3_moe"
    assert plan.config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert any("rope_theta" in note for note in plan.notes)


def test_explicit_wrong_arch_names_a_key_it_cannot_map(torchtitan_models):
    metas = tensor_metadata(torchtitan_models.dcp("qwen3", "torchtitan", "flat"))
    with pytest.raises(InspectorError, match=r"no llama3 rule.*q_norm|no llama3 rule.*k_norm"):
        hf.to_hf(metas, torchtitan_models.config("qwen3"), arch="llama3")


def test_mixed_generations_are_refused(torchtitan_models):
    metas = dict(llama3_metas(torchtitan_models))
    metas["output.weight"] = metas["lm_head.weight"]
    with pytest.raises(InspectorError, match="no llama3 rule"):
        hf.get("llama3").to_hf(metas, torchtitan_models.config("llama3"))


def test_outputs_keep_the_source_dtype(torchtitan_models):
    folder = {k: v.bfloat16() for k, v in read_folder(torchtitan_models.hf("qwen3_moe")).items()}
    metas = {k: (tuple(v.shape), v.dtype) for k, v in folder.items()}
    plan = hf.from_hf(metas, torchtitan_models.config("qwen3_moe"), naming="torchtitan-2025")
    kept = {o.dtype for o in plan.outputs if "expert_bias" not in o.name}
    assert kept == {"bfloat16"}  # dtype names: planning needs no torch
    # torchtitan's zero routing bias is float32, as torchtitan registers it
    assert {o.dtype for o in plan.outputs if "expert_bias" in o.name} == {"float32"}
    got = checked_apply(plan, folder.__getitem__)
    stacked = torch.stack(
        [folder[f"model.layers.2.mlp.experts.{e}.up_proj.weight"] for e in range(4)]
    )
    assert torch.equal(got["layers.2.moe.experts.w3"], stacked)
