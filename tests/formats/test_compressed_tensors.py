"""compressed-tensors folders and gpt-oss MXFP4: each quantized weight one logical weight, read
bit for bit as compressed-tensors' / transformers' own decompression returns it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import inspector
from inspector.exporting.fp8 import plan_fp8
from tests.fixtures import compressed_tensors_folders as ctf
from tests.tensors.test_fp8 import same_bits

LABELS = {
    "fp8_channel": "float-quantized float8 channel",
    "fp8_tensor": "float-quantized float8 tensor",
    "fp8_block": "float-quantized float8 block 128x128",
    "int8_channel": "naive-quantized int8 channel",
    "w4a16": "pack-quantized int4 group 128",
    "w4a16_asym": "pack-quantized int4 group 128 asymmetric",
    "w3a16": "pack-quantized int3 group 128",
    "nvfp4": "nvfp4-pack-quantized float4 tensor-group 16",
}
Q_PROJ = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="session")
def ct_folders(tmp_path_factory) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("compressed_tensors")
    return root, ctf.write(root)


def test_every_scheme_read_like_compressed_tensors(ct_folders) -> None:
    root, expected = ct_folders
    assert set(expected) == set(LABELS)
    for name, weights in expected.items():
        ck = inspector.open(root / name)
        assert sorted(ck.logical) == sorted(weights), name
        for key, want in weights.items():
            assert ck.logical[key].scheme.label == LABELS[name]
            assert ck.facts(key).fp8 == LABELS[name] if key in ck.keys() else True
            assert same_bits(ck.read(key), want), (name, key)
            assert same_bits(ck.read(key, dtype="float32"), want.float())
            for role, part in ck.logical[key].parts.items():
                if part != key:
                    assert ck.facts(part).fp8 == f"part of {key}"
                    assert ck.read(part).dtype == ck.read_stored(part).dtype, role
        assert same_bits(ck.read("lm_head.weight"), ctf.weight(9))
        assert "lm_head.weight" not in ck.logical


def test_raw_parts_reachable(ct_folders) -> None:
    root, _ = ct_folders
    stored = load_file(root / "w4a16_asym" / "model.safetensors")
    ck = inspector.open(root / "w4a16_asym")
    parts = ck.logical[f"{Q_PROJ}.weight"].parts
    assert parts == {
        "weight_packed": f"{Q_PROJ}.weight_packed",
        "weight_scale": f"{Q_PROJ}.weight_scale",
        "weight_zero_point": f"{Q_PROJ}.weight_zero_point",
        "weight_shape": f"{Q_PROJ}.weight_shape",
    }
    for key in parts.values():
        assert same_bits(ck.read(key), stored[key])
    fp8 = inspector.open(root / "fp8_channel")
    raw = load_file(root / "fp8_channel" / "model.safetensors")[f"{Q_PROJ}.weight"]
    assert same_bits(fp8.read_stored(f"{Q_PROJ}.weight"), raw)


def test_export_writes_logical_weights(ct_folders, tmp_path: Path) -> None:
    root, expected = ct_folders
    for name in ("w4a16_asym", "fp8_block", "nvfp4"):
        ck = inspector.open(root / name)
        outputs, skipped = plan_fp8(ck, ck.keys())
        names = [o.name for o in outputs]
        assert sorted(names) == sorted([*expected[name], "model.norm.weight", "lm_head.weight"])
        assert all(v.startswith("part of ") or v.startswith("scale of ") for v in skipped.values())
        out = tmp_path / name / "model.safetensors"
        inspector.export(ck, out, format="safetensors")
        written = load_file(out)
        for key, want in expected[name].items():
            assert same_bits(written[key], want), (name, key)
        assert same_bits(written["lm_head.weight"], ctf.weight(9))
        assert not any(k.endswith(("_packed", "_scale", "_zero_point", "_shape")) for k in written)


def test_fingerprint_and_stats_see_logical_values(ct_folders) -> None:
    root, expected = ct_folders
    ck = inspector.open(root / "fp8_channel")
    key = f"{Q_PROJ}.weight"
    stats = inspector.stats(ck, key)
    assert stats.max == pytest.approx(expected["fp8_channel"][key].float().max().item())
    a = inspector.fingerprint(ck, keys=[key])
    b = inspector.fingerprint(inspector.open(root / "fp8_tensor"), keys=[key])
    assert a != b


def _damage(src: Path, dst: Path, key: str, value: torch.Tensor) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    tensors[key] = value
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_bad_parts_name_key_and_scheme(ct_folders, tmp_path: Path) -> None:
    root, expected = ct_folders
    wrong_scale = _damage(
        root / "w4a16", tmp_path / "scale", f"{Q_PROJ}.weight_scale", torch.ones(5, 3)
    )
    ck = inspector.open(wrong_scale)
    with pytest.raises(
        inspector.CorruptCheckpointError,
        match=r"q_proj\.weight.*pack-quantized int4 group 128.*scale of shape \[5, 3\]",
    ):
        ck.read(f"{Q_PROJ}.weight")
    down = "model.layers.0.mlp.down_proj.weight"
    assert same_bits(ck.read(down), expected["w4a16"][down])
    short = _damage(
        root / "w4a16",
        tmp_path / "short",
        f"{Q_PROJ}.weight_packed",
        torch.zeros(ctf.ROWS, 4, dtype=torch.int32),
    )
    with pytest.raises(
        inspector.CorruptCheckpointError, match=r"q_proj\.weight.*too short for shape \[96, 256\]"
    ):
        inspector.open(short).read(f"{Q_PROJ}.weight")
    unknown = tmp_path / "unknown"
    _damage(root / "w4a16", unknown, "model.norm.weight", torch.ones(ctf.COLS))
    config = json.loads((unknown / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["format"] = "marlin-24"
    config["quantization_config"]["format"] = "marlin-24"
    (unknown / "config.json").write_text(json.dumps(config))
    ck = inspector.open(unknown)
    with pytest.raises(
        inspector.UnsupportedError,
        match=r"q_proj\.weight.*unknown quantization scheme 'marlin-24 int4",
    ):
        ck.read(f"{Q_PROJ}.weight")
    assert same_bits(
        ck.read(f"{Q_PROJ}.weight_scale"),
        load_file(root / "w4a16" / "model.safetensors")[f"{Q_PROJ}.weight_scale"],
    )


# --- gpt-oss MXFP4 -----------------------------------------------------------------------


def test_gpt_oss_mxfp4_like_transformers(tmp_path: Path) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    experts, rows, cols = 2, 64, 96
    blocks = torch.randint(
        0, 256, (experts, rows, cols // 32, 16), generator=generator, dtype=torch.uint8
    )
    scales = torch.randint(
        118, 130, (experts, rows, cols // 32), generator=generator, dtype=torch.uint8
    )
    prefix = "model.layers.0.mlp.experts."
    save_file(
        {
            prefix + "gate_up_proj_blocks": blocks,
            prefix + "gate_up_proj_scales": scales,
            prefix + "gate_up_proj_bias": torch.zeros(experts, rows),
        },
        tmp_path / "model.safetensors",
    )
    config = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ck = inspector.open(tmp_path)
    key = prefix + "gate_up_proj"
    assert list(ck.logical) == [key]
    assert ck.logical[key].shape == (experts, cols, rows)
    assert (ck.entry(key).dtype, ck.entry(key).shape) == ("bfloat16", (experts, cols, rows))
    assert ck.keys().index(key) + 1 == ck.keys().index(prefix + "gate_up_proj_blocks")
    assert ck.facts(key).scheme == "mxfp4 e2m1 + e8m0 scale per 32 (gpt-oss)"
    assert inspector.stats(ck, key).max == pytest.approx(
        convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16).float().max().item()
    )
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert same_bits(ck.read(key), want)
    assert same_bits(
        ck.read(key, dtype=torch.float32),
        convert_moe_packed_tensors(blocks, scales, dtype=torch.float32),
    )
    assert ck.facts(prefix + "gate_up_proj_blocks").fp8 == f"part of {key}"


def test_bad_config_leaves_plain_entries(ct_folders, tmp_path: Path) -> None:
    root, _ = ct_folders
    stored = load_file(root / "w4a16" / "model.safetensors")
    key = f"{Q_PROJ}.weight_packed"
    for name, text in [
        ("not_json", "{"),
        (
            "odd_groups",
            json.dumps(
                {
                    "quantization_config": {
                        "quant_method": "compressed-tensors",
                        "config_groups": {"g": {"weights": {"num_bits": "x"}}},
                    }
                }
            ),
        ),
    ]:
        folder = _damage(root / "w4a16", tmp_path / name, key, stored[key])
        (folder / "config.json").write_text(text)
        ck = inspector.open(folder)
        assert ck.logical == {}
        assert same_bits(ck.read(key), stored[key])


# --- one logical entry per weight ----------------------------------------------------------

LOGICAL_ONLY = ("w4a16_asym", "w3a16", "nvfp4")  # schemes whose weight has no stored tensor


def test_logical_weights_listed_as_entries(ct_folders) -> None:
    root, expected = ct_folders
    for name in (*LOGICAL_ONLY, "fp8_channel"):
        ck = inspector.open(root / name)
        keys = ck.keys()
        rows = {r["key"]: r for r in ck.records()}
        for key, want in expected[name].items():
            weight = ck.logical[key]
            entry = ck.entry(key)
            assert (entry.dtype, entry.shape, entry.kind) == (
                str(want.dtype).removeprefix("torch."),
                tuple(want.shape),
                "tensor",
            ), (name, key)
            assert entry.component == "model"
            if name in LOGICAL_ONLY:  # listed just before its first part
                assert keys.index(key) + 1 == min(keys.index(p) for p in weight.parts.values())
            assert ck.facts(key).scheme == LABELS[name]
            assert rows[key]["dtype"] == entry.dtype and rows[key]["shape"] == list(want.shape)
            for part in weight.parts.values():
                if part != key:
                    assert ck.facts(part).part_of == key and ck.facts(part).scheme is None
            assert same_bits(ck.read_chunk(key, 0), want)
            assert ck.stats(key).max == pytest.approx(want.float().max().item())
            assert ck.byte_ranges(key) is None
            leaf = ck.tree().find(key)
            assert leaf.is_leaf and leaf.entry == entry
        assert ck.facts("lm_head.weight").scheme is None
        stored = load_file(root / name / "model.safetensors")
        assert sum(nbytes for _, _, nbytes in ck.sizes()) == sum(t.nbytes for t in stored.values())
    ck = inspector.open(root / "w4a16_asym")
    with pytest.raises(inspector.InspectorError, match=r"q_proj\.weight.*no stored tensor"):
        ck.read_stored(f"{Q_PROJ}.weight")


def test_logical_weights_in_fingerprint_diff_and_exports(ct_folders, tmp_path: Path) -> None:
    root, expected = ct_folders
    ck = inspector.open(root / "w4a16")
    out = tmp_path / "dequantized"
    inspector.export(ck, out / "model.safetensors", format="safetensors")
    plain = inspector.open(out / "model.safetensors")
    assert sorted(plain.keys()) == sorted(
        [*expected["w4a16"], "model.norm.weight", "lm_head.weight"]
    )
    assert inspector.fingerprint(ck).digest == inspector.fingerprint(plain).digest
    table = inspector.diff(ck, plain, progress=False).set_index("key")
    for key in expected["w4a16"]:
        assert table.loc[key, "status"] == "same", key
    assert set(table.loc[[k for k in ck.keys() if ck.part_of(k)], "status"]) == {"only_a"}
    pt = tmp_path / "weights.pt"
    inspector.export(ck, pt, format="pt", dtype="float32")
    loaded = torch.load(pt, weights_only=True)
    for key, want in expected["w4a16"].items():
        assert same_bits(loaded[key], want.float())
    for name in ("w4a16", "fp8_channel"):  # as stored: the parts, the float8 weights
        kept = tmp_path / f"{name}.safetensors"
        inspector.export(root / name, kept, format="safetensors", fp8="unwrap")
        stored, written = load_file(root / name / "model.safetensors"), load_file(kept)
        assert sorted(written) == sorted(stored)
        assert all(same_bits(written[k], v) for k, v in stored.items()), name


def test_bad_parts_leave_the_rest_browsable(ct_folders, tmp_path: Path) -> None:
    root, expected = ct_folders
    key, down = f"{Q_PROJ}.weight", "model.layers.0.mlp.down_proj.weight"
    scale = f"{Q_PROJ}.weight_scale"
    folder = _damage(root / "nvfp4", tmp_path / "nvfp4", scale, torch.ones(5))
    ck = inspector.open(folder)
    assert ck.entry(key).shape == (ctf.ROWS, ctf.COLS) and len(ck.table()) == len(ck.keys())
    with pytest.raises(
        inspector.CorruptCheckpointError,
        match=r"q_proj\.weight.*nvfp4-pack-quantized float4 tensor-group 16: "
        r"scale of shape \[5\]",
    ):
        ck.read(key)
    assert "scale of shape [5]" in ck.facts(key).error
    assert same_bits(ck.read(down), expected["nvfp4"][down])
    out = tmp_path / "skip.safetensors"
    result = inspector.export(ck, out, format="safetensors", on_error="skip")
    parts = ck.logical[key].parts.values()  # left as stored: their weight is skipped
    assert sorted(load_file(out)) == sorted([down, "model.norm.weight", "lm_head.weight", *parts])
    assert "scale of shape [5]" in result.skipped[key]
    shape = _damage(
        root / "w4a16", tmp_path / "shape", f"{Q_PROJ}.weight_shape", torch.tensor([96, 128])
    )
    ck = inspector.open(shape)
    assert ck.entry(key).shape == (96, 128)
    with pytest.raises(inspector.CorruptCheckpointError, match=r"q_proj\.weight.*pack-quantized"):
        ck.read(key)
    unknown = tmp_path / "unknown"
    _damage(root / "w4a16", unknown, "model.norm.weight", torch.ones(ctf.COLS))
    config = json.loads((unknown / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["format"] = "marlin-24"
    (unknown / "config.json").write_text(json.dumps(config))
    ck = inspector.open(unknown)
    assert "unknown quantization scheme 'marlin-24" in ck.facts(key).error
    assert ck.facts(key).scheme.startswith("marlin-24 int4")
    refused = r"_proj\.weight'.*unknown quantization scheme 'marlin-24"
    with pytest.raises(inspector.ExportError, match=refused):
        inspector.export(ck, tmp_path / "refused.safetensors", format="safetensors")


def test_gpt_oss_mxfp4_bad_scales(tmp_path: Path) -> None:
    blocks = torch.zeros(2, 8, 3, 16, dtype=torch.uint8)
    save_file(
        {
            "experts.down_proj_blocks": blocks,
            "experts.down_proj_scales": torch.zeros(2, 8, 2, dtype=torch.uint8),
        },
        tmp_path / "model.safetensors",
    )
    config = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ck = inspector.open(tmp_path)
    parts = ["experts.down_proj_blocks", "experts.down_proj_scales"]
    assert ck.keys() == ["experts.down_proj", *parts]
    with pytest.raises(
        inspector.CorruptCheckpointError, match=r"experts\.down_proj\b.*mxfp4.*do not pair"
    ):
        ck.read("experts.down_proj")
    assert same_bits(ck.read("experts.down_proj_blocks"), blocks)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, "experts.down_proj": torch.ones(3)}, tmp_path / "model.safetensors")
    ck = inspector.open(tmp_path)  # a stored tensor under the weight's name: nothing grouped
    assert ck.logical == {} and same_bits(ck.read("experts.down_proj"), torch.ones(3))
