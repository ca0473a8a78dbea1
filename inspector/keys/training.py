"""What a training checkpoint holds beside the weights, so a run can resume from it.

torchtitan's CheckpointManager saves ``model``, ``optimizer``, ``lr_scheduler``,
``dataloader`` (one state per data-parallel rank, ``dataloader.dp_rank_<r>``) and
``train_state`` (``step``, ``ntokens_seen``), and loads all of them on resume. Adam-family
optimizers keep ``exp_avg``, ``exp_avg_sq`` and ``step`` per parameter (and
``max_exp_avg_sq`` with amsgrad); the moments have the parameter's shape.
"""

from __future__ import annotations

import re

from inspector.entry import Entry

RESUME_COMPONENTS = ("optimizer", "lr_scheduler", "dataloader", "train_state")
ADAM_STATES = frozenset({"exp_avg", "exp_avg_sq", "step"})
ADAM_MOMENTS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
SCALAR_STATES = frozenset({"step"})
TRAIN_STEP = "step"
_DP_RANK = re.compile(r"dp_rank_(\d+)")


def expected_states(seen: set[str]) -> frozenset[str]:
    """The states every trained parameter should have, judged from the names seen across
    all of them: Adam's three (plus ``max_exp_avg_sq`` when amsgrad shows it), else every
    name seen (one optimizer keeps the same states for each parameter)."""
    if {"exp_avg", "exp_avg_sq"} & seen:
        return ADAM_STATES | (seen & {"max_exp_avg_sq"})
    return frozenset(seen)


def dataloader_rank(entry: Entry) -> int | None:
    """The data-parallel rank a dataloader entry is the state of (``dp_rank_<r>``), if any."""
    if entry.component != "dataloader":
        return None
    for part in (*entry.nested_path, entry.key):
        found = _DP_RANK.search(str(part))
        if found:
            return int(found.group(1))
    return None


def is_train_step(entry: Entry) -> bool:
    """``train_state.step``: the training step the checkpoint was saved at."""
    if entry.component != "train_state":
        return False
    last = entry.nested_path[-1] if entry.nested_path else entry.key
    return str(last).rpartition(".")[2] == TRAIN_STEP
