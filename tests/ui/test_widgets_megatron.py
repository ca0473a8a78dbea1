"""The app's Export of a Megatron-Core checkpoint to a Hugging Face folder, driven in-process:
the form says what ``arch="auto"`` found, the export writes the HF model Megatron's
checkpoint was made from (tests/fixtures/megatron/generate_from_hf.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from inspector.ui.widgets import Inspector
from tests.ui.test_widgets import text

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron" / "from_hf"


def test_export_offers_a_megatron_moe_run_as_a_hugging_face_folder(tmp_path: Path) -> None:
    app = Inspector(FIXTURES / "qwen3_moe_fp32_ep2")
    app.header.wait()
    export = app.export
    export.format.value = "hf"
    note = text(export.arch_note)
    assert note.startswith("arch auto megatron_gpt: Megatron-Core GPT keys")
    assert "4 routed experts (top-2)" in note and "Qwen3MoeForCausalLM" in note
    export.out.value = str(tmp_path / "hf")
    export.export_button.click()
    export.wait()
    assert export.progress.bar_style == "success", text(export.outcome)
    original = load_file(FIXTURES / "hf_qwen3_moe_fp32" / "model.safetensors")
    ours = load_file(tmp_path / "hf" / "model.safetensors")
    assert ours.keys() == original.keys()
    assert all(torch.equal(ours[k], v) for k, v in original.items())
    assert f"verified {len(original)} tensors bit-exact" in text(export.outcome)
