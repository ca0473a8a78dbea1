"""Megatron-Core GPT <-> Hugging Face (``format="hf"`` from torch_dist, ``format="megatron"``
back), against the HF models Megatron's checkpoints were written from: real
``save_checkpoint`` outputs at TP=1, TP=2, PP=2 and EP=2, tied and untied, bf16 and fp32,
Llama, Qwen3, Qwen2 (QKV biases), Qwen3-MoE, Mixtral and Qwen2-MoE (shared expert)
(tests/fixtures/megatron/generate_from_hf.py). Megatron itself is not imported here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import inspector
from inspector.errors import ExportError
from inspector.exporting.hf import megatron_gpt
from inspector.exporting.hf.base import TensorMeta
from inspector.ui.cli import main
from tests.conftest import run_python

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron" / "from_hf"
SCENARIOS = {
    "untied_bf16_tp1": "untied_bf16",
    "untied_bf16_tp2": "untied_bf16",
    "untied_bf16_pp2": "untied_bf16",
    "tied_fp32_tp1": "tied_fp32",
    "qwen3_fp32_tp1": "qwen3_fp32",
    "qwen2_fp32_tp1": "qwen2_fp32",
    "qwen3_moe_fp32_tp1": "qwen3_moe_fp32",
    "qwen3_moe_fp32_ep2": "qwen3_moe_fp32",
    "mixtral_bf16_tp2": "mixtral_bf16",
    "qwen2_moe_fp32_tp1": "qwen2_moe_fp32",
}
MOE_ARGS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax",
            "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")  # fmt: skip
MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
              "norm_topk_prob", "shared_expert_intermediate_size", "qkv_bias")  # fmt: skip
TOKENS = torch.arange(0, 240, 15).reshape(1, 16) % 250


def logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        return model.eval()(TOKENS).logits


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple[Path, inspector.ExportResult]]:
    root = tmp_path_factory.mktemp("megatron_hf")
    return {
        name: (root / name, inspector.export(FIXTURES / name, root / name, format="hf"))
        for name in SCENARIOS
    }


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_tensor_is_the_original_hf_models(exports, name) -> None:
    ours = load_file(exports[name][0] / "model.safetensors")
    original = load_file(FIXTURES / f"hf_{SCENARIOS[name]}" / "model.safetensors")
    assert sorted(ours) == sorted(original)
    for key, want in original.items():
        got = ours[key]
        # Megatron's bf16 runs keep their norms in float32 (the local spec's torch norms)
        expected_dtype = torch.float32 if key.endswith("norm.weight") else want.dtype
        assert got.dtype == expected_dtype and torch.equal(got, want.to(got.dtype)), key


def test_a_bfloat16_export_is_the_original_bit_for_bit(tmp_path) -> None:
    inspector.export(FIXTURES / "untied_bf16_pp2", tmp_path, format="hf", dtype="bfloat16")
    ours = load_file(tmp_path / "model.safetensors")
    original = load_file(FIXTURES / "hf_untied_bf16" / "model.safetensors")
    assert ours.keys() == original.keys()
    assert all(ours[k].dtype == v.dtype and torch.equal(ours[k], v) for k, v in original.items())


@pytest.mark.parametrize(
    "name",
    ["untied_bf16_tp2", "tied_fp32_tp1", "qwen3_fp32_tp1", "qwen2_fp32_tp1",
     "qwen3_moe_fp32_ep2", "mixtral_bf16_tp2", "qwen2_moe_fp32_tp1"],
)  # fmt: skip
def test_from_pretrained_gives_the_original_logits(exports, name) -> None:
    assert torch.equal(logits(exports[name][0]), logits(FIXTURES / f"hf_{SCENARIOS[name]}"))


@pytest.mark.parametrize(
    ("name", "tp1"),
    [("untied_bf16_tp2", "untied_bf16_tp1"), ("untied_bf16_pp2", "untied_bf16_tp1"),
     ("qwen3_moe_fp32_ep2", "qwen3_moe_fp32_tp1")],
)  # fmt: skip
def test_tp2_pp2_and_ep2_exports_equal_tp1(exports, name, tp1) -> None:
    ours, theirs = (_header_and_data(exports[n][0] / "model.safetensors") for n in (name, tp1))
    assert ours == theirs


def test_tp1_exports_and_their_verification_never_import_torch(exports, tmp_path) -> None:
    """At TP=1 every HF tensor is a byte range of a stored chunk (a layer, an expert, a QKV
    part's rows per group): a fresh process exports and verifies a dense and an MoE run
    without importing torch, and writes the files an export with torch loaded writes."""
    names = ("untied_bf16_tp1", "qwen3_moe_fp32_tp1")
    code = (
        "import sys, inspector\n"
        "for source, out in zip(sys.argv[1::2], sys.argv[2::2]):\n"
        "    r = inspector.export(source, out, format='hf', progress=False)\n"
        "    assert r.arch == 'megatron_gpt' and r.verification.ok, r.summary()\n"
        "print('torch' in sys.modules)\n"
    )
    done = run_python(code, *(str(p) for n in names for p in (FIXTURES / n, tmp_path / n)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]
    for name in names:
        ours, theirs = tmp_path / name, exports[name][0]
        assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
        assert (ours / "config.json").read_text() == (theirs / "config.json").read_text()
        assert _header_and_data(ours / "model.safetensors") == _header_and_data(
            theirs / "model.safetensors"
        )


def _header_and_data(path: Path) -> tuple[dict, bytes]:
    """The file's header with its source path left out, and its data bytes."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    del header["__metadata__"]["source"]
    return header, raw[8 + size :]


@pytest.mark.parametrize("name", SCENARIOS)
def test_config_comes_from_the_runs_args(exports, name) -> None:
    config = json.loads((exports[name][0] / "config.json").read_text())
    original = json.loads((FIXTURES / f"hf_{SCENARIOS[name]}" / "config.json").read_text())
    fields = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size", "rms_norm_eps", "tie_word_embeddings",
              "max_position_embeddings", "head_dim", "model_type")  # fmt: skip
    # Qwen2's config has no head_dim, Mixtral's head_dim None: hidden / heads
    given = [k for k in (*fields, *MOE_FIELDS) if original.get(k) is not None]
    assert {k: config[k] for k in given} == {k: original[k] for k in given}
    architecture = original["architectures"][0]
    assert config["architectures"] == [architecture]
    result = exports[name][1]
    assert result.arch == "megatron_gpt" and "stacked over 2 layers" in result.reason
    assert architecture in result.reason


