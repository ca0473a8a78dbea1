"""Tensor subclasses and FP8 without torchao: detection (:mod:`.detection`), how payloads
store values (:mod:`.payloads`), scale pairing (:mod:`.scales`), conversion to plain
tensors (:mod:`.convert`, :mod:`.dequant`). ``inspector.fp8`` is this package."""

from __future__ import annotations

from typing import Any

from inspector.tensors.detection import Detection, describe, detect
from inspector.tensors.scales import ScalePair, granularity, scale_blocks, scaled_pairs

__all__ = [
    "Detection",
    "ScalePair",
    "dequantize",
    "describe",
    "detect",
    "granularity",
    "scale_blocks",
    "scaled_pairs",
    "to_plain",
]


def __getattr__(name: str) -> Any:
    """``dequantize`` and ``to_plain`` need torch: loaded on first use."""
    if name in ("dequantize", "to_plain"):
        from inspector.tensors import convert

        return getattr(convert, name)
    raise AttributeError(f"module 'inspector.tensors' has no attribute {name!r}")
