"""Tensor transforms between torchtitan and Hugging Face layouts, one source tensor each.

Module-level functions (bound with ``functools.partial``) so plans pickle into worker
processes. Each returns a new tensor or a view of its input; none reads anything else.
"""

from __future__ import annotations

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


def zeros_per_row(t: torch.Tensor) -> torch.Tensor:
    """float32 zeros, one per row of ``t`` (torchtitan's initial ``expert_bias``, one per
    expert of a router gate [experts, dim])."""
    return torch.zeros(t.shape[0], dtype=torch.float32, device=t.device)


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
    if function is zeros_per_row:
        return "zeros, one per row: torchtitan's initial value (HF has no such tensor)"
    return None
