"""Components, layouts, views and optimizer references, on checkpoints saved by real torch code."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import inspector
from inspector.demo.model import build_model
from inspector.keys import filters, optimizer, spellings
from tests.conftest import save_dcp

MODEL_KEYS = list(build_model().state_dict())


@pytest.mark.parametrize("name", ["flat", "prefixed", "seed"])
def test_views_spell_model_keys(demo_dir: Path, name: str) -> None:
    entries = [e for e in inspector.open(demo_dir / name).entries() if e.component == "model"]
    assert [spellings.view_key(e, "flattened") for e in entries] == MODEL_KEYS
    assert [spellings.view_key(e, "prefixed") for e in entries] == [
        f"model.{k}" for k in MODEL_KEYS
    ]
    stored = MODEL_KEYS if name != "prefixed" else [f"model.{k}" for k in MODEL_KEYS]
    assert [spellings.view_key(e, "stored") for e in entries] == stored


def test_views_leave_other_components_alone(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "prefixed")
    entry = ck.entry("optimizer.state.norm.weight.exp_avg")
    assert {spellings.view_key(entry, v) for v in spellings.VIEWS} == {entry.key}
    with pytest.raises(ValueError, match="view must be one of"):
        spellings.view_key(ck.entry("model.norm.weight"), "hf")


def test_describe_layout_names_the_evidence(demo_dir: Path) -> None:
    text = inspector.open(demo_dir / "prefixed").describe_layout()
    assert "layout: prefixed" in text
    assert "nested paths from DCP planner_data" in text
    assert "21 model keys stored under the 'model' prefix" in text
    assert "optimizer (315 keys)" in text
    flat = inspector.open(demo_dir / "flat").describe_layout()
    assert "21 model keys stored at top level, e.g. 'tok_embeddings.weight'" in flat
    assert "torchtitan's current layout" in flat


def test_dotted_names_are_the_fallback(tmp_path: Path) -> None:
    """Without planner_data (a planner that does not flatten) components come from key heads."""
    state = {
        "model.norm.weight": torch.ones(4),
        "optimizer.state.norm.weight.exp_avg": torch.zeros(4),
        "train_state.step": torch.tensor(3),
    }
    path = save_dcp(state, tmp_path / "ck", planner=DefaultSavePlanner(flatten_state_dict=False))
    ck = inspector.open(path)
    assert ck.source.nesting == "key names (no planner_data)"
    assert ck.components() == {"model": 1, "optimizer": 1, "train_state": 1}
    assert ck.entry("model.norm.weight").nested_path == ("model", "norm.weight")
    assert ck.layout == "prefixed"
    assert "nested paths from key names (no planner_data)" in ck.describe_layout()


def test_hf_names_alone_stay_model_only(tmp_path: Path) -> None:
    """A lone ``model.`` head is a Hugging Face name, not torchtitan's prefix."""
    state = {"model.embed_tokens.weight": torch.ones(4, 2), "lm_head.weight": torch.ones(4, 2)}
    path = save_dcp(state, tmp_path / "ck", planner=DefaultSavePlanner(flatten_state_dict=False))
    ck = inspector.open(path)
    assert ck.layout == "model-only"
    assert spellings.model_fqn(ck.entry("model.embed_tokens.weight")) == "model.embed_tokens.weight"


class _WithExtraState(nn.Module):
    """Keeps extra state the way TransformerEngine does: bytes, or a dict of values."""

    def __init__(self, extra: object) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)
        self.extra = extra

    def get_extra_state(self) -> object:
        return self.extra

    def set_extra_state(self, state: object) -> None:
        self.extra = state


def test_extra_state_belongs_to_the_model(tmp_path: Path) -> None:
    module = nn.Sequential(
        _WithExtraState(io.BytesIO(b"fp8 meta")),
        _WithExtraState({"amax": torch.ones(2), "step": 3}),
    )
    ck = inspector.open(save_dcp({"model": module.state_dict()}, tmp_path / "ck"))
    flat = inspector.open(save_dcp(module.state_dict(), tmp_path / "flat"))
    assert ck.components() == flat.components() == {"model": 7}
    assert ck.entry("model.0._extra_state").kind == "object"
    assert flat.entry("1._extra_state.amax").nested_path == ("1._extra_state", "amax")
    assert spellings.model_fqn(flat.entry("1._extra_state.amax")) == "1._extra_state.amax"
    assert spellings.model_fqn(ck.entry("model.1._extra_state.step")) == "1._extra_state.step"


def test_mixed_spellings_are_flagged_in_the_evidence(tmp_path: Path) -> None:
    sd = build_model().state_dict()
    ck = inspector.open(save_dcp({"model": sd, **sd}, tmp_path / "ck"))
    assert ck.layout == "prefixed"
    assert "model keys under both spellings" in ck.describe_layout()


