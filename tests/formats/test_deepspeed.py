"""DeepSpeed ZeRO 1, 2 and 3 checkpoints (committed fixtures written by a real 3-rank DeepSpeed
run on CPU, see tests/fixtures/deepspeed/generate.py) read without DeepSpeed, against
DeepSpeed's own ``zero_to_fp32`` reconstruction saved beside them."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import inspector
from inspector.errors import CheckpointFileMissingError, CorruptCheckpointError, ExportError
from inspector.formats.safe_pickle import Opaque
from inspector.formats.safe_pickle.deepspeed import ZERO_STAGE_ENUM

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"
STAGES = ("zero1", "zero2", "zero3")
STEP = "global_step2"
RANKS = 3


def oracle(stage: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / f"{stage}.fp32.safetensors")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def model_keys(ck: inspector.Checkpoint) -> list[str]:
    return [e.key for e in ck.entries() if e.component == "model"]


def copy_step(stage: str, tmp_path: Path) -> Path:
    run = tmp_path / stage
    shutil.copytree(FIXTURES / stage, run)
    return run


@pytest.mark.parametrize("stage", STAGES)
def test_fp32_weights_equal_zero_to_fp32_bit_for_bit(stage: str) -> None:
    ck = inspector.open(FIXTURES / stage)
    want = oracle(stage)
    assert (ck.format, ck.producer) == ("deepspeed", "deepspeed")
    assert sorted(model_keys(ck)) == sorted(want)
    for key, value in want.items():
        got = ck.read(key)
        assert (got.dtype, got.shape) == (value.dtype, value.shape), key
        assert torch.equal(bits(got), bits(value)), key
        assert (ck.entry(key).dtype, ck.entry(key).shape) == (
            str(value.dtype).removeprefix("torch."),
            tuple(value.shape),
        )


def test_run_folder_opens_the_step_its_latest_file_names() -> None:
    ck = inspector.open(FIXTURES / "zero3")
    assert [(s.name, s.opened) for s in ck.steps] == [(STEP, True)]
    assert any("latest names global_step2/" in n for n in ck.source.notes)
    direct = inspector.open(FIXTURES / "zero3" / STEP)
    assert direct.keys() == ck.keys() and direct.steps == ()


@pytest.mark.parametrize("stage", STAGES)
def test_components_model_states_and_optimizer_partitions(stage: str) -> None:
    ck = inspector.open(FIXTURES / stage)
    counts = ck.components()
    assert counts["model"] == len(oracle(stage))
    assert counts["optimizer"] > 0 and counts["train_state"] == 3
    trained = [ck.read_object(k) for k in ("global_steps", "global_samples", "skipped_steps")]
    assert trained == [2, 12, 0]  # 2 steps of 3 ranks x 2 samples
    groups = "fp32_flat_groups" if stage == "zero3" else "single_partition_of_fp32_groups"
    key = f"optimizer.rank{{}}.optimizer_state_dict.{groups}.0"
    partitions = [ck.read(key.format(r)) for r in range(RANKS)]
    held = sum(p.numel() for p in partitions)
    assert all(p.dtype == torch.float32 for p in partitions)
    trained = [k for k in model_keys(ck) if k not in ("lm_head.weight", "model.norm.weight")]
    assert sum(ck.entry(k).numel for k in trained) <= held  # tied and frozen: not in them
    stage_value = ck.read_object("optimizer.rank0.optimizer_state_dict.zero_stage")
    assert stage_value.value == int(stage[-1])
    module = ck.read("module.model.layers.0.mlp.up_proj.weight")
    master = ck.read("model.layers.0.mlp.up_proj.weight")
    if stage == "zero3":  # ZeRO-3 saves empty placeholders for the module's parameters
        assert module.numel() == 0
    elif stage == "zero1":  # bf16: the module holds the masters rounded to bfloat16
        assert torch.equal(bits(module), bits(master.to(torch.bfloat16)))
    else:
        assert torch.equal(bits(module), bits(master))


def test_one_file_opens_as_torch_save_with_deepspeeds_classes_inert() -> None:
    """DeepSpeed's classes in its pickles: ZeroStageEnum a read-only enum record, the loss
    scaler a placeholder (nothing of DeepSpeed is imported or built)."""
    name = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    ck = inspector.open(FIXTURES / "zero1" / STEP / name)
    assert ck.format == "torch-save"
    stage = ck.read_object("optimizer_state_dict.zero_stage")
    assert (stage.cls, stage.name, stage.value) == (ZERO_STAGE_ENUM, "optimizer_states", 1)
    scaler = ck.read_object("optimizer_state_dict.loss_scaler")
    assert isinstance(scaler, Opaque)
    assert scaler.global_name == "deepspeed.runtime.fp16.loss_scaler.LossScaler"
    assert "deepspeed" not in sys.modules


def test_zero2_partitions_concatenated_hold_the_weights_in_order() -> None:
    """The arithmetic itself: rank 0's partition followed by rank 1's starts with the first
    parameter group's weights in param_shapes order."""
    ck = inspector.open(FIXTURES / "zero2")
    key = "optimizer.rank{}.optimizer_state_dict.single_partition_of_fp32_groups.0"
    flat = torch.cat([ck.read(key.format(r)) for r in range(RANKS)])
    shapes = ck.read_object("param_shapes.0.model.embed_tokens.weight")
    first = ck.read("model.embed_tokens.weight")
    assert tuple(shapes) == tuple(first.shape)
    assert torch.equal(flat[: first.numel()], first.reshape(-1))


