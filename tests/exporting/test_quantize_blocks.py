"""``fp8="quantize"`` with ``fp8_scheme="block"`` (compressed-tensors FP8_BLOCK) and
``"fine-grained"`` (transformers' ``quant_method: fp8``, DeepSeek-V3's ``weight_scale_inv``):
FP8 values and scales bit-identical to the library's own quantization, folders the library
loads and decompresses to what inspector reads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import inspector
from inspector.errors import UsageError
from inspector.exporting.quantize import fp8_weight, quantization_config
from inspector.ui.cli import main
from tests.exporting.test_quantize import decompressed, tiny_llama
from tests.tensors.test_fp8 import same_bits

BLOCK = 128


def transformers_fp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' own fine-grained quantization (``Fp8Quantize``) of ``w``; it takes whole
    128x128 blocks only, so ``w`` is zero-padded to them and the FP8 values cropped back."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    quantizer = FineGrainedFP8HfQuantizer(FineGrainedFP8Config())
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w, (0, -cols % BLOCK, 0, -rows % BLOCK))
    out = Fp8Quantize(quantizer).convert({"p.weight": padded})
    fp8 = out["p.weight"][:rows, :cols].contiguous()
    return {"weight": fp8, "scale": out["p.weight_scale_inv"]}


def compressed_tensors_block(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """What compressed-tensors' float-quantized compressor stores for ``w`` under FP8_BLOCK,
    from each block's own min and max (edge blocks partial) through its ``calculate_qparams``."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    rows, cols = w.shape
    blocks = [[w[i : i + BLOCK, j : j + BLOCK] for j in range(0, cols, BLOCK)]
              for i in range(0, rows, BLOCK)]
    low = torch.stack([torch.stack([b.amin() for b in row]) for row in blocks])
    high = torch.stack([torch.stack([b.amax() for b in row]) for row in blocks])
    scale, zero_point = calculate_qparams(low, high, scheme.weights)
    compressor = BaseCompressor.get_value_from_registry("float-quantized")
    parts = {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}
    return compressor.compress(parts, scheme)


