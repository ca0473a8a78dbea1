"""DeepSpeed's classes its checkpoints pickle, where a reader needs their value: inert records
(nothing of DeepSpeed is imported or built). The rest (its loss scaler, ``fragment_address``)
stay placeholders."""

from __future__ import annotations

from typing import Any

from inspector.formats.safe_pickle.records import Allowed
from inspector.formats.safe_pickle.stdlib import EnumMember

ZERO_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"
_ZERO_STAGES = {0: "disabled", 1: "optimizer_states", 2: "gradients", 3: "weights"}


def _zero_stage(value: Any) -> EnumMember:
    """``ZeroStageEnum(n)``, the ZeRO stage of an optimizer-states file, as its number."""
    if type(value) is not int or value not in _ZERO_STAGES:
        raise ValueError(f"ZeroStageEnum({value!r}) is not a ZeRO stage")
    return EnumMember(ZERO_STAGE_ENUM, _ZERO_STAGES[value], value)


GLOBALS: dict[tuple[str, str], Any] = {
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): Allowed(_zero_stage, ZERO_STAGE_ENUM),
}