def test_result_names_the_splits_and_the_trimmed_vocabulary(exports) -> None:
    result = exports["untied_bf16_tp1"][1]
    q = result.conversions["model.layers.1.self_attn.q_proj.weight"]
    assert q.startswith("decoder.layers.self_attention.linear_qkv.weight: slice 1")
    assert q.endswith("part 0 of rows fused as 2 x (32, 16, 16)")
    assert "first 250 rows" in result.conversions["model.embed_tokens.weight"]
    tied = exports["tied_fp32_tp1"][1]
    assert "lm_head.weight" not in load_file(exports["tied_fp32_tp1"][0] / "model.safetensors")
    assert tied.verification is not None and tied.verification.ok


def test_assets_give_the_config_and_are_copied(tmp_path) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    config = json.loads((FIXTURES / "hf_tied_fp32" / "config.json").read_text())
    (assets / "config.json").write_text(json.dumps(config | {"vocab_size": 240}))
    (assets / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    out = tmp_path / "out"
    inspector.export(FIXTURES / "tied_fp32_tp1", out, format="hf", hf_assets=assets)
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    embed = load_file(out / "model.safetensors")["model.embed_tokens.weight"]
    original = load_file(FIXTURES / "hf_tied_fp32" / "model.safetensors")
    assert torch.equal(embed, original["model.embed_tokens.weight"][:240])


def test_the_cli_exports_a_run_folder(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "tied_fp32_tp1", run / "iter_0000001")
    (run / "latest_checkpointed_iteration.txt").write_text("1")
    assert main(["export", str(run), str(tmp_path / "out"), "--format", "hf"]) == 0
    assert "megatron_gpt" in capsys.readouterr().out
    original = load_file(FIXTURES / "hf_tied_fp32" / "model.safetensors")
    assert load_file(tmp_path / "out" / "model.safetensors").keys() == original.keys()


# --- bad input ---------------------------------------------------------------------------------


def metas(name: str = "tied_fp32_tp1") -> dict[str, TensorMeta]:
    ck = inspector.open(FIXTURES / name)
    return {e.key: TensorMeta(tuple(e.shape or ()), torch.float32) for e in ck.entries()
            if e.kind == "tensor"}  # fmt: skip


def test_a_layer_count_that_disagrees_with_the_stack_names_the_key() -> None:
    args = inspector.open(FIXTURES / "tied_fp32_tp1").run_args | {"num_layers": 3}
    with pytest.raises(ExportError, match=r"num_layers=3 .*args.num_layers") as caught:
        megatron_gpt.to_hf(metas(), None, args)
    assert caught.value.key is not None and caught.value.key.startswith("decoder.layers.")


def test_missing_args_name_the_fact_and_the_argument() -> None:
    with pytest.raises(ExportError, match=r"num_hidden_layers .*args.num_layers.*hf_config"):
        megatron_gpt.to_hf(metas(), None, None)
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    plan = megatron_gpt.to_hf(metas(), config, None)
    assert plan.config["num_key_value_heads"] == 2 and plan.config["vocab_size"] == 256
    assert any("vocab_size stays the padded 256" in n for n in plan.notes)


def test_an_unknown_megatron_module_is_named() -> None:
    bias = "decoder.layers.mlp.router.expert_bias"  # --moe-router-enable-expert-bias
    found = metas("qwen3_moe_fp32_tp1") | {bias: TensorMeta((2, 4), torch.float32)}
    with pytest.raises(ExportError, match="no HF rule") as caught:
        megatron_gpt.to_hf(found, None, inspector.open(FIXTURES / "qwen3_moe_fp32_tp1").run_args)
    assert caught.value.key == bias


def test_an_expert_count_that_disagrees_with_the_shapes_names_the_key() -> None:
    args = inspector.open(FIXTURES / "qwen3_moe_fp32_tp1").run_args
    with pytest.raises(ExportError, match=r"num_experts=8 \(from args.num_experts\)") as caught:
        megatron_gpt.to_hf(metas("qwen3_moe_fp32_tp1"), None, args | {"num_experts": 8})
    assert caught.value.key == "decoder.layers.mlp.router.weight"
    fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    found = metas("qwen3_moe_fp32_tp1")
    found[fc1] = TensorMeta((2, 3, *found[fc1].shape[2:]), torch.float32)
    with pytest.raises(ExportError, match=r"4 experts \(the router's\)") as caught:
        megatron_gpt.to_hf(found, None, args)
    assert caught.value.key == fc1


def test_routing_hf_computes_otherwise_is_refused() -> None:
    args = inspector.open(FIXTURES / "mixtral_bf16_tp2").run_args
    with pytest.raises(ExportError, match=r"args.moe_router_pre_softmax=True: Mixtral"):
        megatron_gpt.to_hf(metas("mixtral_bf16_tp2"), None, args | {"moe_router_pre_softmax": True})
    with pytest.raises(ExportError, match=r"args.moe_router_score_function='sigmoid'"):
        megatron_gpt.to_hf(
            metas("mixtral_bf16_tp2"), None, args | {"moe_router_score_function": "sigmoid"}
        )


def test_qkv_biases_the_args_deny_are_named() -> None:
    args = inspector.open(FIXTURES / "qwen2_fp32_tp1").run_args | {"add_qkv_bias": False}
    with pytest.raises(ExportError, match=r"args.add_qkv_bias=False") as caught:
        megatron_gpt.to_hf(metas("qwen2_fp32_tp1"), None, args)
    assert caught.value.key == "decoder.layers.self_attention.linear_qkv.bias"


def test_hf_experts_that_disagree_with_the_config_are_named() -> None:
    folder = FIXTURES / "hf_qwen3_moe_fp32"
    config = json.loads((folder / "config.json").read_text())
    tensors = {k: TensorMeta(tuple(v.shape), v.dtype)
               for k, v in load_file(folder / "model.safetensors").items()}  # fmt: skip
    with pytest.raises(ExportError, match="num_experts=8, but layer 0 has 4 experts") as caught:
        megatron_gpt.from_hf(tensors, config | {"num_experts": 8})
    assert caught.value.key == "model.layers.0.mlp.experts.3.down_proj.weight"
    del config["num_experts_per_tok"]
    with pytest.raises(ExportError, match="needs num_experts_per_tok"):
        megatron_gpt.from_hf(tensors, config)


def test_args_of_another_family_are_refused() -> None:
    args = inspector.open(FIXTURES / "tied_fp32_tp1").run_args | {"swiglu": False}
    with pytest.raises(ExportError, match=r"args\.swiglu=False"):
        megatron_gpt.to_hf(metas(), None, args)


# --- and back -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["untied_bf16_tp1", "tied_fp32_tp1", "qwen3_fp32_tp1", "qwen2_fp32_tp1",
     "qwen3_moe_fp32_tp1", "mixtral_bf16_tp2", "qwen2_moe_fp32_tp1"],
)  # fmt: skip
def test_hf_to_megatron_equals_megatrons_own_save(tmp_path, name) -> None:
    out = tmp_path / "megatron"
    result = inspector.export(FIXTURES / f"hf_{SCENARIOS[name]}", out, format="megatron")
    assert result.verification is not None and result.verification.ok
    ours, theirs = inspector.open(out), inspector.open(FIXTURES / name)
    assert ours.producer == theirs.producer == "megatron-core"
    tensors = [e.key for e in theirs.entries() if e.kind == "tensor"]
    assert sorted(e.key for e in ours.entries() if e.kind == "tensor") == sorted(tensors)
    for key in tensors:
        assert torch.equal(ours.read(key), theirs.read(key)), key
    objects = {e.key for e in theirs.entries() if e.kind == "object"}
    objects -= {k for k in objects if k.startswith("rerun_state")}  # training state (per rank)
    assert {e.key for e in ours.entries() if e.kind == "object"} == objects
    assert all(ours.read_object(k) is None for k in objects if "_extra_state" in k)
    wanted = theirs.run_args
    for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "group_query_attention", "kv_channels",
                  "padded_vocab_size", "untie_embeddings_and_output_weights", "swiglu",
                  "normalization", "rotary_base", "layernorm_epsilon", "params_dtype",
                  "max_position_embeddings", "add_qkv_bias", "qk_layernorm", "num_experts",
                  *(MOE_ARGS if wanted["num_experts"] else ())):  # fmt: skip
        assert ours.run_args[field] == wanted[field], field
    back = tmp_path / "hf"
    inspector.export(out, back, format="hf")
    original = load_file(FIXTURES / f"hf_{SCENARIOS[name]}" / "model.safetensors")
    again = load_file(back / "model.safetensors")
    assert (
        all(torch.equal(again[k], v) for k, v in original.items())
        and again.keys() == original.keys()
    )


