"""``fp8="quantize"``: FP8 e4m3 weights + per-channel scales that compressed-tensors itself
produces bit for bit, and decompresses to what inspector reads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import inspector
from inspector.exporting.fp8 import plan_fp8
from inspector.exporting.quantize import fp8_weight, quantization_config
from tests.fixtures import compressed_tensors_folders as ctf
from tests.tensors.test_fp8 import same_bits

LINEARS = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight")
KEPT = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def compressed_tensors_fp8(w: torch.Tensor, preset: str) -> dict[str, torch.Tensor]:
    """What compressed-tensors' float-quantized compressor stores for ``w`` under ``preset``."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    compressor = BaseCompressor.get_value_from_registry("float-quantized")
    return compressor.compress({"weight": w, **ctf._qparams(w, scheme.weights)}, scheme)


@pytest.mark.parametrize(("scheme", "preset"), [("channel", "FP8_DYNAMIC"), ("block", "FP8_BLOCK")])
def test_fp8_values_equal_compressed_tensors(scheme: str, preset: str) -> None:
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    parsed = QuantizationConfig.model_validate(quantization_config(scheme, ["lm_head"]))
    ours, theirs = parsed.config_groups["group_0"], preset_name_to_scheme(preset, ["Linear"])
    assert (ours.weights, ours.input_activations) == (theirs.weights, theirs.input_activations)
    assert parsed.format == "float-quantized" and parsed.ignore == ["lm_head"]
    for seed in range(2):
        w = ctf.weight(seed)
        w[3, :7] = 0.0
        w[5] = 0.0  # an all-zero row: the zero-scale rule
        fp8, scale = fp8_weight(w, scheme)
        theirs = compressed_tensors_fp8(w, preset)
        assert same_bits(fp8, theirs["weight"])
        assert same_bits(scale, theirs["weight_scale"])


def test_quantize_export_is_a_compressed_tensors_folder(tmp_path: Path) -> None:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    src = tmp_path / "bf16"
    src.mkdir()
    weights = {key: ctf.weight(i) for i, key in enumerate(LINEARS)}
    weights |= {key: ctf.weight(5 + i) for i, key in enumerate(KEPT)}
    save_file(weights, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    out = tmp_path / "fp8"
    result = inspector.export(src, out, fp8="quantize", progress=False)
    assert result.tensors == len(LINEARS) * 2 + len(KEPT)
    written = load_file(out / "model.safetensors")
    for key in KEPT:
        assert same_bits(written[key], weights[key])
    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    compressor = BaseCompressor.get_value_from_registry("float-quantized")
    for key in LINEARS:
        theirs = compressed_tensors_fp8(weights[key], "FP8_DYNAMIC")
        assert same_bits(written[key], theirs["weight"])
        assert same_bits(written[key + "_scale"], theirs["weight_scale"])
    written_config = json.loads((out / "config.json").read_text())
    ignore = ["lm_head", "model.embed_tokens", "model.norm"]
    assert written_config == {
        "model_type": "llama",
        "quantization_config": quantization_config("channel", ignore),
    }
    ck = inspector.open(out)
    assert sorted(ck.logical) == sorted(LINEARS)
    for key in LINEARS:
        assert ck.facts(key).fp8 == "float-quantized float8 channel"
        parts = {"weight": written[key], "weight_scale": written[key + "_scale"]}
        assert same_bits(ck.read(key), compressor.decompress(parts, scheme)["weight"])


def test_fp8_trained_wrappers_quantize_their_master_weights(demo_dir: Path) -> None:
    from tests.tensors.test_fp8 import CONVERTED, torch_master_weights

    ck = inspector.open(demo_dir / "fp8")
    masters = torch_master_weights(demo_dir / "fp8")
    outputs, skipped = plan_fp8(ck, list(masters), mode="quantize")
    got = {o.name: o for o in outputs}
    assert skipped == {}
    assert sorted(got) == sorted([*masters, *(k + "_scale" for k in CONVERTED)])
    for key in CONVERTED:
        fp8, scale = fp8_weight(masters[key].bfloat16(), "channel")
        assert same_bits(got[key].read(), fp8)
        assert same_bits(got[key + "_scale"].read(), scale)
        assert got[key].raw and got[key].conversion.endswith("-> float8_e4m3fn, per-channel scale")
    for key in ("output.weight", "tok_embeddings.weight"):
        assert same_bits(got[key].read(), masters[key]), key


def decompressed(folder: Path) -> dict[str, torch.Tensor]:
    """compressed-tensors' own decompression of ``folder``'s weights, by the compressor and
    scheme its config.json names."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    compressor = BaseCompressor.get_value_from_registry(parsed.format)
    scheme = parsed.config_groups["group_0"]
    written = load_file(folder / "model.safetensors")
    return {
        key: compressor.decompress(
            {"weight": written[key], "weight_scale": written[key + "_scale"]}, scheme
        )["weight"]
        for key in written
        if key + "_scale" in written
    }


@pytest.mark.parametrize("case", ["fsdp", "fp8"])
def test_hf_export_writes_a_folder_transformers_loads(torchtitan_models, tmp_path, case):
    """``format="hf"`` writes the quantization_config itself; transformers loads the folder
    as it is, and its decompressed linear weights, compressed-tensors' own decompression
    and inspector's reading agree bit for bit; the FP8 values are those of the HF weights."""
    import transformers

    naming = "torchtitan-2025" if case == "fp8" else "torchtitan"
    out = tmp_path / case
    inspector.export(
        torchtitan_models.dcp("llama3", naming, case),
        out,
        format="hf",
        fp8="quantize",
        hf_assets=torchtitan_models.assets("llama3"),
        progress=False,
    )
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # the first forward decompresses the weights
    ck, params = inspector.open(out), dict(model.named_parameters())
    theirs = decompressed(out)
    reference = load_file(next(Path(torchtitan_models.hf("llama3")).glob("*.safetensors")))
    linears = [k for k, v in reference.items() if v.ndim == 2 and "embed" not in k]
    kept = {k.removesuffix(".weight") for k in reference if k not in linears}
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["ignore"] == sorted(kept | {"lm_head"})
    assert any("norm" in k for k in kept) and "model.embed_tokens" in kept
    quantized = sorted(k for k in linears if k != "lm_head.weight")
    assert sorted(ck.logical) == sorted(theirs) == quantized
    for key, value in theirs.items():
        assert same_bits(ck.read(key), value), key
        assert same_bits(params[key].detach(), value), key
        fp8, _ = fp8_weight(reference[key].to(value.dtype), "channel")
        assert same_bits(load_file(out / "model.safetensors")[key], fp8), key


def tiny_llama(folder: Path, hidden: int) -> None:
    """A one-layer bfloat16 Llama (``hidden`` wide, MLP twice that) saved by transformers."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)


def test_transformers_loads_the_quantized_folder(tmp_path: Path) -> None:
    """transformers (with compressed-tensors) loads the folder, and after its own
    decompression every linear weight equals what inspector reads back."""
    import transformers

    tiny_llama(tmp_path / "src", 64)
    out = tmp_path / "fp8"
    inspector.export(tmp_path / "src", out, fp8="quantize", progress=False)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.bfloat16, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # the first forward decompresses the weights
    ck = inspector.open(out)
    params = dict(model.named_parameters())
    assert len(ck.logical) == 7
    for key in ck.logical:
        assert same_bits(params[key].detach(), ck.read(key)), key
    theirs = decompressed(out)
    assert sorted(theirs) == sorted(ck.logical)
    for key, value in theirs.items():
        assert same_bits(value, ck.read(key)), key
