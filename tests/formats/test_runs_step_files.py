"""A folder of Lightning ``ModelCheckpoint`` files is a run: each file a step, numbered from
its name's ``step=N`` or else from its stored ``global_step``; ``last.ckpt`` repeats the
newest step (tests/fixtures/lightning_run/generate.py wrote both runs)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import inspector
from inspector.errors import NotACheckpointError
from inspector.formats.base import Step

RUN = Path(__file__).resolve().parents[1] / "fixtures" / "lightning_run"
DEFAULT_NAMES = RUN / "checkpoints"  # ModelCheckpoint's "{epoch}-{step}", save_last=True
STEP_6 = "epoch=1-step=6.ckpt"


def test_steps_numbered_from_their_names_and_last_is_an_alias() -> None:
    ck = inspector.open(DEFAULT_NAMES)
    names = ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", STEP_6]
    assert ck.steps == tuple(
        Step(name, number, str(DEFAULT_NAMES / name), opened=name == STEP_6)
        for name, number in zip(names, (2, 4, 6), strict=True)
    )
    assert ck.location == str(DEFAULT_NAMES / STEP_6)
    assert ck.source.notes[:2] == (
        f"opened the latest step, {STEP_6}, of 3 saved steps",
        f"last.ckpt repeats step 6 ({STEP_6}): not a step of its own",
    )
    for name, number in zip(names, (2, 4, 6), strict=True):
        assert torch.load(DEFAULT_NAMES / name, weights_only=True)["global_step"] == number
    want = torch.load(DEFAULT_NAMES / STEP_6, weights_only=True)["state_dict"]["net.6.weight"]
    assert torch.equal(ck.read("state_dict.net.6.weight"), want)


def test_steps_numbered_from_the_stored_global_step() -> None:
    """``step-{step}`` with auto_insert_metric_name=False: no ``step=`` in the names."""
    ck = inspector.open(RUN)
    assert [(s.name, s.number, s.opened) for s in ck.steps] == [
        ("step-2.ckpt", 2, False),
        ("step-4.ckpt", 4, True),
    ]
    assert ck.location == str(RUN / "step-4.ckpt")


def test_last_without_its_step_file_is_a_step(tmp_path: Path) -> None:
    """save_top_k dropped the newest numbered file: last.ckpt is the only copy of step 6."""
    run = tmp_path / "checkpoints"
    shutil.copytree(DEFAULT_NAMES, run)
    (run / STEP_6).unlink()
    ck = inspector.open(run)
    assert [(s.name, s.number, s.opened) for s in ck.steps] == [
        ("epoch=0-step=2.ckpt", 2, False),
        ("epoch=0-step=4.ckpt", 4, False),
        ("last.ckpt", 6, True),
    ]


def test_files_without_a_step_number_are_passed_over(tmp_path: Path) -> None:
    run = tmp_path / "checkpoints"
    shutil.copytree(DEFAULT_NAMES, run)
    torch.save({"pytorch-lightning_version": "2.6.6", "global_step": "six"}, run / "odd.ckpt")
    torch.save({"weight": torch.ones(2)}, run / "plain.ckpt")
    ck = inspector.open(run)
    assert [s.name for s in ck.steps] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", STEP_6]
    notes = ck.source.notes
    assert f"passed over odd.ckpt: {run / 'odd.ckpt'}: key 'global_step': holds no step " in (
        next(n for n in notes if "odd.ckpt" in n)
    )
    assert "passed over plain.ckpt: not written by lightning" in notes


def test_ckpt_files_of_another_program_are_no_run(tmp_path: Path) -> None:
    for n in (1, 2):
        torch.save({"weight": torch.full((2,), float(n))}, tmp_path / f"model-{n}.ckpt")
    with pytest.raises(NotACheckpointError, match=r"several torch\.save files and no index"):
        inspector.open(tmp_path)


def test_a_damaged_newest_step_is_passed_over(tmp_path: Path) -> None:
    run = tmp_path / "checkpoints"
    shutil.copytree(DEFAULT_NAMES, run)
    (run / "last.ckpt").unlink()
    with open(run / STEP_6, "r+b") as f:
        f.truncate(100)
    ck = inspector.open(run)
    assert ck.location == str(run / "epoch=0-step=4.ckpt")
    assert [(s.name, s.opened) for s in ck.steps][1:] == [
        ("epoch=0-step=4.ckpt", True),
        (STEP_6, False),
    ]
    assert ck.source.notes[1].startswith(f"passed over {STEP_6}: {run / STEP_6}: ")