def test_expert_and_qkv_blocks_are_copied_from_their_stored_bytes() -> None:
    from functools import partial

    from inspector.exporting.hf import transforms
    from inspector.exporting.model_weights import slice_bytes

    ck = inspector.open(FIXTURES / "qwen3_moe_fp32_tp1")  # Megatron's own save: gate, up apart
    original = load_file(FIXTURES / "hf_qwen3_moe_fp32" / "model.safetensors")
    fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    for key, transform, name in (
        (fc1, partial(transforms.expert_rows, index=2, sizes=(16, 16), part=1), "up_proj"),
        ("decoder.layers.mlp.experts.experts.linear_fc2.weight",
         partial(transforms.expert, index=2), "down_proj"),
    ):  # fmt: skip
        (found,) = slice_bytes(ck, key, 1, transform) or [None]
        assert found is not None, key
        with open(FIXTURES / "qwen3_moe_fp32_tp1" / found.name, "rb") as file:
            file.seek(found.offset)
            raw = bytearray(file.read(found.length))
        want = original[f"model.layers.1.mlp.experts.2.{name}.weight"]
        assert torch.equal(torch.frombuffer(raw, dtype=torch.float32).reshape(want.shape), want)
    qkv = partial(transforms.split_rows, groups=2, sizes=(32, 16, 16), part=0)
    trim = partial(transforms.first_rows, rows=250)  # the vocabulary padded to 256, trimmed
    for key, index, transform, name, pieces in (
        ("decoder.layers.self_attention.linear_qkv.weight", 1, qkv,
         "model.layers.1.self_attn.q_proj.weight", 2),  # the q rows of each query group
        ("embedding.word_embeddings.weight", None, trim, "model.embed_tokens.weight", 1),
    ):  # fmt: skip
        found = slice_bytes(ck, key, index, transform)
        assert found is not None and len(found) == pieces, key
        raw = bytearray()
        for byte_range in found:
            with open(FIXTURES / "qwen3_moe_fp32_tp1" / byte_range.name, "rb") as file:
                file.seek(byte_range.offset)
                raw += file.read(byte_range.length)
        want = original[name]
        assert torch.equal(torch.frombuffer(raw, dtype=torch.float32).reshape(want.shape), want)