def test_reading_one_weight_reads_only_its_slices() -> None:
    ck = inspector.open(FIXTURES / "zero3")
    entry = ck.entry("model.layers.0.mlp.up_proj.weight")
    assert entry.shape == (13, 10)  # ZeRO-3 pads its 130 elements to 132 over 3 ranks
    before = ck.io.bytes
    ck.read(entry.key)
    assert ck.io.bytes - before == entry.nbytes == 130 * 4


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_export_writes_the_fp32_weights(fmt: str, tmp_path: Path) -> None:
    out = tmp_path / f"model.{fmt}"
    inspector.export(FIXTURES / "zero3", out, format=fmt, progress=False)
    written = load_file(out) if fmt == "safetensors" else torch.load(out, weights_only=True)
    want = oracle("zero3")
    assert sorted(written) == sorted(want)
    assert all(torch.equal(bits(written[k]), bits(v)) for k, v in want.items())


IDS = torch.tensor([[1, 5, 9, 36, 2]])


def oracle_logits(stage: str) -> torch.Tensor:
    """The logits of a transformers Llama holding DeepSpeed's own reconstruction."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((FIXTURES / "config.json").read_text())
    reference = LlamaForCausalLM(LlamaConfig(**config)).eval()
    reference.load_state_dict(oracle(stage))
    with torch.no_grad():
        return reference(IDS).logits


def pretrained_logits(folder: Path) -> torch.Tensor:
    """The logits of ``from_pretrained(folder)``, which must find every key and no other."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model.eval()(IDS).logits


