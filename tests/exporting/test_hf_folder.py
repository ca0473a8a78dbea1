"""``inspector.export(..., format="hf")`` against real consumers: torchtitan-named DCP
checkpoints (both naming generations, flat and prefixed, 2 FSDP2 ranks, FP8 wrappers, a
torch.compile'd module) become folders that ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load, with logits bit-identical to the original model's."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

import inspector
from inspector.errors import InspectorError, UsageError
from inspector.exporting import hf
from inspector.exporting.plan import ARCHITECTURE_NAMES
from inspector.ui.cli import main
from tests.fixtures import torchtitan_models as tm

CASES = [
    (name, naming, layout) for name in tm.MODELS for naming in tm.NAMINGS for layout in tm.LAYOUTS
] + [("llama3", "torchtitan", "fsdp"), ("llama3", "torchtitan-2025", "fp8")]
COMPONENTS = ("optimizer", "lr_scheduler", "dataloader", "train_state")


def case_id(case: tuple) -> str:
    return "-".join(case)


def load_hf(folder: Path, dtype: torch.dtype = torch.float32):
    """The model as transformers loads it, and whatever it reports missing or unexpected."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, output_loading_info=True
    )
    return model.eval(), {k: v for k, v in info.items() if v}


def written_names(folder: Path) -> set[str]:
    names = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            names |= set(f.keys())
    return names


