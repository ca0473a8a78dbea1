"""FP8 weights for serving: what ``fp8="quantize"`` writes, in compressed-tensors
``float-quantized`` form (vLLM and transformers load it).

Each 2-D ``*.weight`` outside ``IGNORED`` (norms, embeddings, the output head) becomes
float8_e4m3fn ``weight`` + ``weight_scale`` under one of ``SCHEMES``: ``"channel"`` (one
scale per output row, compressed-tensors' FP8_DYNAMIC preset) or ``"block"`` (one per
128x128 block, FP8_BLOCK, the DeepSeek-V3 layout). Values follow compressed-tensors'
``calculate_qparams`` + ``quantize`` operation by operation, so they are bit-identical to
its own compressor's for the same weight; ``quantization_config`` is what its
``ModelCompressor`` writes into config.json for the scheme.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from inspector.formats.writing import Item

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import torch

SCHEMES = ("channel", "block")
BLOCK = 128
FP8_MAX = 448.0
IGNORED = re.compile(r"(^|\.)(lm_head|output|[^.]*embed[^.]*|[^.]*norm[^.]*)\.weight$")


def quantizable(key: str, shape: tuple[int, ...] | None, dtype: str | None) -> bool:
    """Whether the export quantizes this tensor: a 2-D floating ``*.weight`` not ignored."""
    return (
        key.endswith(".weight")
        and shape is not None
        and len(shape) == 2
        and dtype in ("float32", "bfloat16", "float16")
        and not IGNORED.search(key)
    )


def fp8_weight(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, scale in the weight's dtype) for ``scheme``."""
    import torch

    if scheme == "channel":
        low, high = weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
    else:
        rows, cols = weight.shape
        padded = torch.nn.functional.pad(weight, (0, -cols % BLOCK, 0, -rows % BLOCK))
        blocks = padded.reshape(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
        low, high = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    scale = _scale(low, high)
    full = scale
    if scheme == "block":
        full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        full = full[: weight.shape[0], : weight.shape[1]]
    scaled = weight / full
    scaled += torch.zeros((), dtype=weight.dtype)  # the symmetric zero point: -0.0 becomes 0.0
    bound = torch.tensor(FP8_MAX)
    return torch.clamp(scaled, -bound, bound).to(torch.float8_e4m3fn), scale


class Quantization:
    """Quantizes one weight (``read()`` in ``dtype``) once, and hands out its FP8 values,
    then its scale; asked again, it quantizes again."""

    def __init__(self, read: Callable[[], torch.Tensor], dtype: str) -> None:
        self.read, self.dtype = read, dtype
        self._scale: torch.Tensor | None = None

    def weight(self) -> torch.Tensor:
        from inspector import dtypes

        fp8, self._scale = fp8_weight(self.read().to(dtypes.to_torch(self.dtype)), "channel")
        return fp8

    def scale(self) -> torch.Tensor:
        if self._scale is None:
            self.weight()
        scale, self._scale = self._scale, None
        assert scale is not None
        return scale


def split_items(items: list[Item]) -> tuple[list[list[Item]], dict[str, Any]]:
    """Each item as FP8 weight + per-channel scale items where :func:`quantizable` (else as
    it is), and the ``quantization_config`` for them (:func:`config_of`)."""
    split: list[list[Item]] = []
    for item in items:
        if not quantizable(item.name, item.shape, item.dtype):
            split.append([item])
            continue
        made = Quantization(item.produce, item.dtype)
        scale = Item(f"{item.name}_scale", item.dtype, (item.shape[0], 1), made.scale)
        split.append([Item(item.name, "float8_e4m3fn", item.shape, made.weight), scale])
    return split, config_of([i.name for s in split for i in s])


def config_of(names: Iterable[str]) -> dict[str, Any]:
    """The ``quantization_config`` of written tensors ``names``: every ``*.weight`` without a
    ``*.weight_scale`` beside it, and ``lm_head`` (a tied head has no weight of its own),
    is in the ignore list."""
    names = set(names)
    ignore = {"lm_head"} | {
        n.removesuffix(".weight")
        for n in names
        if n.endswith(".weight") and f"{n}_scale" not in names
    }
    return quantization_config("channel", sorted(ignore))


def _scale(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    import torch

    low, high = torch.min(low, torch.zeros_like(low)), torch.max(high, torch.zeros_like(high))
    largest = torch.max(torch.abs(low), torch.abs(high))
    scale = largest / (torch.tensor(2 * FP8_MAX).to(largest.dtype) / 2)
    eps = torch.finfo(scale.dtype).eps  # replaces a zero scale, as compressed-tensors does
    return torch.where(scale == 0, torch.tensor(eps, dtype=scale.dtype), scale)


def quantization_config(scheme: str, ignore: list[str]) -> dict[str, Any]:
    """config.json's ``quantization_config`` for ``scheme`` (``ignore``: the modules left
    in high precision, by name)."""
    weights: dict[str, Any] = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": False,
        "strategy": "channel",
    }
    activations: dict[str, Any] = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": True,
        "strategy": "token",
    }
    if scheme == "block":
        weights |= {"strategy": "block", "block_structure": [BLOCK, BLOCK]}
        activations |= {"strategy": "group", "group_size": BLOCK}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": activations,
                "format": "float-quantized",
            }
        },
        "ignore": sorted(ignore),
    }


def blocks_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """The block scale's shape for a weight of ``shape``."""
    return math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)
