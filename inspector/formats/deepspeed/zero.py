"""Where each fp32 master weight of a ZeRO checkpoint lies, by DeepSpeed's own arithmetic.

This mirrors ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``
(DeepSpeed 0.19) without reading any tensor: the result is, per name, the list of slices of
the ranks' flat fp32 partitions (or of model-states tensors) that, concatenated and cut to
the tensor's size, are its value. No I/O here; the reader reads the slices.

- ZeRO 1 and 2: per parameter group, the ranks' partitions concatenated in rank order form
  one vector; the group's parameters lie in it one after the other, in ``param_shapes``
  order, each followed by its ``param_alignment_paddings`` (when the optimizer states keep
  them; else unpadded). The group's end, aligned to ``2 * world_size``, must equal the
  vector's.
- ZeRO 3: every parameter is split on its own: each rank holds ``ceil(numel / world_size)``
  elements of it at the same offset of its flat groups (groups concatenated); the
  parameter is the ranks' slices concatenated, cut to ``numel``. Offsets over all
  parameters times the world size must equal the elements the ranks hold.
- Buffers come from the model states (floating ones as float32), frozen parameters
  from ``frozen_param_fragments`` (ZeRO 3: every rank's fragment concatenated), tied
  parameters (``shared_params``) are their partner's value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

PARAM_SHAPES = "param_shapes"


@dataclass(frozen=True, slots=True)
class Slice:
    """``count`` elements from element ``start`` of stored tensor ``tensor`` of ``file``
    (``tensor``: the key that names it in that file's flattened keys)."""

    file: str
    tensor: str
    start: int
    count: int


@dataclass(frozen=True, slots=True)
class Master:
    """One logical tensor of the reconstruction: its dtype (``None``: the stored one), shape,
    the slices that make it (in order; the last may run past ``numel``), or the reason it
    cannot be made."""

    name: str
    dtype: str | None
    shape: tuple[int, ...]
    slices: tuple[Slice, ...] = ()
    error: str | None = None
    cast: bool = False  # buffers: converted to float32 as zero_to_fp32 does

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Partition:
    """One rank's flat fp32 partition of one parameter group: where it is, its length."""

    file: str
    tensor: str
    numel: int


def zero2_masters(
    param_shapes: Sequence[dict[str, tuple[int, ...]]],
    ranks: Sequence[Sequence[Partition]],
    dtype: str,
    paddings: Sequence[Sequence[int]] | None,
    *,
    where: str,
) -> list[Master]:
    """ZeRO 1/2: ``ranks[r][g]`` is rank r's partition of group g; ``paddings[g][i]``: the
    elements after parameter i of group g."""
    world = len(ranks)
    masters: list[Master] = []
    for group, shapes in enumerate(param_shapes):
        if group >= len(ranks[0]):
            missing = f"{where}: {PARAM_SHAPES} has group {group}, the partitions do not"
            masters.extend(Master(n, dtype, s, error=missing) for n, s in shapes.items())
            continue
        parts = [rank[group] for rank in ranks]
        avail = sum(p.numel for p in parts)
        pads = paddings[group] if paddings is not None and group < len(paddings) else None
        placed, offset = [], 0
        for index, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            placed.append(Master(name, dtype, shape, tuple(_cut(parts, offset, numel))))
            offset += numel + (pads[index] if pads is not None and index < len(pads) else 0)
        align = 2 * world
        problem: str | None = None
        if paddings is not None and (pads is None or len(pads) != len(shapes)):
            problem = (
                f"{where}: param_alignment_paddings of group {group} do not match its "
                f"{len(shapes)} parameters in {PARAM_SHAPES}"
            )
        elif _aligned(offset, align) != _aligned(avail, align):
            problem = (
                f"{where}: {PARAM_SHAPES}[{group}] does not add up: its parameters take "
                f"{offset} elements, the {world} ranks' partitions of group {group} hold {avail}"
            )
        if problem:
            placed = [Master(m.name, dtype, m.shape, error=problem) for m in placed]
        masters.extend(placed)
    return masters


def zero3_masters(
    param_shapes: Sequence[dict[str, tuple[int, ...]]],
    ranks: Sequence[Sequence[Partition]],
    dtype: str,
    *,
    where: str,
) -> list[Master]:
    """ZeRO 3: ``ranks[r]`` is rank r's flat groups, in group order."""
    world = len(ranks)
    shapes = {name: shape for group in param_shapes for name, shape in group.items()}
    masters, offset = [], 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        share = math.ceil(numel / world)
        slices = [piece for rank in ranks for piece in _cut(rank, offset, share)]
        masters.append(Master(name, dtype, shape, tuple(slices)))
        offset += share
    avail = sum(p.numel for p in ranks[0]) * world
    if offset * world != avail:
        problem = (
            f"{where}: {PARAM_SHAPES} does not add up: its parameters take {offset * world} "
            f"elements over {world} ranks, the ranks' flat groups hold {avail}"
        )
        masters = [Master(m.name, dtype, m.shape, error=problem) for m in masters]
    return masters


def _cut(parts: Sequence[Partition], offset: int, count: int) -> list[Slice]:
    """The slices of ``parts`` (concatenated) covering ``[offset, offset + count)``; what
    lies past their end is left out (a short partition: the value is found incomplete)."""
    slices, start = [], 0
    for part in parts:
        lo, hi = max(offset, start), min(offset + count, start + part.numel)
        if lo < hi:
            slices.append(Slice(part.file, part.tensor, lo - start, hi - lo))
        start += part.numel
    return slices


def _aligned(value: int, align: int) -> int:
    return align * math.ceil(value / align)


def complete(master: Master) -> Master:
    """The master, or its error when its slices hold fewer elements than it has."""
    held = sum(s.count for s in master.slices)
    if master.error is None and held < master.numel:
        problem = f"its slices hold {held} of its {master.numel} elements (a partition is short)"
        return Master(master.name, master.dtype, master.shape, error=problem)
    return master
