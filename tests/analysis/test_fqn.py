"""The FQN doctor against real wrappers, real load errors and the demo checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import inspector
from inspector.analysis.fqn import TABLE_COLUMNS, KeyReport, resolve_against
from inspector.demo.model import TinyLlama, TinyLlamaConfig, build_model
from inspector.errors import InspectorError
from tests.conftest import save_dcp

MODEL_KEYS = list(build_model().state_dict())


def ac_wrapped() -> TinyLlama:
    """TinyLlama with activation checkpointing on every block, as torchtitan applies it."""
    model = build_model()
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block)
    return model


class WithBackbone(nn.Module):
    """A model that holds TinyLlama as ``llm``: its keys gain an ``llm.`` prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.llm = build_model()
        self.head = nn.Linear(64, 2)


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints saved with DCP from the state dicts real wrappers produce."""
    out = tmp_path_factory.mktemp("wrapped")
    states = {
        "compiled": torch.compile(build_model()).state_dict(),
        "parallel": nn.DataParallel(build_model()).state_dict(),
        "ac_named": dict(ac_wrapped().named_parameters()),
        "backbone": WithBackbone().state_dict(),
    }
    return {name: save_dcp(state, out / name) for name, state in states.items()}


def assert_fixed_by(report: KeyReport, description: str) -> None:
    """The named rewrite ranks first and resolves every key mismatch."""
    assert not report.ok
    best = report.suggestions[0]
    assert best.description == description
    assert best.resolves == len(report.missing) + len(report.unexpected) > 0
    assert best.remaining == 0
    assert report.after().ok
    resolves = [s.resolves for s in report.suggestions]
    assert resolves == sorted(resolves, reverse=True)


def load_renamed(report: KeyReport, ck: inspector.Checkpoint, module: nn.Module) -> None:
    """Load the checkpoint into ``module`` through ``report.mapping()``; strict must pass."""
    mapping = report.mapping()
    module.load_state_dict({mapping[k]: ck.read(k) for k in mapping}, strict=True)


# --- the demo checkpoints ------------------------------------------------------------------
def test_flat_matches_as_stored(demo_dir: Path) -> None:
    report = inspector.check_keys(inspector.open(demo_dir / "flat"), build_model())
    assert report.ok and report.suggestions == [] and report.best is None
    assert report.matched == MODEL_KEYS and report.missing == report.unexpected == []
    assert report.mapping() == {k: k for k in MODEL_KEYS}
    assert report.spelling == "stored"
    assert report.explain().endswith("Every key, shape and dtype matches.")


def test_prefixed_is_fixed_by_stripping_model(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "prefixed")
    report = inspector.check_keys(ck, build_model())
    assert report.missing == MODEL_KEYS
    assert report.unexpected == [f"model.{k}" for k in MODEL_KEYS]
    assert_fixed_by(report, "strip 'model.'")
    assert report.suggestions[0].resolves == 42
    assert report.mapping() == {f"model.{k}": k for k in MODEL_KEYS}
    assert repr(report) == (
        "<KeyReport mismatch (stored spelling): 0 matched, 21 missing, 21 unexpected, "
        "0 shape and 0 dtype mismatches; best rewrite: strip 'model.'>"
    )
    model = build_model(seed=7)
    load_renamed(report, ck, model)
    assert torch.equal(model.norm.weight, ck.read("model.norm.weight"))


def test_flattened_spelling_needs_no_rewrite(demo_dir: Path) -> None:
    report = inspector.check_keys(demo_dir / "prefixed", build_model(), spelling="flattened")
    assert report.ok and report.spelling == "flattened"
    assert "without their component prefix" in report.explain()


def test_meta_device_model(demo_dir: Path) -> None:
    with torch.device("meta"):
        model = build_model()
    assert model.output.weight.is_meta
    report = inspector.check_keys(demo_dir / "flat", model)
    assert report.ok and len(report.matched) == 21


def test_genuine_shape_mismatch_survives_the_rewrite(demo_dir: Path) -> None:
    report = inspector.check_keys(demo_dir / "prefixed", TinyLlama(TinyLlamaConfig(vocab_size=300)))
    assert_shapes = {(m.model_key, m.checkpoint, m.model) for m in report.after().shape_mismatches}
    assert report.suggestions[0].description == "strip 'model.'"
    assert report.suggestions[0].remaining == 0
    assert report.suggestions[0].shape_mismatches == 2
    assert assert_shapes == {
        ("tok_embeddings.weight", (256, 64), (300, 64)),
        ("output.weight", (256, 64), (300, 64)),
    }
    after = report.after()
    assert not after.ok and not after.loadable
    assert after.missing == after.unexpected == []
    text = report.explain()
    assert "2 shape mismatches ('tok_embeddings.weight': [256, 64] in the checkpoint" in text
    assert "no rename fixes that" in text


def test_dtype_mismatch_is_reported_but_loadable(demo_dir: Path) -> None:
    report = inspector.check_keys(demo_dir / "flat", build_model().to(torch.bfloat16))
    assert not report.ok and report.loadable
    assert len(report.dtype_mismatches) == 21 and report.suggestions == []
    first = report.dtype_mismatches[0]
    assert (first.model_key, first.checkpoint, first.model) == (
        "tok_embeddings.weight",
        "float32",
        "bfloat16",
    )
    assert "load_state_dict casts dtypes" in report.explain()


# --- real wrappers -------------------------------------------------------------------------
def test_torch_compile_prefix(demo_dir: Path, wrapped: dict[str, Path]) -> None:
    compiled = torch.compile(build_model(seed=3))
    report = inspector.check_keys(demo_dir / "flat", compiled)
    assert report.missing[0] == "_orig_mod.tok_embeddings.weight"
    assert_fixed_by(report, "add '_orig_mod.'")
    assert report.suggestions[0].why == "torch.compile"
    flat = inspector.open(demo_dir / "flat")
    load_renamed(report, flat, compiled)
    assert torch.equal(compiled.output.weight, flat.read("output.weight"))
    back = inspector.check_keys(wrapped["compiled"], build_model())
    assert_fixed_by(back, "strip '_orig_mod.'")


def test_data_parallel_prefix(demo_dir: Path, wrapped: dict[str, Path]) -> None:
    parallel = nn.DataParallel(build_model(seed=3))
    assert_fixed_by(inspector.check_keys(demo_dir / "seed", parallel), "add 'module.'")
    report = inspector.check_keys(demo_dir / "prefixed", parallel)
    assert_fixed_by(report, "replace 'model.' with 'module.'")
    load_renamed(report, inspector.open(demo_dir / "prefixed"), parallel)
    back = inspector.check_keys(wrapped["parallel"], build_model())
    assert_fixed_by(back, "strip 'module.'")
    model = build_model(seed=5)
    load_renamed(back, inspector.open(wrapped["parallel"]), model)
    assert torch.equal(model.layers["1"].ffn_norm.weight, build_model().layers["1"].ffn_norm.weight)


def test_checkpoint_wrapper_nested_prefix(demo_dir: Path, wrapped: dict[str, Path]) -> None:
    names = [name for name, _ in ac_wrapped().named_parameters()]
    assert "layers.0._checkpoint_wrapped_module.attention.wq.weight" in names
    assert_fixed_by(
        inspector.check_keys(demo_dir / "flat", names),
        "add '_checkpoint_wrapped_module.' after layers.0, layers.1",
    )
    report = inspector.check_keys(demo_dir / "prefixed", names)
    assert_fixed_by(
        report, "strip 'model.' then add '_checkpoint_wrapped_module.' after layers.0, layers.1"
    )
    assert report.mapping()["model.layers.1.ffn_norm.weight"] == (
        "layers.1._checkpoint_wrapped_module.ffn_norm.weight"
    )
    assert [s.description for s in report.suggestions][1:] == ["strip 'model.'"]
    back = inspector.check_keys(wrapped["ac_named"], build_model())
    assert_fixed_by(back, "strip '_checkpoint_wrapped_module.'")
    load_renamed(back, inspector.open(wrapped["ac_named"]), ac_wrapped())


def test_inferred_prefix_difference(demo_dir: Path, wrapped: dict[str, Path]) -> None:
    whole = WithBackbone()
    report = inspector.check_keys(demo_dir / "flat", whole)
    assert report.missing[-2:] == ["head.weight", "head.bias"]
    best = report.suggestions[0]
    assert (best.description, best.resolves, best.remaining) == ("add 'llm.'", 42, 2)
    assert report.after().missing == ["head.weight", "head.bias"]
    back = inspector.check_keys(wrapped["backbone"], build_model())
    assert back.suggestions[0].description == "strip 'llm.'"
    assert back.after().unexpected == ["head.weight", "head.bias"]


# --- what `against` can be -----------------------------------------------------------------
def test_against_state_dicts_keys_and_checkpoints(demo_dir: Path) -> None:
    prefixed = inspector.open(demo_dir / "prefixed")
    shapes = {k: list(v.shape) for k, v in build_model().state_dict().items()}
    cases = [
        (build_model().state_dict(), "the given state dict"),
        ({"model": build_model().state_dict()}, "the given state dict"),
        (shapes, "the given state dict"),
        (MODEL_KEYS, "the given key list"),
        (demo_dir / "seed", f"the model entries of {demo_dir / 'seed'} (stored)"),
        (str(demo_dir / "flat"), f"the model entries of {demo_dir / 'flat'} (stored)"),
        (prefixed, f"the model entries of {demo_dir / 'prefixed'} (stored)"),
    ]
    for against, description in cases:
        report = inspector.check_keys(prefixed, against)
        assert report.against == description
        expect_ok = against is prefixed or (isinstance(against, dict) and "model" in against)
        assert report.ok == expect_ok, against
        if not expect_ok:
            assert report.suggestions[0].description == "strip 'model.'"
    assert inspector.check_keys(prefixed, shapes).theirs["output.weight"] == ((256, 64), None)
    with pytest.raises(TypeError, match="against must be"):
        inspector.check_keys(prefixed, 42)


def test_table_and_json(demo_dir: Path) -> None:
    report = inspector.check_keys(demo_dir / "prefixed", TinyLlama(TinyLlamaConfig(vocab_size=300)))
    table = report.table()
    assert list(table.columns) == list(TABLE_COLUMNS)
    assert table.status.value_counts().to_dict() == {"unexpected": 21, "missing": 21}
    row = table.set_index("checkpoint_key").loc["model.output.weight"]
    assert (row.rewritten_key, row.status_after, row.checkpoint_shape) == (
        "output.weight",
        "shape mismatch",
        (256, 64),
    )
    missing = table[table.status == "missing"]
    assert set(missing.status_after) == {"matched"}
    payload = json.loads(json.dumps(report.as_dict()))
    assert payload["counts"] == {
        "checkpoint": 21,
        "model": 21,
        "matched": 0,
        "missing": 21,
        "unexpected": 21,
        "shape_mismatches": 0,
        "dtype_mismatches": 0,
    }
    assert payload["suggestions"][0]["steps"] == ["strip 'model.'"]
    after = payload["after_best"]
    assert after["counts"]["shape_mismatches"] == 2 and not after["ok"]
    assert after["renamed"]["model.norm.weight"] == "norm.weight"
    assert after["shape_mismatches"][1] == {
        "checkpoint_key": "model.output.weight",
        "model_key": "output.weight",
        "checkpoint": [256, 64],
        "model": [300, 64],
    }


# --- explain_error -------------------------------------------------------------------------
def load_error(fn) -> str:
    try:
        fn()
    except BaseException as exc:  # DCP raises CheckpointException, a BaseException
        return str(exc)
    raise AssertionError("the load did not fail")


def test_explain_load_state_dict_missing_and_unexpected(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "prefixed")
    state = {k: ck.read(k) for k in ck.keys() if ck.entry(k).component == "model"}
    text = load_error(lambda: build_model().load_state_dict(state))
    assert text.startswith("Error(s) in loading state_dict for TinyLlama")
    report = inspector.explain_error(ck, text)
    assert report.spelling == "stored"
    assert "TinyLlama as its load_state_dict error describes it (21 missing, 21 unexpected" in (
        report.against
    )
    assert sorted(report.missing) == sorted(MODEL_KEYS)
    assert_fixed_by(report, "strip 'model.'")


def test_explain_load_state_dict_size_mismatch(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "prefixed")
    state = {keys: ck.read(f"model.{keys}") for keys in MODEL_KEYS}
    model = TinyLlama(TinyLlamaConfig(vocab_size=300))
    report = inspector.explain_error(ck, load_error(lambda: model.load_state_dict(state)))
    assert report.spelling == "flattened"
    assert report.missing == report.unexpected == [] and report.loadable is False
    assert {(m.model_key, m.model) for m in report.shape_mismatches} == {
        ("tok_embeddings.weight", (300, 64)),
        ("output.weight", (300, 64)),
    }


def test_explain_dcp_missing_key(demo_dir: Path) -> None:
    text = load_error(
        lambda: dcp.load({"model": build_model().state_dict()}, checkpoint_id=demo_dir / "flat")
    )
    assert "Missing key in checkpoint state_dict: model." in text
    report = inspector.explain_error(demo_dir / "flat", text)
    assert report.partial and report.unexpected == []
    assert len(report.theirs) == 1 and next(iter(report.theirs)).startswith("model.")
    assert_fixed_by(report, "add 'model.'")
    assert report.mapping() == {k: f"model.{k}" for k in MODEL_KEYS}
    assert "known only in part" in report.explain()
    compiled = torch.compile(build_model()).state_dict()
    text = load_error(lambda: dcp.load(compiled, checkpoint_id=demo_dir / "flat"))
    report = inspector.explain_error(demo_dir / "flat", text)
    assert_fixed_by(report, "add '_orig_mod.'")


def test_explain_dcp_size_mismatch(demo_dir: Path) -> None:
    model = TinyLlama(TinyLlamaConfig(vocab_size=300))
    text = load_error(lambda: dcp.load(model.state_dict(), checkpoint_id=demo_dir / "flat"))
    report = inspector.explain_error(demo_dir / "flat", text)
    [mismatch] = report.shape_mismatches
    assert mismatch.model == (300, 64) and mismatch.checkpoint == (256, 64)
    assert report.suggestions == [] and "Shapes differ for real" in report.explain()


def test_explain_error_needs_an_error(demo_dir: Path) -> None:
    with pytest.raises(InspectorError, match="no load_state_dict or DCP key error"):
        inspector.explain_error(demo_dir / "flat", "CUDA out of memory")


# --- consistency within one checkpoint -----------------------------------------------------
@pytest.mark.parametrize("name", ["flat", "prefixed", "seed", "fp8"])
def test_demo_checkpoints_are_consistent(demo_dir: Path, name: str) -> None:
    result = inspector.open(demo_dir / name).consistency()
    assert result.ok and result.findings == ()
    assert "consistent" in result.text()


def test_optimizer_names_unknown_to_the_model(tmp_path: Path) -> None:
    """Model saved from the compiled module's state_dict, optimizer from DSD (clean names)."""
    model = build_model()
    compiled = torch.compile(model)
    optim = torch.optim.AdamW(compiled.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    state = {
        "model": compiled.state_dict(),
        "optimizer": get_optimizer_state_dict(
            compiled, optim, options=StateDictOptions(flatten_optimizer_state_dict=True)
        ),
    }
    result = inspector.open(save_dcp(state, tmp_path / "ck")).consistency()
    assert [f.kind for f in result.findings] == ["optimizer-fqn", "optimizer-fqn"]
    state_finding = result.findings[0]
    assert "optimizer state refers to 21 parameter names" in state_finding.message
    assert len(state_finding.keys) == 21 * 3
    assert state_finding.fix == (
        "add '_orig_mod.' (torch.compile) makes 21 of 21 unknown names match the model part"
    )
    assert result.findings[1].message.startswith("optimizer param_groups refers to 21")
    assert "fix: add '_orig_mod.'" in result.text()


def test_duplicate_spellings(tmp_path: Path) -> None:
    sd = build_model().state_dict()
    ck = inspector.open(save_dcp({"model": sd, **sd}, tmp_path / "ck"))
    [finding] = ck.consistency().findings
    assert finding.kind == "duplicate-spelling"
    assert finding.message.startswith(
        "21 weights are stored under more than one spelling, e.g. "
        "'model.tok_embeddings.weight' and 'tok_embeddings.weight'; shapes and dtypes agree"
    )
    assert len(finding.keys) == 42
    assert ck.consistency().as_dict()["findings"][0]["kind"] == "duplicate-spelling"


# --- what a typed "compare with" names ----------------------------------------------------
def test_resolve_against(tmp_path: Path) -> None:
    model = resolve_against(" inspector.demo.model:build_model ")
    assert isinstance(model, TinyLlama)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert list(model.state_dict()) == MODEL_KEYS
    assert resolve_against(str(tmp_path)) == tmp_path
    lookalike = tmp_path / "pkg:factory"
    lookalike.mkdir()
    assert resolve_against(str(lookalike)) == lookalike
    with pytest.raises(InspectorError, match="nothing to compare with"):
        resolve_against("  ")
    with pytest.raises(InspectorError, match="cannot import 'no_such_module:build'"):
        resolve_against("no_such_module:build")
