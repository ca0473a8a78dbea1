"""Tensor transforms between torchtitan and Hugging Face layouts, one source tensor each.

Module-level functions (bound with ``functools.partial``) so plans pickle into worker
processes. Each returns a new tensor or a view of its input; none reads anything else.
torch is imported only by the ones that make a new tensor, so planning needs none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def copy(t: torch.Tensor) -> torch.Tensor:
    """The tensor as it is (a rename)."""
    return t


def rope_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan's interleaved-pair RoPE rows to HF's half-split rows, per head.

    Same permutation as HF's Llama conversion script and torchtitan's llama3 ``to_hf``.
    """
    rows, cols = t.shape
    return t.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def rope_from_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`rope_to_hf`."""
    rows, cols = t.shape
    return t.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def expert(t: torch.Tensor, index: int) -> torch.Tensor:
    """Expert ``index`` of a stacked ``[n_experts, ...]`` tensor (HF keeps one per expert)."""
    return t[index]


def expert_piece(t: torch.Tensor) -> torch.Tensor:
    """One HF expert as a ``[1, ...]`` slice of torchtitan's stacked tensor."""
    return t.unsqueeze(0)


def split_rows(t: torch.Tensor, groups: int, sizes: tuple[int, ...], part: int) -> torch.Tensor:
    """Part ``part`` of rows fused as ``groups`` repeats of ``sizes`` blocks: Megatron's QKV
    (per query group ``[q heads; k; v]``) or SwiGLU ``linear_fc1`` (``[gate; up]``, 1 group)."""
    grouped = t.reshape(groups, sum(sizes), *t.shape[1:])
    piece = grouped.narrow(1, sum(sizes[:part]), sizes[part])
    return piece.reshape(groups * sizes[part], *t.shape[1:])


def expert_rows(t: torch.Tensor, index: int, sizes: tuple[int, ...], part: int) -> torch.Tensor:
    """Part ``part`` of expert ``index``'s fused rows (Megatron's stacked experts' SwiGLU
    ``linear_fc1``: ``[experts, gate; up, ...]``)."""
    return split_rows(t[index], 1, sizes, part)


def first_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows: a vocabulary padded for tensor parallelism, trimmed."""
    return t[:rows]


def fuse_rows(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """The inverse of :func:`split_rows` over all parts, as one layer's ``[1, rows, ...]``
    chunk of Megatron's stacked tensor."""
    import torch

    grouped = [p.reshape(groups, -1, *p.shape[1:]) for p in parts]
    fused = torch.cat(grouped, dim=1)
    return fused.reshape(1, -1, *parts[0].shape[1:])


def fuse_expert(parts: list[torch.Tensor]) -> torch.Tensor:
    """One expert's parts fused along rows, as a ``[1, 1, rows, ...]`` chunk of Megatron's
    experts stacked over layers and experts."""
    return fuse_rows(parts, 1).unsqueeze(0)


def pad_rows(parts: list[torch.Tensor], rows: int) -> torch.Tensor:
    """The one part with zero rows appended up to ``rows`` (Megatron's padded vocabulary)."""
    import torch

    (t,) = parts
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def only(parts: list[torch.Tensor]) -> torch.Tensor:
    """The one part as it is."""
    (t,) = parts
    return t


def zeros_per_row(t: torch.Tensor) -> torch.Tensor:
    """float32 zeros, one per row of ``t`` (torchtitan's initial ``expert_bias``, one per
    expert of a router gate [experts, dim])."""
    import torch

    return torch.zeros(t.shape[0], dtype=torch.float32, device=t.device)


def blocks(
    transform: object, shape: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """Where the transform's output lies in its input of ``shape`` as blocks ``(offsets,
    sizes)`` in output order, when it is such blocks (a copy, an expert, the first rows, a
    row range of each group: a QKV part is one block per query group), so its stored bytes
    can be copied as they are; None when it computes."""
    function = getattr(transform, "func", transform)
    arguments = getattr(transform, "keywords", {})
    zeros = (0,) * len(shape)
    if function is copy:
        return [(zeros, shape)]
    if function is expert:
        return [((arguments["index"], *zeros[1:]), (1, *shape[1:]))]
    if function is split_rows:
        sizes, part, groups = arguments["sizes"], arguments["part"], arguments["groups"]
        start, rows = sum(sizes[:part]), sizes[part]
        step = sum(sizes)
        return [((g * step + start, *zeros[1:]), (rows, *shape[1:])) for g in range(groups)]
    if function is expert_rows:
        sizes, part = arguments["sizes"], arguments["part"]
        start = (arguments["index"], sum(sizes[:part]), *zeros[2:])
        return [(start, (1, sizes[part], *shape[2:]))]
    if function is first_rows:
        return [(zeros, (arguments["rows"], *shape[1:]))]
    return None


def describe(transform: object) -> str | None:
    """What a plan's transform does, in words (None for a plain copy)."""
    function = getattr(transform, "func", transform)
    arguments = getattr(transform, "keywords", {})
    if function is rope_to_hf:
        return f"RoPE rows: torchtitan's interleaved pairs -> HF halves, {arguments['heads']} heads"
    if function is rope_from_hf:
        return f"RoPE rows: HF halves -> torchtitan's interleaved pairs, {arguments['heads']} heads"
    if function is expert:
        return f"expert {arguments['index']} of the stack"
    if function is expert_piece:
        return "one expert of torchtitan's stack"
    if function is split_rows:
        fused = f"{arguments['groups']} x {arguments['sizes']}"
        return f"part {arguments['part']} of rows fused as {fused}"
    if function is expert_rows:
        fused = f"{arguments['sizes']}"
        return f"expert {arguments['index']} of the stack, part {arguments['part']} of rows {fused}"
    if function is first_rows:
        return f"first {arguments['rows']} rows (vocabulary padding dropped)"
    if function is zeros_per_row:
        return "zeros, one per row: torchtitan's initial value (HF has no such tensor)"
    return None
