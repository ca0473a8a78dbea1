"""The FQN doctor on torchtitan's two naming generations: real torchtitan-named checkpoints
of one model, checked against each other, get one rewrite that resolves every key."""

from __future__ import annotations

import pytest
import torch

import inspector
from inspector.analysis.fqn import KeyReport
from inspector.keys.generations import GENERATIONS, RENAMES, respell
from tests.fixtures import torchtitan_models as tm

PAIRS = [("torchtitan-2025", "torchtitan"), ("torchtitan", "torchtitan-2025")]


@pytest.mark.parametrize("layout", tm.LAYOUTS)
@pytest.mark.parametrize(("source", "target"), PAIRS)
@pytest.mark.parametrize("name", ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_one_rewrite_resolves_a_generation_mismatch(
    torchtitan_models, name, source, target, layout
) -> None:
    checkpoint = torchtitan_models.dcp(name, source, layout)
    other = inspector.open(torchtitan_models.dcp(name, target, "flat"))
    report = inspector.check_keys(checkpoint, other)
    best = report.best
    assert best is not None and best.remaining == 0 and best.shape_mismatches == 0
    assert best.resolves == len(report.missing) + len(report.unexpected) > 0
    assert [s.resolves for s in report.suggestions].count(best.resolves) == 1
    assert report.after().ok
    text = report.explain()
    assert f"respell {GENERATIONS[source]} as {GENERATIONS[target]}" in text
    assert "lm_head" in text and "#2937" in text
    if name != "deepseek_v3":  # DeepSeek's MLA attention.wq is the same in both
        assert "qkv_linear" in text and "#2878" in text
    assert ("strip 'model.' then respell" in text) == (layout == "prefixed")
    ck = inspector.open(checkpoint)
    for key, renamed in report.mapping().items():
        assert torch.equal(ck.read(key), other.read(renamed)), key


def test_generation_and_wrapper_together(torchtitan_models) -> None:
    """A July-2025 checkpoint against a torch.compile'd torchtitan 0.3 model's keys."""
    path = torchtitan_models.dcp("llama3", "torchtitan-2025", "flat")
    newer = inspector.open(torchtitan_models.dcp("llama3", "torchtitan", "flat"))
    model_keys = ["_orig_mod." + e.key for e in newer.entries() if e.component == "model"]
    report = inspector.check_keys(path, model_keys)
    best = report.best
    assert best is not None and best.remaining == 0
    assert best.description.startswith(
        "add '_orig_mod.' then respell torchtitan July-2025 names as torchtitan 0.3 names"
    )
    assert report.mapping()["output.weight"] == "_orig_mod.lm_head.weight"
    assert report.mapping()["layers.1.attention.wk.weight"] == (
        "_orig_mod.layers.1.attention.qkv_linear.wk.weight"
    )


def test_names_both_generations_share_are_left_alone() -> None:
    keys = ["layers.0.attention.wq.weight", "layers.0.attention.wkv_a.weight", "output.weight"]
    model = ["layers.0.attention.wq.weight", "layers.0.attention.wkv_a.weight", "lm_head.weight"]
    found = KeyReport(
        "a", "b", "stored", dict.fromkeys(keys, (None, None)), dict.fromkeys(model, (None, None))
    )
    assert found.mapping() == dict(zip(keys, model, strict=True))
    assert found.best is not None and found.best.description == (
        "respell torchtitan July-2025 names as torchtitan 0.3 names "
        "(output.weight -> lm_head.weight)"
    )


def test_respelling_is_its_own_inverse_on_every_rename() -> None:
    for rename in RENAMES:
        key = f"layers.3.{rename.new}.weight"
        old = respell(key, "torchtitan", "torchtitan-2025")
        assert old == f"layers.3.{rename.old}.weight"
        assert respell(old, "torchtitan-2025", "torchtitan") == key
    assert respell("layers.0.moe.routed_experts.w1", "torchtitan-2025", "torchtitan") == (
        "layers.0.moe.routed_experts.w1"
    )
