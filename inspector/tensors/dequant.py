"""Dequantization formulas for low-precision payloads, in plain torch (no torchao import).

Each function follows the producer's own convention operation by operation, so results are
bit-identical to torchao 0.18 (``Float8TrainingTensor.to_original_precision``,
``Float8Tensor.dequantize``, ``MXTensor.dequantize``, ``NVFP4Tensor.dequantize``,
``NF4Tensor.get_original_weight``, ``Int8Tensor`` / ``IntxUnpackedToInt8Tensor.dequantize``)
and to the DeepSeek-V3 / Hugging Face block-FP8 rule.
"""

from __future__ import annotations

import math

import torch

FP4_E2M1 = "fp4_e2m1"
FP6_E2M3 = "fp6_e2m3"
FP6_E3M2 = "fp6_e3m2"
# Sub-byte element formats: name -> (exponent bits, mantissa bits).
_SUB_BYTE = {FP4_E2M1: (2, 1), FP6_E2M3: (2, 3), FP6_E3M2: (3, 2)}
_E8M0_BIAS = 127
_E8M0_NAN = 255


def float8_training(
    data: torch.Tensor, scale: torch.Tensor, orig_dtype: torch.dtype
) -> torch.Tensor:
    """torchao ``Float8TrainingTensor``: ``data`` was multiplied by ``scale``; divide it back."""
    return data.to(orig_dtype) / scale


