"""The notebooks run top to bottom (nbclient) against the demo checkpoints and show the story.

Each runs in a temporary copy of notebooks/ (its exports land there) with
INSPECTOR_DEMO_DIR pointing at the session's demo checkpoints.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ("inspect", "fqn_mismatch", "fp8_export", "to_huggingface", "run_health")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def run(
    name: str, demo_dir: Path, tmp_path: Path, monkeypatch
) -> tuple[nbformat.NotebookNode, Path]:
    folder = tmp_path / "notebooks"
    shutil.copytree(NOTEBOOKS, folder)
    monkeypatch.setenv("INSPECTOR_DEMO_DIR", str(demo_dir))
    nb = nbformat.read(folder / f"{name}.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, resources={"metadata": {"path": str(folder)}}).execute()
    return nb, folder


def printed(nb: nbformat.NotebookNode) -> str:
    """Everything the cells printed or returned as text."""
    parts = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                parts.append(output.text)
            elif "data" in output:
                parts.append(output.data.get("text/plain", ""))
    return "\n".join(parts)


@pytest.mark.parametrize("name", NAMES)
def test_committed_without_outputs(name: str) -> None:
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert "widgets" not in nb.metadata


@pytest.mark.slow
def test_inspect_shows_the_app(demo_dir: Path, tmp_path: Path, monkeypatch) -> None:
    nb, _ = run("inspect", demo_dir, tmp_path, monkeypatch)
    views = [
        o.data[WIDGET_VIEW]["model_id"]
        for c in nb.cells
        for o in c.get("outputs", [])
        if WIDGET_VIEW in o.get("data", {})
    ]
    assert len(views) == 1 and views[0]
    state = nb.metadata["widgets"][WIDGET_STATE]["state"]
    assert state[views[0]]["model_name"] == "VBoxModel"
    html = json.dumps([m["state"].get("value") for m in state.values()])
    assert str(demo_dir / "fp8") in html and "347 keys" in html and "2 ranks" in html
    assert "WeightWithDynamicFloat8CastTensor" in html
    assert f"<Checkpoint dcp flat '{demo_dir / 'fp8'}': 347 keys" in printed(nb)


# What each story notebook must print, and the file its export writes.
STORIES = {
    "fqn_mismatch": (
        [
            "layout: prefixed",
            "dcp.load failed: RuntimeError: Missing key in checkpoint state_dict: layers.",
            "1 missing from the checkpoint",
            "After it: every key the error names matches.",
            "best rewrite: strip 'model.' (resolves 42 of 42)",
            "verified 21 tensors bit-exact",
            "<All keys matched successfully>",
            "weights equal to the checkpoint's: True",
            "check after the fix: <KeyReport ok",
        ],
        "exports/prefixed-fixed/model.safetensors",
    ),
    "fp8_export": (
        [
            "14 of 347 entries hold a tensor subclass",
            "Detection(kind='wrapper', subclass='WeightWithDynamicFloat8CastTensor'",
            "dtypes in the file: ['torch.bfloat16']",
            "<All keys matched successfully>",
            "weights equal to the checkpoint's, rounded to bfloat16: True",
            "forward pass: (1, 8, 256)",
        ],
        "exports/fp8-bf16/model.safetensors",
    ),
    "to_huggingface": (
        [
            "refused: the llama3 export needs num_attention_heads (attention heads per layer): "
            "pass it in hf_config",
            "anything written: False",
            "arch llama3: all 21 model weights match its rules in torchtitan 0.3 names",
            "verified 21 tensors bit-exact",
            "files: ['config.json', 'generation_config.json', 'model.safetensors', "
            "'special_tokens_map.json', 'tokenizer.json', 'tokenizer_config.json']",
            "generated: the quick brown fox",
            "embeddings equal to the checkpoint's: True",
            "written in torchtitan July-2025 names",
            "loaded into TinyLlama (July-2025 names), equal to the 0.3 checkpoint: True",
            "Best rewrite: respell torchtitan 0.3 names as torchtitan July-2025 names "
            "(attention.qkv_linear.wq -> attention.wq",
            "lm_head.weight -> output.weight",
            "After it: every key, shape and dtype matches.",
        ],
        "exports/llama-hf/model.safetensors",
    ),
    "run_health": (
        [
            "saved steps: ['step-10', 'step-20', 'step-30', 'step-40']",
            "runs/healthy/step-40: 4 steps, 30 parameters: nothing looks wrong",
            "runs/faulty/step-40: 4 steps, 30 parameters: 28 findings",
            "step-30: layers.1.attention.wq.weight changed by",
            "step-30: layers.0.attention.wq.weight did not change up to step-30",
            "layer 0                  update ratio 0.0000",
            "exit code: 0",
        ],
        "runs/faulty/step-40/.metadata",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", STORIES)
def test_story_runs_to_a_successful_load(
    name: str, demo_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    nb, folder = run(name, demo_dir, tmp_path, monkeypatch)
    out = printed(nb)
    expected, written = STORIES[name]
    assert [line for line in expected if line not in out] == [], out
    assert (folder / written).is_file()