def quiet_save(state: dict, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    return path


def titan_state(path: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a torchtitan-named checkpoint, as torch's DCP reader reads them."""
    import torchao.float8  # noqa: F401  (the FP8 save pickles torchao wrappers)

    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    keys = [k for k, v in md.items() if hasattr(v, "chunks") and k.split(".")[0] not in COMPONENTS]
    state = {k: torch.empty(tuple(md[k].size), dtype=md[k].properties.dtype) for k in keys}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


@pytest.fixture(scope="module")
def reference_logits(torchtitan_models) -> dict[str, torch.Tensor]:
    return {name: tm.logits(load_hf(torchtitan_models.hf(name))[0]) for name in tm.MODELS}


@pytest.fixture(scope="module")
def exports(torchtitan_models, tmp_path_factory) -> dict[tuple, tuple]:
    """Every case exported once (arch="auto", config and tokenizer from the HF assets)."""
    root = tmp_path_factory.mktemp("hf_exports")
    done = {}
    for case in CASES:
        name, naming, layout = case
        out = root / case_id(case)
        result = inspector.export(
            torchtitan_models.dcp(name, naming, layout),
            out,
            format="hf",
            hf_assets=torchtitan_models.assets(name),
            progress=False,
        )
        done[case] = (result, out)
    return done


# --- the folder loads, and computes what the original computes -----------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_from_pretrained_gives_the_original_logits(exports, reference_logits, case) -> None:
    result, out = exports[case]
    model, problems = load_hf(out)
    assert problems == {}
    assert torch.equal(tm.logits(model), reference_logits[case[0]])
    assert result.verification is not None and result.verification.ok
    assert result.verification.checked == result.tensors == len(written_names(out))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_result_says_which_arch_why_and_what_was_left_out(exports, torchtitan_models, case):
    name, naming, layout = case
    result, out = exports[case]
    assert (result.format, result.arch) == ("hf", name)
    assert hf.NAMINGS[naming] in result.reason and name in result.reason
    stored = inspector.open(torchtitan_models.dcp(name, naming, layout)).keys()
    training = [k for k in stored if k.split(".")[0] in COMPONENTS]
    assert training and all(result.skipped[k].endswith("not a model weight") for k in training)
    assert not any(n.split(".")[0] in COMPONENTS for n in written_names(out))
    model_left_out = {k: why for k, why in result.skipped.items() if k not in training}
    prefix = "model." if layout == "prefixed" else ""
    head = prefix + ("lm_head.weight" if naming == "torchtitan" else "output.weight")
    expected = {prefix + k for k in tm.torchtitan_only(name, naming)}
    if tm.hf_config(name).tie_word_embeddings:
        expected.add(head)
        assert "tied" in model_left_out[head]
    assert set(model_left_out) == expected
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == torchtitan_models.config(name)["architectures"]
    assert config["dtype"] == "float32" and "torch_dtype" not in config


def test_assets_are_copied_byte_for_byte_and_the_tokenizer_loads(exports, torchtitan_models):
    from transformers import AutoTokenizer

    _, out = exports["qwen3", "torchtitan", "flat"]
    assets = torchtitan_models.assets("qwen3")
    copied = sorted(p.name for p in assets.iterdir() if p.name != "config.json")
    assert copied == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    for name in copied:
        assert (out / name).read_bytes() == (assets / name).read_bytes(), name
    ours, theirs = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(assets)
    ids = ours(tm.SENTENCES[1])["input_ids"]
    assert ids == theirs(tm.SENTENCES[1])["input_ids"] and len(ids) == 8
    assert ours.decode(ids) == tm.SENTENCES[1]


def test_config_is_completed_and_checked(exports, torchtitan_models) -> None:
    _, out = exports["qwen3_moe", "torchtitan-2025", "prefixed"]
    config = json.loads((out / "config.json").read_text())
    given = torchtitan_models.config("qwen3_moe")
    assert {k: v for k, v in config.items() if k in given} == given | {"dtype": "float32"}
    assert (config["num_key_value_heads"], config["head_dim"], config["mlp_only_layers"]) == (
        2,
        16,
        [1],
    )


# --- dtype, shards ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama3", "qwen3_moe"])
def test_bfloat16_equals_the_original_with_its_parameters_cast(
    torchtitan_models, name, tmp_path
) -> None:
    out = tmp_path / "bf16"
    config = torchtitan_models.config(name)
    del config["dtype"]  # as transformers 4 configs spell it: torch_dtype, filled in
    result = inspector.export(
        torchtitan_models.dcp(name, "torchtitan", "flat"),
        out,
        format="hf",
        hf_config=config,
        dtype="bfloat16",
        progress=False,
    )
    assert result.verification.ok
    assert all("cast to bfloat16" in c for c in result.conversions.values())
    model, problems = load_hf(out, torch.bfloat16)
    original = load_hf(torchtitan_models.hf(name), torch.float32)[0]
    for p in original.parameters():  # the parameters only: RoPE buffers stay float32
        p.data = p.data.to(torch.bfloat16)
    assert problems == {} and torch.equal(tm.logits(model), tm.logits(original))
    written = json.loads((out / "config.json").read_text())
    assert written["torch_dtype"] == "bfloat16" and "dtype" not in written


def test_small_max_shard_size_gives_shards_and_an_index(
    torchtitan_models, reference_logits, tmp_path
) -> None:
    out = tmp_path / "sharded"
    result = inspector.export(
        torchtitan_models.dcp("qwen3_moe", "torchtitan", "flat"),
        out,
        format="hf",
        hf_assets=torchtitan_models.assets("qwen3_moe"),
        max_shard_size="100KB",
        progress=False,
    )
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and not (out / "model.safetensors").exists()
    assert result.index == out / "model.safetensors.index.json"
    index = json.loads(result.index.read_text())
    assert set(index["weight_map"]) == written_names(out)
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == result.bytes
    assert all(p.stat().st_size <= 100_000 + 20_000 for p in shards)  # a tensor never splits
    model, problems = load_hf(out)
    assert problems == {} and torch.equal(tm.logits(model), reference_logits["qwen3_moe"])
    assert result.verification.ok and result.verification.checked == len(index["weight_map"])


def test_each_source_tensor_is_read_once(torchtitan_models, tmp_path) -> None:
    """Streaming: the stacked experts (most of the bytes) are read once for all their
    experts, not once per expert; pickles and metadata add a little."""
    ck = inspector.open(torchtitan_models.dcp("qwen3_moe", "torchtitan", "flat"))
    stacks = sum(e.nbytes for e in ck.entries() if "inner_experts" in e.key)
    weights = sum(e.nbytes for e in ck.entries() if e.component == "model")
    assert stacks > weights / 2
    before = ck.io.bytes
    result = inspector.export(
        ck,
        tmp_path / "out",
        format="hf",
        hf_assets=torchtitan_models.assets("qwen3_moe"),
        verify=False,
        progress=False,
    )
    assert result.verification is None
    assert weights <= ck.io.bytes - before < 1.25 * weights


# --- key spellings and FP8 ------------------------------------------------------------------


def test_wrapper_segments_are_stripped_via_the_model_fqn(
    torchtitan_models, reference_logits, tmp_path
) -> None:
    """A torch.compile'd torchtitan module saves ``_orig_mod.``-prefixed keys."""
    state = titan_state(torchtitan_models.dcp("qwen3", "torchtitan", "flat"))
    compiled = torch.compile(tm.titan_module(state, tm.tied_names("qwen3", "torchtitan")))
    path = quiet_save(compiled.state_dict(), tmp_path / "compiled")
    assert "_orig_mod.layers.0.attention.q_norm.weight" in inspector.open(path).keys()
    result = inspector.export(
        path,
        tmp_path / "out",
        format="hf",
        hf_assets=torchtitan_models.assets("qwen3"),
        progress=False,
    )
    model, problems = load_hf(tmp_path / "out")
    assert problems == {} and torch.equal(tm.logits(model), reference_logits["qwen3"])
    assert result.names["_orig_mod.norm.weight"] == "model.norm.weight"


def test_fp8_wrappers_are_unwrapped_before_the_permutation(exports) -> None:
    result, _ = exports["llama3", "torchtitan-2025", "fp8"]
    wq = result.conversions["model.layers.0.self_attn.q_proj.weight"]
    assert wq.startswith("layers.0.attention.wq.weight: unwrap WeightWithDynamicFloat8CastTensor")
    assert "RoPE rows" in wq and "4 heads" in wq
    assert "k_proj" in "".join(result.conversions) and "2 heads" in str(result.conversions)


# --- tied heads ------------------------------------------------------------------------------


def untied_qwen3(torchtitan_models, tmp_path: Path) -> Path:
    """qwen3 saved with a head that is no longer the embedding (as an untied run saves it)."""
    state = titan_state(torchtitan_models.dcp("qwen3", "torchtitan", "flat"))
    state["lm_head.weight"] = state["lm_head.weight"] + 0.01
    return quiet_save(state, tmp_path / "untied")


def test_a_tied_head_that_differs_is_refused_naming_the_field(torchtitan_models, tmp_path):
    path = untied_qwen3(torchtitan_models, tmp_path)
    with pytest.raises(InspectorError, match=r"tie_word_embeddings is true, but 'lm_head.weight'"):
        inspector.export(
            path,
            tmp_path / "out",
            format="hf",
            hf_assets=torchtitan_models.assets("qwen3"),
            progress=False,
        )
    assert not (tmp_path / "out").exists()


def test_an_untied_config_keeps_the_head(torchtitan_models, tmp_path) -> None:
    path = untied_qwen3(torchtitan_models, tmp_path)
    config = torchtitan_models.config("qwen3") | {"tie_word_embeddings": False}
    inspector.export(path, tmp_path / "out", format="hf", hf_config=config, progress=False)
    model, problems = load_hf(tmp_path / "out")
    assert problems == {} and model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, inspector.open(path).read("lm_head.weight"))


# --- facts that cannot be known, and nothing left on disk -----------------------------------


def test_a_missing_fact_names_itself_and_the_argument(torchtitan_models, tmp_path) -> None:
    config = dict(torchtitan_models.config("llama3"))
    del config["num_key_value_heads"]
    path = torchtitan_models.dcp("llama3", "torchtitan", "flat")
    for hf_config, fact in ((config, "num_key_value_heads"), (None, "num_attention_heads")):
        with pytest.raises(InspectorError, match=rf"needs {fact} .*hf_config") as error:
            inspector.export(
                path, tmp_path / "new" / "out", format="hf", hf_config=hf_config, progress=False
            )
        assert "hf_assets" in str(error.value)
        assert list(tmp_path.iterdir()) == []


def test_a_config_file_contradicting_the_weights_names_the_field(torchtitan_models, tmp_path):
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(torchtitan_models.config("llama3") | {"intermediate_size": 99}))
    with pytest.raises(InspectorError, match=r"hf_config intermediate_size=99 does not match"):
        inspector.export(
            torchtitan_models.dcp("llama3", "torchtitan-2025", "prefixed"),
            tmp_path / "out",
            format="hf",
            hf_config=wrong,
            hf_assets=torchtitan_models.assets("llama3"),
            progress=False,
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wrong.json"]


def test_existing_output_is_kept_unless_overwrite(exports, torchtitan_models, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    path = torchtitan_models.dcp("llama3", "torchtitan", "flat")
    with pytest.raises(InspectorError, match="already exists"):
        inspector.export(
            path, out, format="hf", hf_assets=torchtitan_models.assets("llama3"), progress=False
        )
    assert [p.name for p in out.iterdir()] == ["config.json"]
    assert (out / "config.json").read_text() == "{}"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"format": "hf", "rename": {"a": "b"}}, "rename do not apply to format='hf'"),
        ({"format": "hf", "model_only": False}, "model_only do not apply"),
        ({"format": "hf", "fp8": "keep"}, "fp8 must be one of dequantize, unwrap, quantize"),
        ({"format": "dcp", "fp8": "quantize"}, "fp8 must be one of dequantize, unwrap for"),
        ({"format": "hf", "naming": "torchtitan"}, "naming applies to format='dcp'"),
        ({"format": "hf", "arch": "gpt2"}, "unknown arch 'gpt2'"),
        ({"format": "safetensors", "hf_assets": "x"}, "hf_assets only apply to format='hf'"),
    ],
)
def test_arguments_that_do_not_fit_are_refused(torchtitan_models, tmp_path, arguments, message):
    with pytest.raises(InspectorError, match=message):
        inspector.export(
            torchtitan_models.dcp("llama3", "torchtitan", "flat"),
            tmp_path / "out",
            progress=False,
            **arguments,
        )
    assert not (tmp_path / "out").exists()


