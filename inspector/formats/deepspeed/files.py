"""The files of a DeepSpeed step folder (``global_stepN/``), by DeepSpeed's naming rules, and
the decoded object of one (through safe_pickle: DeepSpeed's own classes, e.g. its loss
scaler, become inert stand-ins)."""

from __future__ import annotations

import re
from typing import Any

from inspector.formats.torch_archive import TorchArchive
from inspector.storage.base import Storage

# Stage 0-2: ``mp_rank_00_model_states.pt``; stage 3: one per rank,
# ``zero_pp_rank_R_mp_rank_00_model_states.pt``.
MODEL_STATES = re.compile(r"(?:zero_pp_rank_([0-9]+)_)?mp_rank_([0-9]+)_model_states\.pt")
# ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` (``bf16_`` first under the bf16 optimizer).
OPTIM_STATES = re.compile(r"(?:bf16_)?zero_pp_rank_([0-9]+)_mp_rank_([0-9]+)_optim_states\.pt")


def natural_key(name: str) -> list[int | str]:
    """zero_to_fp32's ``natural_keys``: digits compare as numbers (rank 2 before rank 10)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"([0-9]+)", name)]


def step_files(storage: Storage) -> tuple[list[str], list[str]]:
    """The folder's model-states and optimizer-states files, each in zero_to_fp32's order."""
    names = [name for name, kind in storage.list() if kind == "file"]
    models = sorted((n for n in names if MODEL_STATES.fullmatch(n)), key=natural_key)
    optims = sorted((n for n in names if OPTIM_STATES.fullmatch(n)), key=natural_key)
    return models, optims


def looks_like_deepspeed(storage: Storage) -> bool:
    """Whether the folder is a DeepSpeed step: it holds a ``*mp_rank_NN_model_states.pt``."""
    return any(kind == "file" and MODEL_STATES.fullmatch(n) for n, kind in storage.list())


def rank_of(name: str) -> int:
    """The data-parallel rank in an optimizer-states file's name."""
    match = OPTIM_STATES.fullmatch(name)
    assert match is not None
    return int(match.group(1))


def decode(storage: Storage, name: str) -> Any:
    """The whole object a torch.save file holds, tensors as descriptions (no bytes read)."""
    size = storage.size(name)
    with storage.window(name, 0, size) as f:
        return TorchArchive(f, storage.describe(name), size, None).load()
