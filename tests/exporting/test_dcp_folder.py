"""``inspector.export(hf_dir, out, format="dcp")`` against real consumers: torch's DCP loader
reads the folder into torchtitan-named modules the way torchtitan's ``initial_load_path``
does (strict, flat model keys), the tensors are exactly what torchtitan's own ``from_hf``
makes, and HF -> DCP -> HF gives the original logits bit for bit."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import inspector
from inspector.errors import InspectorError
from inspector.exporting import hf
from inspector.ui.cli import main
from tests.exporting.test_hf_folder import load_hf, titan_state
from tests.fixtures import torchtitan_models as tm

CASES = [(name, naming) for name in tm.MODELS for naming in tm.NAMINGS]


def case_id(case: tuple) -> str:
    return "-".join(case)


@pytest.fixture(scope="module")
def reference_logits(torchtitan_models) -> dict[str, torch.Tensor]:
    return {name: tm.logits(load_hf(torchtitan_models.hf(name))[0]) for name in tm.MODELS}


@pytest.fixture(scope="module")
def exports(torchtitan_models, tmp_path_factory) -> dict[tuple, tuple]:
    """Each HF folder written as a torchtitan DCP folder in each naming (config.json from
    the folder itself)."""
    root = tmp_path_factory.mktemp("dcp_exports")
    done = {}
    for case in CASES:
        name, naming = case
        out = root / case_id(case)
        result = inspector.export(
            torchtitan_models.hf(name), out, format="dcp", naming=naming, progress=False
        )
        done[case] = (result, out)
    return done


def initial_load(module: torch.nn.Module, path: Path) -> None:
    """What torchtitan does with initial_load_path: dcp.load of the flat model state dict
    (strict: every key must be there), then load_state_dict."""
    state = module.state_dict()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    module.load_state_dict(state)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_torchtitan_modules_load_it_like_initial_load_path(exports, torchtitan_models, case):
    name, naming = case
    result, out = exports[case]
    assert result.verification is not None and result.verification.ok
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp"]
    saved = titan_state(torchtitan_models.dcp(name, naming, "flat"))
    module = tm.titan_module(saved, tm.tied_names(name, naming))
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.fill_(7.0)
    initial_load(module, out)
    loaded = module.state_dict()
    only = tm.torchtitan_only(name, naming)
    assert set(loaded) == set(saved)
    for key, value in saved.items():  # torchtitan's from_hf, reimplemented, made `saved`
        expected = torch.zeros_like(value) if key in only else value
        assert torch.equal(loaded[key], expected), key


def test_torchtitans_own_llama3_forward_on_the_export(exports, reference_logits) -> None:
    """torchtitan's complex-RoPE forward (reimplemented) on the exported weights gives HF's
    logits: the inverse permutation put the q/k rows back in torchtitan's order."""
    for naming in tm.NAMINGS:
        _, out = exports["llama3", naming]
        state = inspector.open(out)
        weights = {k: state.read(k) for k in state.keys()}
        got = tm.titan_llama3_logits(weights, naming)
        torch.testing.assert_close(got, reference_logits["llama3"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_hf_to_dcp_to_hf_gives_identical_logits(
    exports, torchtitan_models, reference_logits, case, tmp_path
) -> None:
    name, _ = case
    _, titan = exports[case]
    result = inspector.export(
        titan,
        tmp_path / "hf",
        format="hf",
        hf_assets=torchtitan_models.assets(name),
        progress=False,
    )
    model, problems = load_hf(tmp_path / "hf")
    assert problems == {} and torch.equal(tm.logits(model), reference_logits[name])
    assert result.verification.ok


def test_experts_become_chunks_of_the_stack(exports) -> None:
    result, out = exports["qwen3_moe", "torchtitan"]
    stack = "layers.2.moe.routed_experts.inner_experts.w2_EDF"
    md = dcp.FileSystemReader(out).read_metadata().state_dict_metadata[stack]
    assert tuple(md.size) == (4, 64, 48)
    assert sorted(tuple(c.offsets) for c in md.chunks) == [(e, 0, 0) for e in range(4)]
    pieces = [f"model.layers.2.mlp.experts.{e}.down_proj.weight" for e in range(4)]
    assert all(result.names[p] == stack for p in pieces)
    assert "one expert of torchtitan's stack" in result.conversions[f"{stack} at [3, 0, 0]"]
    bias = "layers.0.moe.expert_bias_E"
    assert "zeros" in result.conversions[bias]
    assert result.names["model.layers.0.mlp.gate.weight"] == "layers.0.moe.router.gate.weight"
    assert any("expert_bias_E x2" in note for note in result.notes)
    assert result.tensors == len(dcp.FileSystemReader(out).read_metadata().state_dict_metadata)
    assert result.arch == "qwen3_moe" and "HF names" in result.reason
    assert result.reason.endswith("written in torchtitan 0.3 names")


def test_rope_permutation_is_undone(exports, torchtitan_models) -> None:
    result, out = exports["llama3", "torchtitan-2025"]
    assert "4 heads" in result.conversions["layers.0.attention.wq.weight"]
    assert "2 heads" in result.conversions["layers.0.attention.wk.weight"]
    hub = tm.hub_state(torchtitan_models.hf("llama3"))
    ck = inspector.open(out)
    assert not torch.equal(
        ck.read("layers.0.attention.wk.weight"), hub["model.layers.0.self_attn.k_proj.weight"]
    )
    assert torch.equal(
        ck.read("layers.0.attention.wv.weight"), hub["model.layers.0.self_attn.v_proj.weight"]
    )


def test_a_folder_without_config_needs_hf_config(torchtitan_models, tmp_path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(torchtitan_models.hf("llama3") / "model.safetensors", bare)
    with pytest.raises(InspectorError, match=r"needs num_attention_heads .*hf_config"):
        inspector.export(bare, tmp_path / "out", format="dcp", progress=False)
    assert not (tmp_path / "out").exists()
    config = torchtitan_models.config("llama3")
    result = inspector.export(bare, tmp_path / "out", format="dcp", hf_config=config)
    assert result.verification.ok and result.arch == "llama3"


@pytest.mark.parametrize(
    ("written", "match"),
    [(b'{"hidden_size": 64,', "the config is malformed"), (b"[1, 2]", "not a JSON object")],
)
def test_a_damaged_config_beside_the_weights_is_named(
    torchtitan_models, tmp_path: Path, written: bytes, match: str
) -> None:
    folder = tmp_path / "damaged"
    folder.mkdir()
    shutil.copy(torchtitan_models.hf("llama3") / "model.safetensors", folder)
    (folder / "config.json").write_bytes(written)
    with pytest.raises(InspectorError, match=match) as raised:
        inspector.export(folder, tmp_path / "out", format="dcp", progress=False)
    assert "config.json" in str(raised.value)
    assert not (tmp_path / "out").exists()


def test_torchtitan_names_are_refused_as_a_source(torchtitan_models, tmp_path) -> None:
    with pytest.raises(InspectorError, match="these keys are not HF names"):
        inspector.export(
            torchtitan_models.dcp("qwen3", "torchtitan", "flat"),
            tmp_path / "out",
            format="dcp",
            hf_config=torchtitan_models.config("qwen3"),
            progress=False,
        )
    assert not (tmp_path / "out").exists()


def test_cli_writes_the_chosen_naming(torchtitan_models, tmp_path, capsys) -> None:
    source = torchtitan_models.hf("qwen3")
    args = ["export", str(source), str(tmp_path / "out"), "--format", "dcp"]
    assert main([*args, "--naming", "torchtitan-2025", "--arch", "qwen3"]) == 0
    printed = capsys.readouterr().out
    assert "arch qwen3: given as arch='qwen3'; written in torchtitan July-2025" in printed
    keys = inspector.open(tmp_path / "out").keys()
    assert "output.weight" in keys and "layers.1.attention.wq.weight" in keys
    assert hf.detect(keys).naming == "torchtitan-2025"