def transformers_dequantized(fp8: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """transformers' dequantization of fine-grained FP8 (the one its FP8 layers' backward
    uses: it takes partial edge blocks), in float32."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    return _dequantize_fp8_weight(fp8, inverse, [BLOCK, BLOCK], torch.float32)


def edge_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A bfloat16 weight with an all-zero block, a -0.0 and a large outlier."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=generator) * 0.05
    w[:BLOCK, BLOCK : 2 * BLOCK] = 0.0
    w[0, 0] = -0.0
    w[-1, 0] = 300.0
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (64, 130)])
def test_fine_grained_values_equal_transformers(shape: tuple[int, int]) -> None:
    w = edge_weight(*shape)
    fp8, inverse = fp8_weight(w, "fine-grained")
    theirs = transformers_fp8(w)
    assert same_bits(fp8, theirs["weight"]) and same_bits(inverse, theirs["scale"])
    assert inverse.shape == (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
    if shape[1] > BLOCK:
        assert inverse[0, 1] == 1.0 and not fp8[:BLOCK, BLOCK : 2 * BLOCK].float().any()


def test_block_and_fine_grained_export_and_read_back(tmp_path: Path) -> None:
    """Partial edge blocks and a zero block: compressed-tensors decompresses the ``block``
    folder (written by 2 workers), transformers dequantizes the ``fine-grained`` one (written
    by the CLI), each to
    what ``ck.read`` returns; norms, embeddings and the head stay as stored, listed as
    ignored."""
    src = tmp_path / "bf16"
    src.mkdir()
    linears = {"model.layers.0.mlp.down_proj.weight": edge_weight(200, 300, 1),
               "model.layers.0.self_attn.k_proj.weight": edge_weight(64, 130, 2)}
    kept = {"model.norm.weight": torch.ones(300, dtype=torch.bfloat16),
            "model.embed_tokens.weight": edge_weight(32, 300, 3),
            "lm_head.weight": edge_weight(32, 300, 4)}
    save_file(linears | kept, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    ignore = ["lm_head", "model.embed_tokens", "model.norm"]
    for scheme, suffix in (("block", "_scale"), ("fine-grained", "_scale_inv")):
        out = tmp_path / scheme
        if scheme == "block":  # by two worker processes, config.json included
            result = inspector.export(src, out, fp8="quantize", fp8_scheme=scheme, workers=2,
                                      progress=False)
            assert result.verification is not None and result.verification.ok
        else:  # the command line's flag, from the shared options table
            args = ["export", str(src), str(out), "--fp8", "quantize", "--fp8-scheme", scheme]
            assert main(args) == 0
        config = json.loads((out / "config.json").read_text())["quantization_config"]
        assert config == quantization_config(scheme, ignore)
        written = load_file(out / "model.safetensors")
        assert sorted(written) == sorted([*kept, *linears, *(k + suffix for k in linears)])
        for key, value in kept.items():
            assert same_bits(written[key], value), key
        ck = inspector.open(out)
        assert sorted(ck.logical) == sorted(linears)
        theirs = decompressed(out) if scheme == "block" else {}
        for key, value in linears.items():
            fp8, scale = written[key], written[key + suffix]
            if scheme == "block":
                expected = compressed_tensors_block(value)
                wanted, theirs_read = expected["weight_scale"], theirs[key]
            else:
                expected = transformers_fp8(value)
                wanted, theirs_read = expected["scale"], transformers_dequantized(fp8, scale)
                assert same_bits(ck.read(key, "bfloat16"), theirs_read.bfloat16()), key
                assert ck.logical[key].scheme.label == "fine-grained-fp8 float8 block 128x128"
            assert same_bits(fp8, expected["weight"]) and same_bits(scale, wanted), key
            assert same_bits(ck.read(key), theirs_read), key


def test_transformers_loads_the_fine_grained_folder(tmp_path: Path) -> None:
    """transformers recognises the folder's fp8 quantization_config and, on CPU, dequantizes
    every linear weight on load to exactly what inspector reads back; the FP8 values are its
    own quantization of the source weights."""
    import transformers

    tiny_llama(tmp_path / "src", BLOCK)  # k_proj: 64 rows, one partial block
    out = tmp_path / "fp8"
    inspector.export(tmp_path / "src", out, fp8="quantize", fp8_scheme="fine-grained",
                     progress=False)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    from transformers.quantizers import AutoQuantizationConfig

    written_config = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = AutoQuantizationConfig.from_dict(written_config)
    assert isinstance(parsed, transformers.FineGrainedFP8Config)
    assert parsed.weight_block_size == [BLOCK, BLOCK] and parsed.activation_scheme == "dynamic"
    assert parsed.modules_to_not_convert == ["lm_head", "model.embed_tokens", "model.layers.0."
                                             "input_layernorm", "model.layers.0.post_attention_"
                                             "layernorm", "model.norm"]
    source = load_file(tmp_path / "src" / "model.safetensors")
    written = load_file(out / "model.safetensors")
    ck, params = inspector.open(out), dict(model.named_parameters())
    assert len(ck.logical) == 7
    for key in ck.logical:
        theirs = transformers_fp8(source[key])
        assert same_bits(written[key], theirs["weight"]), key
        assert same_bits(written[key + "_scale_inv"], theirs["scale"]), key
        assert same_bits(params[key].detach(), ck.read(key, torch.float32)), key
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert same_bits(written[key], source[key]), key
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_fp8_scheme_applies_to_quantize_only(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="fp8_scheme='block' applies to fp8='quantize'"):
        inspector.export(tmp_path / "none", tmp_path / "out", fp8_scheme="block")
    with pytest.raises(UsageError, match="fp8_scheme must be one of channel, block, fine-grained"):
        inspector.export(tmp_path / "none", tmp_path / "out", fp8="quantize", fp8_scheme="row")


def test_fp8_trained_wrappers_quantize_their_master_weights(demo_dir: Path) -> None:
    """FP8-trained torchtitan weights: their master weights, as transformers quantizes them."""
    from inspector.exporting.fp8 import plan_fp8
    from tests.tensors.test_fp8 import CONVERTED, torch_master_weights

    ck = inspector.open(demo_dir / "fp8")
    masters = torch_master_weights(demo_dir / "fp8")
    outputs, _ = plan_fp8(ck, list(masters), mode="quantize", scheme="fine-grained")
    got = {o.name: o for o in outputs}
    assert sorted(got) == sorted([*masters, *(k + "_scale_inv" for k in CONVERTED)])
    for key in CONVERTED:
        theirs = transformers_fp8(masters[key].bfloat16())
        assert same_bits(got[key].read(), theirs["weight"]), key
        assert same_bits(got[key + "_scale_inv"].read(), theirs["scale"]), key
        assert got[key].conversion.endswith("-> float8_e4m3fn, 128x128 block weight_scale_inv")


def test_a_scale_that_does_not_fit_names_the_key_and_scheme(tmp_path: Path) -> None:
    """A fine-grained folder whose ``weight_scale_inv`` has the wrong shape: reading that
    weight is a CorruptCheckpointError naming key and scheme; the rest stays readable."""
    from inspector.errors import CorruptCheckpointError

    fp8, inverse = fp8_weight(edge_weight(200, 300), "fine-grained")
    bad, good = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"
    save_file({good: fp8, good + "_scale_inv": inverse, bad: fp8.clone(),
               bad + "_scale_inv": inverse[:1].clone()}, tmp_path / "model.safetensors")
    config = {"quantization_config": quantization_config("fine-grained", [])}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ck = inspector.open(tmp_path)
    with pytest.raises(CorruptCheckpointError, match="fine-grained-fp8 float8 block 128x128") as e:
        ck.read(bad)
    assert e.value.key == bad
    assert same_bits(ck.read(good), transformers_dequantized(fp8, inverse))
    assert same_bits(ck.read(bad + "_scale_inv"), inverse[:1])
