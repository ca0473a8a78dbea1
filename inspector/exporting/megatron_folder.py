"""``export(..., format="megatron")``: a Megatron-Core ``torch_dist`` folder from an HF Llama /
Qwen3 / Qwen2 / Qwen3-MoE / Mixtral / Qwen2-MoE model, for Megatron training to start from
(``--load`` / ``--pretrained-checkpoint``).

The plan (:func:`.hf.megatron_gpt.from_hf`) fuses QKV (and its biases) per query group and
SwiGLU's gate and up, stacks layers and experts (one DCP chunk per layer and expert, so no
stack is assembled in memory), pads the vocabulary to a multiple of 128 and records the
run's ``args`` in the common state.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

from inspector import dtypes
from inspector.errors import UsageError
from inspector.exporting.base import ExportResult, refuse_inside_source
from inspector.exporting.dcp_folder import write_and_verify
from inspector.exporting.model_weights import ModelWeights, load_config, refuse_overlap
from inspector.formats.dcp.megatron_writer import write_megatron
from inspector.formats.dcp.writer import Chunk
from inspector.formats.writing import Item

if TYPE_CHECKING:
    import torch

    from inspector.exporting.hf.megatron_gpt import Piece
    from inspector.exporting.request import ExportRequest

HF_ARCHES = ("auto", "llama3", "qwen3", "qwen3_moe")


def export_megatron(request: ExportRequest) -> ExportResult:
    """Write the source's HF-named weights as a Megatron-Core torch_dist folder."""
    from inspector.exporting.hf import megatron_gpt

    arch = request.arch or "auto"
    if arch not in HF_ARCHES:
        raise UsageError(f"format='megatron' reads HF {' or '.join(HF_ARCHES[1:])}, not {arch!r}")
    started = time.perf_counter()
    ck, out, dtype = request.open(), request.out, request.dtype
    refuse_inside_source(ck, out)
    refuse_overlap(out, {"hf_assets": request.hf_assets})
    weights = ModelWeights(ck, request.fp8, dtype)
    plan = megatron_gpt.from_hf(
        weights.metas(), load_config(request.hf_config, request.hf_assets, ck)
    )
    args = plan.args
    chunks = [_chunk(weights, p, dtype) for p in plan.pieces]
    params = dtype or args["params_dtype"]
    args |= {"params_dtype": dtypes.to_torch(params), "bf16": params == "bfloat16",
             "fp16": params == "float16"}  # fmt: skip
    modules = plan.modules
    files, verification = write_and_verify(
        request,
        weights,
        chunks,
        lambda meter: write_megatron(out, chunks, args, modules, meter, request.overwrite),
    )
    return ExportResult(
        format="megatron",
        files=files,
        index=None,
        tensors=len({c.fqn for c in chunks}),
        objects=1 + sum(max(e, 1) for e in modules.values()) * args["num_layers"],
        bytes=sum(c.item.nbytes for c in chunks),
        skipped={weights.stored(k): why for k, why in plan.left_out.items()} | weights.skipped,
        conversions={},
        names={},
        seconds=time.perf_counter() - started,
        verification=verification,
        arch=megatron_gpt.ARCH,
        reason=f"{plan.reason}; written as Megatron-Core GPT (local/TE spec names)",
    )


def _chunk(weights: ModelWeights, piece: Piece, dtype: str | None) -> Chunk:
    cast = dtype or dtypes.name_of(piece.dtype)
    item = Item(piece.key, cast, piece.shape, functools.partial(_build, weights, piece, cast))
    return Chunk(piece.key, item, piece.offsets, piece.full_shape)


def _build(weights: ModelWeights, piece: Piece, dtype: str) -> torch.Tensor:
    return piece.build([weights.read(s) for s in piece.sources]).to(dtypes.to_torch(dtype))
