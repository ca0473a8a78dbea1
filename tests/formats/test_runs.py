"""Training-run folders open as their latest saved step and list the others (``ck.steps``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import inspector
from inspector.errors import CheckpointFileMissingError, CorruptCheckpointError
from inspector.formats.base import Step
from tests.fixtures.formats import same

MEGATRON_RUN = Path(__file__).resolve().parents[1] / "fixtures" / "megatron" / "run"
EXPECTED = MEGATRON_RUN.parent / "expected"


def megatron_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(MEGATRON_RUN, run)
    return run


def test_megatron_tracker_names_the_latest() -> None:
    ck = inspector.open(MEGATRON_RUN)
    assert ck.location == str(MEGATRON_RUN / "iter_0000003")
    assert ck.steps == (
        Step("iter_0000001", 1, str(MEGATRON_RUN / "iter_0000001"), opened=False),
        Step("iter_0000003", 3, str(MEGATRON_RUN / "iter_0000003"), opened=True),
    )
    assert ck.source.notes[0] == (
        "latest_checkpointed_iteration.txt names iter_0000003/ as the latest step"
    )
    assert ck.metadata["iteration"] == "3"
    want = load_file(EXPECTED / "run_iter_0000003.safetensors")
    assert same(ck.read("output_layer.weight"), want["output_layer.weight"])
    first = inspector.open(ck.steps[0].location)
    older = load_file(EXPECTED / "run_iter_0000001.safetensors")
    assert same(first.read("output_layer.weight"), older["output_layer.weight"])


def test_tracker_pointing_nowhere(tmp_path: Path) -> None:
    run = megatron_run(tmp_path)
    (run / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(
        CheckpointFileMissingError,
        match=r"latest_checkpointed_iteration\.txt: names iteration '7', but there is no "
        r"iter_0000007/ folder \(steps found: iter_0000001, iter_0000003\)",
    ):
        inspector.open(run)
    (run / "latest_checkpointed_iteration.txt").write_text("three")
    with pytest.raises(CorruptCheckpointError, match=r"iteration\.txt: holds 'three'"):
        inspector.open(run)
    assert inspector.open(run / "iter_0000001").metadata["iteration"] == "1"  # still browsable


def test_tracker_release(tmp_path: Path) -> None:
    run = megatron_run(tmp_path)
    os.rename(run / "iter_0000001", run / "release")
    (run / "latest_checkpointed_iteration.txt").write_text("release\n")
    ck = inspector.open(run)
    assert ck.location == str(run / "release")
    assert [(s.name, s.number, s.opened) for s in ck.steps] == [
        ("iter_0000003", 3, False),
        ("release", None, True),
    ]


def test_torchtitan_steps_by_number_and_unfinished_passed_over(
    demo_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "checkpoint"
    shutil.copytree(demo_dir / "seed", run / "step-9")
    shutil.copytree(demo_dir / "flat", run / "step-10")
    ck = inspector.open(run)
    assert ck.location == str(run / "step-10")  # 10 > 9, though "step-10" < "step-9"
    assert [(s.name, s.number, s.opened) for s in ck.steps] == [
        ("step-9", 9, False),
        ("step-10", 10, True),
    ]
    shutil.copytree(demo_dir / "flat", run / "step-11")
    os.rename(run / "step-11" / ".metadata", run / "step-11" / ".metadata.tmp")
    ck = inspector.open(run)
    assert ck.location == str(run / "step-10")
    assert ck.source.notes[0] == "opened the latest step, step-10/, of 3 saved steps"
    assert ck.source.notes[1].startswith(
        "passed over step-11/: the save did not finish: .metadata.tmp was written but never"
    )


def test_hf_trainer_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "trainer"
    for step in (500, 1000):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        save_file(
            {"w": torch.full((2,), float(step))}, out / f"checkpoint-{step}" / "model.safetensors"
        )
    ck = inspector.open(out)
    assert ck.location == str(out / "checkpoint-1000" / "model.safetensors")
    assert ck.read("w").tolist() == [1000.0, 1000.0]
    save_file({"w": torch.zeros(2)}, out / "model.safetensors")  # the final model beside them
    ck = inspector.open(out)
    assert ck.read("w").tolist() == [0.0, 0.0]
    assert [(s.name, s.opened) for s in ck.steps] == [
        ("checkpoint-500", False),
        ("checkpoint-1000", False),
    ]
    assert ck.source.notes[0] == "the folder also holds 2 saved steps: see ck.steps"


def test_a_checkpoint_folder_has_no_steps(demo_dir: Path) -> None:
    assert inspector.open(demo_dir / "flat").steps == ()


def test_a_latest_tag_file_names_the_step_folder(tmp_path: Path) -> None:
    """DeepSpeed's rule (its profile's ``tracker``): ``latest`` holds the folder's own name,
    which wins over a higher-numbered step."""
    for step in (3, 9):
        (tmp_path / f"global_step{step}").mkdir()
        save_file(
            {"w": torch.full((2,), float(step))}, tmp_path / f"global_step{step}" / "w.safetensors"
        )
    (tmp_path / "latest").write_text("global_step3")
    ck = inspector.open(tmp_path)
    assert ck.source.notes[0] == "latest names global_step3/ as the latest step"
    assert [s.name for s in ck.steps] == ["global_step3", "global_step9"]
    assert same(ck.read("w"), torch.full((2,), 3.0))
    (tmp_path / "latest").write_text("global_step5")
    with pytest.raises(CheckpointFileMissingError, match=r"latest: names .*no global_step5/"):
        inspector.open(tmp_path)