def test_export_loads_in_transformers_with_the_oracles_logits(tmp_path: Path) -> None:
    """The ZeRO-2 run's weights (HF names already: DeepSpeed trained a transformers Llama)
    exported as model.safetensors beside its config.json load with from_pretrained, and give
    the logits of a Llama holding DeepSpeed's own reconstruction (frozen norm and tied output
    layer included)."""
    folder = tmp_path / "hf"
    inspector.export(FIXTURES / "zero2", folder / "model.safetensors", progress=False)
    shutil.copy(FIXTURES / "config.json", folder)
    assert torch.equal(pretrained_logits(folder), oracle_logits("zero2"))


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_format_hf_keeps_the_names_and_leaves_the_tied_head_out(stage: str, tmp_path: Path) -> None:
    """``format="hf"`` on HF-named weights: names kept, the tied lm_head left out as
    transformers saves it, optimizer partitions and step counters left out with reasons."""
    out = tmp_path / "hf"
    result = inspector.export(
        FIXTURES / stage, out, format="hf", hf_config=FIXTURES / "config.json", progress=False
    )
    assert "names kept" in result.reason and result.arch == "llama3"
    written, want = load_file(out / "model.safetensors"), oracle(stage)
    assert sorted(written) == sorted(k for k in want if k != "lm_head.weight")
    assert all(torch.equal(bits(v), bits(want[k])) for k, v in written.items())
    assert "tied" in result.skipped["lm_head.weight"]
    assert "not a model weight" in result.skipped["global_steps"]
    assert any(k.startswith("optimizer.") for k in result.skipped)
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["tie_word_embeddings"]) == ("llama", True)
    assert torch.equal(pretrained_logits(out), oracle_logits(stage))


def test_format_hf_of_zero1_names_the_frozen_weight_it_lacks(tmp_path: Path) -> None:
    """ZeRO-1 saves no frozen parameters (zero_to_fp32 has no model.norm.weight either): the
    HF export is refused, saying which weight is missing, and nothing is written."""
    with pytest.raises(ExportError, match=r"no model\.norm\.weight"):
        inspector.export(
            FIXTURES / "zero1", tmp_path / "hf", format="hf", hf_config=FIXTURES / "config.json"
        )
    assert "model.norm.weight" not in oracle("zero1") and not (tmp_path / "hf").exists()


# --- bad input: an InspectorError naming the file and the key; the rest browsable ----------


def test_latest_naming_a_missing_step_is_an_error_naming_the_file(tmp_path: Path) -> None:
    run = copy_step("zero2", tmp_path)
    (run / "latest").write_text("global_step9")
    with pytest.raises(CheckpointFileMissingError) as info:
        inspector.open(run)
    assert "latest" in info.value.file and "global_step9" in str(info.value)
    assert inspector.open(run / STEP).read("model.norm.weight").numel() == 10


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_rank_partition_missing_or_truncated(damage: str, tmp_path: Path) -> None:
    run = copy_step("zero3", tmp_path)
    victim = run / STEP / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if damage == "missing":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    ck = inspector.open(run)
    with pytest.raises(CorruptCheckpointError) as info:
        ck.read("model.layers.0.mlp.up_proj.weight")
    assert info.value.key == "model.layers.0.mlp.up_proj.weight"
    if damage == "missing":
        assert "*_optim_states.pt files are here; missing rank [1]" in str(info.value)
    else:
        assert f"rank 1's partition file {victim.name} cannot be read" in str(info.value)
    assert ck.read_object("global_steps") == 2  # the rest stays browsable
    assert ck.read("optimizer.rank0.optimizer_state_dict.fp32_flat_groups.0").numel() > 0


def test_param_shapes_that_do_not_add_up(tmp_path: Path) -> None:
    """A model-states file whose param_shapes claims a larger weight than the partitions hold
    (written by torch.save, as DeepSpeed writes it)."""
    run = copy_step("zero2", tmp_path)
    states = run / STEP / "mp_rank_00_model_states.pt"
    saved = torch.load(states, weights_only=True)
    saved["param_shapes"][0]["model.embed_tokens.weight"] = torch.Size([40, 10])
    torch.save(saved, states)
    ck = inspector.open(run)
    with pytest.raises(CorruptCheckpointError) as info:
        ck.read("model.embed_tokens.weight")
    assert "param_shapes" in str(info.value) and "mp_rank_00_model_states.pt" in str(info.value)
    assert "does not add up" in str(info.value)
    assert ck.read("module.model.embed_tokens.weight").shape == (37, 10)
