"""Where a rank's shard of a DTensor lies in the whole tensor, from the global shape, the
mesh shape, the rank's mesh coordinate and the placements, by torch's own rule (no torch).

For each mesh dimension, left to right, the positions still held along the placement's
tensor dim are cut: ``Shard`` into ``n`` chunks of ``ceil(L / n)`` (the last ones shorter,
possibly empty); ``_StridedShard(split_factor=k)`` first into ``k`` pieces of ``ceil(L / k)``,
each cut like ``Shard``, the rank taking its chunk of every piece; ``Replicate`` keeps all.
A rank's positions may be non-contiguous (interleaved ``_StridedShard``): its shard is then
several boxes, each a contiguous block of the whole tensor and of the local tensor.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

# A run of consecutive positions along one tensor dim: (first global index, length).
Run = tuple[int, int]
MAX_BOXES = 1 << 16  # a genuine layout splits a shard into a handful of boxes


class Place(NamedTuple):
    """One mesh dimension's placement: ``kind`` shard / strided / replicate / partial."""

    kind: str
    dim: int = 0
    split_factor: int = 1


class Box(NamedTuple):
    """A block of a rank's shard: where it starts in the whole tensor and in the local one."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_offsets: tuple[int, ...]


def shard_boxes(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[Place, ...],
) -> tuple[tuple[int, ...], list[Box]]:
    """The local shard's shape and the boxes it is made of (ValueError when the layout is
    impossible: a placement outside the tensor's dims, a coordinate outside the mesh)."""
    if not len(mesh_shape) == len(coordinate) == len(placements):
        raise ValueError(
            f"mesh shape {list(mesh_shape)}, coordinate {list(coordinate)} and "
            f"{len(placements)} placements do not match"
        )
    runs: list[list[Run]] = [[(0, n)] if n else [] for n in shape]
    for size, at, place in zip(mesh_shape, coordinate, placements, strict=True):
        if not 0 <= at < size:
            raise ValueError(f"mesh coordinate {list(coordinate)} lies outside {list(mesh_shape)}")
        if place.kind == "replicate":
            continue
        if place.kind == "partial":
            raise ValueError("a Partial placement holds partial sums, not a piece of the tensor")
        if not 0 <= place.dim < len(shape):
            raise ValueError(f"placement {place.kind}({place.dim}) outside shape {list(shape)}")
        held = runs[place.dim]
        if place.kind == "shard":
            runs[place.dim] = _shard(held, size, at)
        elif place.kind == "strided" and place.split_factor > 0:
            runs[place.dim] = _strided(held, size, at, place.split_factor)
        else:
            raise ValueError(f"unknown placement {place.kind}")
    local_shape = tuple(sum(n for _, n in r) for r in runs)
    if math.prod(len(r) for r in runs if r) > MAX_BOXES:
        raise ValueError(f"the shard splits into more than {MAX_BOXES} blocks")
    if not all(runs):
        return local_shape, []
    per_dim = [_with_local_starts(r) for r in runs]
    boxes = [
        Box(
            tuple(start for start, _, _ in combo),
            tuple(n for _, n, _ in combo),
            tuple(local for _, _, local in combo),
        )
        for combo in itertools.product(*per_dim)
    ]
    return local_shape, boxes


def _length(runs: list[Run]) -> int:
    return sum(n for _, n in runs)


def _chunk(length: int, parts: int, index: int) -> tuple[int, int]:
    """Start and size of chunk ``index`` of ``parts`` (``ceil`` sized, like torch.chunk)."""
    size = -(-length // parts) if parts else 0
    start = min(index * size, length)
    return start, max(0, min(length, start + size) - start)


def _take(runs: list[Run], start: int, size: int) -> list[Run]:
    """Positions ``start .. start + size`` of the sequence the runs spell, as runs."""
    taken, seen = [], 0
    for first, n in runs:
        lo, hi = max(start, seen), min(start + size, seen + n)
        if lo < hi:
            taken.append((first + lo - seen, hi - lo))
        seen += n
    return taken


def _merged(runs: list[Run]) -> list[Run]:
    out: list[Run] = []
    for first, n in runs:
        if out and out[-1][0] + out[-1][1] == first:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((first, n))
    return out


def _shard(runs: list[Run], parts: int, index: int) -> list[Run]:
    start, size = _chunk(_length(runs), parts, index)
    return _take(runs, start, size)


def _strided(runs: list[Run], parts: int, index: int, split_factor: int) -> list[Run]:
    if split_factor > MAX_BOXES:
        raise ValueError(f"split factor {split_factor} is larger than any genuine layout's")
    length = _length(runs)
    piece = -(-length // split_factor)
    taken: list[Run] = []
    for j in range(split_factor):
        begin = min(j * piece, length)
        span = min(length, begin + piece) - begin
        start, size = _chunk(span, parts, index)
        taken += _take(runs, begin + start, size)
    return _merged(taken)


def _with_local_starts(runs: list[Run]) -> list[tuple[int, int, int]]:
    out, local = [], 0
    for first, n in runs:
        out.append((first, n, local))
        local += n
    return out