def test_an_assets_path_that_is_no_folder_is_named(torchtitan_models, tmp_path) -> None:
    with pytest.raises(InspectorError, match=r"no-such-assets: hf_assets is not a folder"):
        inspector.export(
            torchtitan_models.dcp("llama3", "torchtitan", "flat"),
            tmp_path / "out",
            format="hf",
            hf_assets=tmp_path / "no-such-assets",
            progress=False,
        )
    assert list(tmp_path.iterdir()) == []


def test_usage_errors_are_value_errors(torchtitan_models, tmp_path) -> None:
    with pytest.raises(UsageError):
        inspector.export(torchtitan_models.hf("llama3"), tmp_path / "o", format="hf", nested=True)


def test_the_clis_architecture_list_is_the_registry() -> None:
    assert tuple(hf.ARCHITECTURES) == ARCHITECTURE_NAMES


# --- the command line ------------------------------------------------------------------------


def test_cli_exports_an_hf_folder(torchtitan_models, reference_logits, tmp_path, capsys) -> None:
    exe = Path(sys.executable).with_name("ckpt-inspect")
    args = [
        "export",
        str(torchtitan_models.dcp("qwen3", "torchtitan-2025", "prefixed")),
        str(tmp_path / "out"),
        "--format",
        "hf",
        "--arch",
        "auto",
        "--hf-assets",
        str(torchtitan_models.assets("qwen3")),
    ]
    done = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "arch qwen3: all 25 model weights match its rules in torchtitan July-2025" in done.stdout
    assert "verified 24 tensors bit-exact" in done.stdout
    model, problems = load_hf(tmp_path / "out")
    assert problems == {} and torch.equal(tm.logits(model), reference_logits["qwen3"])
    assert main([*args[:2], str(tmp_path / "again"), *args[3:5], "--hf-config", "no.json"]) != 0
    assert "cannot read hf_config" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()
