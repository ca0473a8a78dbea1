"""Plain float8 tensors paired with their scale siblings, from names, dtypes and shapes alone.

DeepSeek-V3 / Hugging Face block FP8 stores ``weight`` (float8_e4m3fn) next to
``weight_scale_inv`` (one value per 128x128 block, edge blocks partial); others store
``*_scale`` / ``*.scale`` per tensor or per row, or torchao's flattened ``_qdata`` +
``_scale``. A scale multiplies: ``value = weight.float() * scale``, repeated per block.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from inspector import dtypes
from inspector.entry import Entry

DEFAULT_BLOCK = 128


def scale_blocks(
    shape: tuple[int, ...], scale_shape: tuple[int, ...], prefer: int | None = DEFAULT_BLOCK
) -> tuple[int, ...] | None:
    """Block size per dimension of ``shape`` that a scale of ``scale_shape`` implies, or None.

    One scale value covers the whole tensor; a 1-D scale of ``shape[0]`` values is per row.
    Otherwise each dimension holds ``ceil(size / block)`` scales; ``prefer`` (128, the
    DeepSeek-V3 / Hugging Face block) wins where it fits, since partial edge blocks make the
    block size ambiguous from shapes alone.
    """
    if math.prod(scale_shape) == 1:
        return tuple(shape)
    if len(scale_shape) == 1 and len(shape) == 2 and scale_shape[0] == shape[0]:
        return (1, shape[1])
    if len(scale_shape) != len(shape):
        return None
    blocks = []
    for size, count in zip(shape, scale_shape, strict=True):
        if count == 0 or count > size:
            return None
        if count == size:
            blocks.append(1)
        elif count == 1:
            blocks.append(size)
        elif prefer and math.ceil(size / prefer) == count:
            blocks.append(prefer)
        elif math.ceil(size / math.ceil(size / count)) == count:
            blocks.append(math.ceil(size / count))
        else:
            return None
    return tuple(blocks)


def granularity(shape: tuple[int, ...], blocks: tuple[int, ...] | None) -> str:
    """``per-tensor``, ``per-row``, ``per-column`` or ``block AxB`` for a scale layout."""
    if blocks is None:
        return "unmatched"
    if tuple(blocks) == tuple(shape):
        return "per-tensor"
    if len(shape) == 2 and blocks == (1, shape[1]):
        return "per-row"
    if len(shape) == 2 and blocks == (shape[0], 1):
        return "per-column"
    inner = list(blocks)
    while len(inner) > 2 and inner[0] == 1:
        inner.pop(0)
    return "block " + "x".join(map(str, inner))


@dataclass(frozen=True, slots=True)
class ScalePair:
    """A plain float8 entry and the entry holding its (multiplicative) scales."""

    weight: str
    scale: str
    blocks: tuple[int, ...]
    granularity: str

    @property
    def label(self) -> str:
        """``block 128x128 weight_scale_inv``: the layout and the scale's own name."""
        parent = self.weight.rpartition(".")[0]
        suffix = self.scale[len(parent) + 1 :] if parent else self.scale
        return f"{self.granularity} {suffix}"


@dataclass(frozen=True, slots=True)
class ScalePairs:
    """Every pairing in a checkpoint: by weight key, and each scale key's weight."""

    by_weight: dict[str, ScalePair]
    weight_of: dict[str, str]

    def fp8_label(self, entry: Entry) -> str | None:
        """What the pairing says about ``entry`` (its ``fp8`` column), if anything."""
        if entry.key in self.by_weight:
            return self.by_weight[entry.key].label
        if entry.key in self.weight_of:
            return f"scale of {self.weight_of[entry.key]}"
        if entry.kind == "tensor" and entry.dtype in dtypes.FLOAT8:
            return "no scale found"
        return None


def _scale_candidates(key: str) -> list[str]:
    names = [key + "_scale_inv", key + "_scale", key + ".scale"]
    if key.endswith("_qdata"):
        names.append(key.removesuffix("_qdata") + "_scale")
    return names


def scaled_pairs(entries: Iterable[Entry] | Mapping[str, Entry]) -> ScalePairs:
    """Plain float8 tensors whose scale sibling exists and fits their shape (``entries``:
    the entries, or them by key)."""
    by_key = entries if isinstance(entries, Mapping) else {e.key: e for e in entries}
    pairs = {}
    for weight in by_key.values():
        if weight.kind != "tensor" or weight.dtype not in dtypes.FLOAT8 or not weight.shape:
            continue
        for name in _scale_candidates(weight.key):
            scale = by_key.get(name)
            if scale is None or scale.kind != "tensor" or scale.shape is None:
                continue
            blocks = scale_blocks(weight.shape, scale.shape)
            if blocks is not None:
                pairs[weight.key] = ScalePair(
                    weight.key, name, blocks, granularity(weight.shape, blocks)
                )
                break
    return ScalePairs(pairs, {p.scale: p.weight for p in pairs.values()})