def affine_float8(qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao ``Float8Tensor``: ``qdata * scale`` in float32 (scale repeated over its blocks)."""
    return (qdata.to(torch.float32) * expand_scale(scale, qdata.shape)).to(dtype)


def expand_scale(scale: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """``scale`` broadcastable to ``shape``: kept as is when it broadcasts, else repeated per block.

    Blocks must tile ``shape`` exactly (torchao's ``_maybe_expand_scale_to_tensor_shape``).
    """
    shape = tuple(shape)
    if tuple(scale.shape) == shape or scale.numel() == 1:
        return scale
    if scale.dim() == len(shape) and all(
        s in (n, 1) for s, n in zip(scale.shape, shape, strict=True)
    ):
        return scale
    if scale.dim() != len(shape) or any(
        n % s for s, n in zip(scale.shape, shape, strict=True) if s
    ):
        raise ValueError(f"scale of shape {list(scale.shape)} does not tile shape {list(shape)}")
    for dim, (s, n) in enumerate(zip(scale.shape, shape, strict=True)):
        if n // s > 1:
            scale = scale.repeat_interleave(n // s, dim=dim)
    return scale


def block_float8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """Block-scaled float8 (DeepSeek-V3 ``weight_scale_inv``): ``weight * scale`` per block.

    ``block`` gives the block size of each trailing dimension of ``weight`` covered by
    ``scale``; edge blocks may be partial (``scale`` has ``ceil(size / block)`` entries).
    """
    full = scale.to(torch.float32)
    lead = weight.dim() - len(block)
    for i, size in enumerate(block):
        dim = lead + i
        if full.shape[dim] != weight.shape[dim]:
            full = full.repeat_interleave(size, dim=dim).narrow(dim, 0, weight.shape[dim])
    return (weight.to(torch.float32) * full).to(dtype)


def affine_int(
    qdata: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    block: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """torchao ``dequantize_affine``: ``(qdata - zero_point) * scale``, one scale (and zero
    point) per block of ``block`` elements, computed in ``dtype`` as torchao does."""
    if len(block) != qdata.dim():
        raise ValueError(f"block size {list(block)} does not fit a {qdata.dim()}-D tensor")
    grouped: list[int] = []
    reduced: list[int] = []
    for size, step in zip(qdata.shape, block, strict=True):
        if step not in (size, 1) and step > 1:
            if size % step:
                raise ValueError(f"block size {list(block)} does not tile {list(qdata.shape)}")
            grouped += [size // step, step]
            reduced += [size // step, 1]
        else:
            grouped.append(size)
            reduced.append(1 if step != 1 else size)
    values = qdata.view(grouped).to(dtype, copy=True)
    if zero_point is not None:
        values = values - zero_point.view(reduced).to(dtype)
    values = values * scale.view(reduced)
    return values.view(qdata.shape).to(dtype)


# --- MX (OCP microscaling) and NVFP4 ------------------------------------------------------


def e8m0_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 block scales (biased exponents) as float32 powers of two; 255 means NaN."""
    biased = scale.view(torch.uint8)
    exponent = biased.to(torch.int16) - _E8M0_BIAS
    values = torch.pow(torch.full_like(exponent, 2.0, dtype=torch.float32), exponent)
    return torch.where(biased != _E8M0_NAN, values, float("nan"))


def sub_byte_table(name: str) -> torch.Tensor:
    """float32 value of every code of a sub-byte float format (no inf/NaN codes exist)."""
    ebits, mbits = _SUB_BYTE[name]
    bias = (1 << (ebits - 1)) - 1
    values = []
    for code in range(1 << (1 + ebits + mbits)):
        exponent = (code >> mbits) & ((1 << ebits) - 1)
        mantissa = code & ((1 << mbits) - 1)
        if exponent == 0:
            magnitude = mantissa * 2.0 ** (1 - bias - mbits)
        else:
            magnitude = (1 + mantissa / (1 << mbits)) * 2.0 ** (exponent - bias)
        values.append(-magnitude if code >> (ebits + mbits) else magnitude)
    return torch.tensor(values, dtype=torch.float32)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Two e2m1 codes per byte, low nibble first, as float32 (last dimension doubled)."""
    codes = packed.contiguous().view(torch.uint8)
    pairs = torch.stack([codes & 0xF, codes >> 4], dim=-1)
    return sub_byte_table(FP4_E2M1)[pairs.long()].reshape(*codes.shape[:-1], -1)


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Undo the cuBLAS block-scaling swizzle (128x4 tiles of scales) to a ``rows x cols`` grid."""
    row_blocks, col_blocks = math.ceil(rows / 128), math.ceil(cols / 4)
    tiles = blocked.reshape(row_blocks * col_blocks, 32, 4, 4).transpose(1, 2)
    grid = tiles.reshape(row_blocks, col_blocks, 128, 4).permute(0, 2, 1, 3)
    return grid.reshape(row_blocks * 128, col_blocks * 4)[:rows, :cols]


def _unswizzle(
    scale: torch.Tensor, shape: tuple[int, ...], block: int, transposed: bool
) -> torch.Tensor:
    lead = shape[:-2]
    rows, cols = (shape[-1], shape[-2]) if transposed else (shape[-2], shape[-1])
    if transposed:
        scale = scale.transpose(-2, -1)
    scale = from_blocked(scale, math.prod(lead) * rows, cols // block)
    scale = scale.reshape(*lead, rows, cols // block)
    return scale.transpose(-2, -1) if transposed else scale


def mx(
    qdata: torch.Tensor,
    scale: torch.Tensor,
    elem: torch.dtype | str,
    block: int,
    shape: tuple[int, ...],
    swizzled: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """torchao ``MXTensor``: elements times their block's E8M0 scale (blocks along the last dim)."""
    if swizzled:
        scale = _unswizzle(scale, shape, block, qdata.stride(-2) < qdata.stride(-1))
    transposed = not qdata.is_contiguous()
    if transposed:
        qdata, scale = qdata.t(), scale.t()
    out_shape = tuple(qdata.shape)
    if elem in (torch.float8_e4m3fn, torch.float8_e5m2):
        values = qdata.to(dtype)
    elif elem in (FP6_E2M3, FP6_E3M2):
        values = sub_byte_table(elem)[qdata.view(torch.uint8).long()].to(dtype)
    elif elem in (FP4_E2M1, getattr(torch, "float4_e2m1fn_x2", None)):
        values = unpack_fp4(qdata).to(dtype)
        out_shape = (*out_shape[:-1], out_shape[-1] * 2)
    else:
        raise ValueError(f"unknown MX element type {elem!r}")
    values = values.reshape(-1, block) * e8m0_to_float32(scale).reshape(-1, 1).to(dtype)
    values = values.reshape(out_shape)
    return values.t() if transposed else values


def nvfp4(
    qdata: torch.Tensor,
    scale: torch.Tensor,
    per_tensor_scale: torch.Tensor | None,
    block: int,
    shape: tuple[int, ...],
    swizzled: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """torchao ``NVFP4Tensor``: e2m1 elements times (per-tensor scale x E4M3 block scale)."""
    transposed = qdata.stride(-2) < qdata.stride(-1)
    if swizzled:
        scale = _unswizzle(scale, shape, block, transposed)
    lead = shape[:-2]
    rows, cols = (shape[-1], shape[-2]) if transposed else (shape[-2], shape[-1])
    if transposed:
        qdata, scale = qdata.transpose(-2, -1), scale.transpose(-2, -1)
    values = unpack_fp4(qdata).view(*lead, rows, cols // block, block)
    scale = scale.to(torch.float32)
    if per_tensor_scale is not None:
        scale = per_tensor_scale * scale
    result = (values * scale.reshape(*lead, rows, cols // block, 1)).view(*lead, rows, cols)
    result = result.to(dtype)
    return result.transpose(-2, -1) if transposed else result


def nf4(
    quantized_data: torch.Tensor,
    quantized_scalers: torch.Tensor,
    quantization_factor: torch.Tensor,
    scaler_mean: torch.Tensor,
    table: torch.Tensor,
    block: int,
    scaler_block: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """torchao ``NF4Tensor`` (QLoRA): 4-bit codes looked up in ``table``, times double-quantized
    per-block absmax scalers."""
    first = table[(quantized_data >> 4).long()]
    second = table[(quantized_data & 0xF).long()]
    groups = quantized_scalers.view(-1, scaler_block)
    scalers = (groups / quantization_factor.unsqueeze(-1)).flatten().to(dtype) + scaler_mean
    repeated = scalers.unsqueeze(-1).expand(scalers.size(0), block // 2).flatten()
    first, second = first * repeated, second * repeated
    return torch.stack(
        [first.unsqueeze(-1).transpose(0, 1), second.unsqueeze(-1).transpose(0, 1)], dim=-1
    ).reshape(shape)
