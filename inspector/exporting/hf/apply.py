"""Run a plan in memory (small models, tests): the reference a streaming exporter matches."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from inspector import dtypes
from inspector.exporting.hf.base import Plan

if TYPE_CHECKING:
    import torch


def apply_plan(plan: Plan, read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` for every output of ``plan``; pieces are copied into whole tensors.

    Each source is read once in a row of outputs that share it (the order plans emit).
    """
    import torch

    out: dict[str, torch.Tensor] = {}
    last_key: tuple[str, int | None] | None = None
    last = torch.empty(0)
    for o in plan.outputs:
        if (o.source, o.index) != last_key:
            last_key = (o.source, o.index)
            source = read(o.source)
            last = source if o.index is None else source[o.index]
        value = o.transform(last)
        if o.offsets is None:
            out[o.name] = value
            continue
        whole = out.get(o.name)
        if whole is None:
            dtype = dtypes.to_torch(o.dtype)
            whole = out[o.name] = torch.empty(o.full_shape or o.shape, dtype=dtype)
        region = whole
        for axis, (start, size) in enumerate(zip(o.offsets, o.shape, strict=True)):
            region = region.narrow(axis, start, size)
        region.copy_(value)
    return out
