"""FP8 weights for serving: what ``fp8="quantize"`` writes (vLLM and transformers load it).

Each 2-D ``*.weight`` outside ``IGNORED`` (norms, embeddings, the output head) becomes
float8_e4m3fn ``weight`` + a scale under one of ``SCHEMES`` (the ``fp8_scheme`` option):
- ``"channel"``, ``"block"``: compressed-tensors ``float-quantized``, ``weight_scale`` in the
  weight's dtype per output row (its FP8_DYNAMIC preset) or per 128x128 block (FP8_BLOCK).
  Values follow compressed-tensors' ``calculate_qparams`` + ``quantize`` operation by
  operation, so they are bit-identical to its own compressor's; ``quantization_config`` is
  what its ``ModelCompressor`` writes into config.json.
- ``"fine-grained"``: transformers' ``quant_method: fp8`` (FineGrainedFP8, the DeepSeek-V3 /
  Qwen3-FP8 layout): float32 ``weight_scale_inv`` per 128x128 block, the block's max |w| /
  448. Values follow transformers' ``Fp8Quantize`` (bit-identical); edge blocks are partial
  (the weight is quantized as if zero-padded to whole blocks), an all-zero block has scale 1.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from inspector.formats.writing import Item

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import torch

SCHEME_HELP = {
    "channel": "compressed-tensors, one scale per output row",
    "block": "compressed-tensors, one scale per 128x128 block",
    "fine-grained": "transformers' fp8 (DeepSeek-V3 layout): weight_scale_inv per 128x128 block",
}
SCHEMES = tuple(SCHEME_HELP)
DEFAULT_SCHEME = "channel"
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
    """(float8_e4m3fn weight, its scale) for ``scheme``: the scale in the weight's dtype
    (compressed-tensors), float32 ``weight_scale_inv`` (``"fine-grained"``)."""
    import torch

    if scheme == "fine-grained":
        return _fine_grained(weight)
    if scheme == "channel":
        low, high = weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
    else:
        blocks = _blocked(weight)
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


def _blocked(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` zero-padded to whole blocks, as (row blocks, BLOCK, column blocks, BLOCK)."""
    import torch

    rows, cols = weight.shape
    padded = torch.nn.functional.pad(weight, (0, -cols % BLOCK, 0, -rows % BLOCK))
    return padded.reshape(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)


def _fine_grained(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``Fp8Quantize``: in float32, ``scale = 448 / max|block|`` (1 for a zero
    block), FP8 = clamp(w * scale), stored ``weight_scale_inv = 1 / scale``."""
    import torch

    blocks = _blocked(weight.to(torch.float32))
    largest = blocks.abs().amax(dim=(1, 3))
    nonzero = largest > 0
    scales = FP8_MAX / torch.where(nonzero, largest, torch.ones_like(largest))
    scales = torch.where(nonzero, scales, torch.ones_like(scales))
    inverse = (1.0 / scales).to(torch.float32)
    scaled = blocks * scales[:, None, :, None]
    fp8 = torch.clamp(scaled, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    rows, cols = weight.shape
    return fp8.reshape(scaled.shape[0] * BLOCK, -1)[:rows, :cols].contiguous(), inverse


def scale_suffix(scheme: str) -> str:
    """What the scale of ``<key>`` is written as: ``<key><suffix>``."""
    return "_scale_inv" if scheme == "fine-grained" else "_scale"


def scale_form(shape: tuple[int, ...], dtype: str, scheme: str) -> tuple[tuple[int, int], str]:
    """The (shape, dtype name) of the scale of a ``dtype`` weight of ``shape``."""
    if scheme == "channel":
        return (shape[0], 1), dtype
    return blocks_of(shape), "float32" if scheme == "fine-grained" else dtype


def describe(scheme: str) -> str:
    """How an export names the scale ``scheme`` writes, e.g. ``per-channel scale``."""
    what = {"channel": "per-channel scale", "block": "128x128 block scale"}
    return what.get(scheme, "128x128 block weight_scale_inv")


class Quantization:
    """Quantizes one weight (``read()`` in ``dtype``) under ``scheme`` once, and hands out
    its FP8 values, then its scale; asked again, it quantizes again."""

    def __init__(self, read: Callable[[], torch.Tensor], dtype: str, scheme: str) -> None:
        self.read, self.dtype, self.scheme = read, dtype, scheme
        self._scale: torch.Tensor | None = None

    def weight(self) -> torch.Tensor:
        from inspector import dtypes

        value = self.read().to(dtypes.to_torch(self.dtype))
        fp8, self._scale = fp8_weight(value, self.scheme)
        return fp8

    def scale(self) -> torch.Tensor:
        if self._scale is None:
            self.weight()
        scale, self._scale = self._scale, None
        assert scale is not None
        return scale


def split_items(
    items: list[Item], scheme: str = DEFAULT_SCHEME
) -> tuple[list[list[Item]], dict[str, Any]]:
    """Each item as FP8 weight + scale items where :func:`quantizable` (else as it is), and
    the ``quantization_config`` for them (:func:`config_of`)."""
    split: list[list[Item]] = []
    for item in items:
        if not quantizable(item.name, item.shape, item.dtype):
            split.append([item])
            continue
        made = Quantization(item.produce, item.dtype, scheme)
        shape, dtype = scale_form(item.shape, item.dtype, scheme)
        scale = Item(item.name + scale_suffix(scheme), dtype, shape, made.scale)
        split.append([Item(item.name, "float8_e4m3fn", item.shape, made.weight), scale])
    return split, config_of([i.name for s in split for i in s], scheme)


def config_of(names: Iterable[str], scheme: str = DEFAULT_SCHEME) -> dict[str, Any]:
    """The ``quantization_config`` of written tensors ``names``: every ``*.weight`` without a
    scale beside it, and ``lm_head`` (a tied head has no weight of its own), is in the
    ignore list."""
    names = set(names)
    suffix = scale_suffix(scheme)
    ignore = {"lm_head"} | {
        n.removesuffix(".weight")
        for n in names
        if n.endswith(".weight") and n + suffix not in names
    }
    return quantization_config(scheme, sorted(ignore))


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
    if scheme == "fine-grained":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": sorted(ignore),
        }
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