def test_wrapper_segments_from_real_wrappers() -> None:
    compiled = next(iter(torch.compile(build_model()).state_dict()))
    parallel = next(iter(nn.DataParallel(build_model()).state_dict()))
    assert (compiled, parallel) == (
        "_orig_mod.tok_embeddings.weight",
        "module.tok_embeddings.weight",
    )
    for key in (compiled, parallel, "model._orig_mod.layers.0._checkpoint_wrapped_module.w"):
        assert any(spellings.has_segment(key, w) for w in spellings.WRAPPER_PREFIXES)
    assert (
        spellings.canonical_fqn(compiled)
        == spellings.canonical_fqn(parallel)
        == "tok_embeddings.weight"
    )
    nested = "model.layers.0._checkpoint_wrapped_module.attention.wq.weight"
    assert spellings.canonical_fqn(nested) == "layers.0.attention.wq.weight"
    assert spellings.strip_segments("encoder.submodule.w", ["module."]) == "encoder.submodule.w"
    assert spellings.strip_segments("encoder.module.w", ["module."]) == "encoder.w"


@pytest.mark.parametrize("name", ["flat", "prefixed"])
def test_every_optimizer_entry_names_a_model_parameter(demo_dir: Path, name: str) -> None:
    ck = inspector.open(demo_dir / name)
    fqns = {spellings.model_fqn(e) for e in ck.entries() if e.component == "model"}
    refs = {e.key: optimizer.optimizer_ref(e) for e in ck.entries() if e.component == "optimizer"}
    assert all(r is not None for r in refs.values())
    resolved = {k: optimizer.resolve_optimizer_fqn(r, fqns) for k, r in refs.items()}
    assert set(resolved.values()) == fqns
    ref = refs["optimizer.state.layers.1.feed_forward.w2.weight.exp_avg_sq"]
    assert (ref.section, ref.text, ref.fqn) == (
        "state",
        "layers.1.feed_forward.w2.weight.exp_avg_sq",
        None,
    )
    assert ref.guessed_fqn == "layers.1.feed_forward.w2.weight"
    group = refs["optimizer.param_groups.norm.weight.lr"]
    assert (group.section, resolved["optimizer.param_groups.norm.weight.lr"]) == (
        "param_groups",
        "norm.weight",
    )


def test_nested_optimizer_paths_keep_the_exact_fqn(tmp_path: Path) -> None:
    """An unflattened DSD optimizer state keeps the FQN as one path element; ids name none."""
    model = build_model()
    optim = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {
        "optimizer": get_optimizer_state_dict(model, optim),
        "plain_optimizer": optim.state_dict(),
    }
    state["optimizer"].pop("param_groups")
    ck = inspector.open(save_dcp(state, tmp_path / "ck"))
    entry = ck.entry("optimizer.state.layers.0.attention.wq.weight.exp_avg")
    assert entry.nested_path == ("optimizer", "state", "layers.0.attention.wq.weight", "exp_avg")
    ref = optimizer.optimizer_ref(entry)
    assert (ref.fqn, ref.guessed_fqn) == ("layers.0.attention.wq.weight",) * 2
    by_id = [e for e in ck.entries() if e.key.startswith("plain_optimizer.state.0.")]
    assert by_id and all(optimizer.optimizer_ref(e) is None for e in by_id)


# --- filtering keys -------------------------------------------------------------------------
def test_key_filter_modes() -> None:
    key = "optimizer.state.layers.0.attention.wq.weight.exp_avg"
    assert filters.key_filter("ATTENTION.WQ")(key) and not filters.key_filter("wk")(key)
    assert filters.key_filter("optimizer.*.exp_avg", "glob")(key)
    assert not filters.key_filter("layers.*", "glob")(key)
    assert filters.key_filter("*.layers.[0-3].*", "glob")(key)
    assert filters.key_filter(r"layers\.\d+\.attention", "regex")(key)
    assert not filters.key_filter(r"^layers", "regex")(key)
    assert all(filters.key_filter("", mode)(key) for mode in filters.FILTER_MODES)
    with pytest.raises(inspector.InspectorError, match=r"not a valid regular expression '\('"):
        filters.key_filter("(", "regex")
    with pytest.raises(ValueError, match="filter mode must be one of"):
        filters.key_filter("x", "fuzzy")


def test_filter_entries_matches_the_view_spelling(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "prefixed")
    layer0 = [f"model.{k}" for k in MODEL_KEYS if k.startswith("layers.0.")]
    assert [
        e.key for e in filters.filter_entries(ck.entries(), "flattened", "layers.0.*", "glob")
    ] == (layer0)
    assert filters.filter_entries(ck.entries(), "stored", "layers.0.*", "glob") == []
    stored = filters.filter_entries(ck.entries(), "stored", "model.layers.0.*", "glob")
    assert [e.key for e in stored] == layer0
    assert filters.filter_entries(ck.entries(), "stored", "", "regex") == ck.entries()
