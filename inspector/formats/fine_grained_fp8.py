"""transformers' fine-grained FP8 folders (``quant_method: fp8``: DeepSeek-V3, Qwen3-FP8 and
what ``fp8_scheme="fine-grained"`` exports): per module ``P``, float8_e4m3fn ``P.weight`` +
float32 ``P.weight_scale_inv``, one scale per ``weight_block_size`` block (edge blocks
partial; one scale for the whole tensor without a block size), grouped into one logical
weight ``P.weight`` whose value is ``weight * scale`` per block, in float32 (values:
:mod:`inspector.tensors.packed`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inspector.entry import Entry
from inspector.formats.base import FINE_GRAINED_FP8, LogicalWeight, Scheme

QUANT_METHOD = "fp8"
SCALE = "weight_scale_inv"


def scheme_of(config: Mapping[str, Any]) -> Scheme:
    """The weights' scheme a ``quantization_config`` names (``weight_block_size``)."""
    block = config.get("weight_block_size")
    if block:
        return Scheme(FINE_GRAINED_FP8, 8, "float", "block", None, tuple(int(n) for n in block))
    return Scheme(FINE_GRAINED_FP8, 8, "float", "tensor")


def group(entries: Mapping[str, Entry], config: Mapping[str, Any]) -> dict[str, LogicalWeight]:
    """Every ``P.weight`` stored beside its ``P.weight_scale_inv``, by logical key."""
    scheme = scheme_of(config)
    found = {}
    for key in entries:
        prefix, _, role = key.rpartition(".")
        weight = entries.get(f"{prefix}.weight")
        if role != SCALE or weight is None or weight.kind != "tensor":
            continue
        parts = {"weight": weight.key, SCALE: key}
        found[weight.key] = LogicalWeight(weight.key, scheme, parts, "float32", weight.shape)
    return found
