"""Values of quantized weights stored as several tensors (see
:mod:`inspector.formats.compressed_tensors`): compressed-tensors formats and gpt-oss MXFP4.

Each function follows its producer's own decompression operation by operation, so results are
bit-identical to compressed-tensors' compressors (``decompress``) and to transformers'
``convert_moe_packed_tensors``, without importing either.
"""

from __future__ import annotations

import math

import torch

from inspector.formats.base import FINE_GRAINED_FP8, MXFP4, Scheme
from inspector.tensors.dequant import FP4_E2M1, e8m0_to_float32, sub_byte_table, unpack_fp4


class SchemeError(ValueError):
    """Parts that do not fit their scheme (the caller names the key and the scheme)."""


def unpack_int32(
    packed: torch.Tensor, bits: int, shape: tuple[int, ...], dim: int = -1
) -> torch.Tensor:
    """compressed-tensors' dense packing: element ``i`` of a row sits at bit ``i * bits`` of
    the row's little-endian int32 words, stored with an offset of ``2**(bits-1)``; int8 out."""
    if packed.dtype != torch.int32 or not 1 <= bits <= 8:
        raise SchemeError(f"packed weights must be int32 with 1-8 bits, got {packed.dtype}, {bits}")
    if dim == 0:
        return unpack_int32(packed.transpose(0, 1), bits, (shape[1], shape[0])).transpose(0, 1)
    rows, cols = math.prod(shape[:-1]), shape[-1]
    words = packed.reshape(-1, packed.shape[-1]) if packed.dim() else packed
    if words.shape[0] != rows or words.shape[-1] * 32 < cols * bits:
        raise SchemeError(
            f"packed tensor of shape {list(packed.shape)} is too short for shape {list(shape)}"
        )
    stream = words.contiguous().view(torch.uint8)
    weights = torch.arange(8, dtype=torch.uint8)
    bitstream = ((stream.unsqueeze(-1) >> weights) & 1).reshape(rows, -1)[:, : cols * bits]
    powers = (1 << torch.arange(bits, dtype=torch.int32)).to(torch.int32)
    values = (bitstream.reshape(rows, cols, bits).to(torch.int32) * powers).sum(-1)
    return (values - (1 << (bits - 1))).to(torch.int8).reshape(shape)


def fp4_values(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Two e2m1 codes per byte, low nibble first (compressed-tensors' NVFP4 packing)."""
    return unpack_fp4(packed).to(dtype)


def dequantize_args(
    quantized: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    scheme: Scheme,
    global_scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """compressed-tensors ``dequantize``: ``(q - zero_point) * scale`` in the scale's dtype,
    per block, group or broadcast as the strategy says (``scale / global_scale`` first)."""
    dtype = dtype or scale.dtype
    if scheme.strategy == "block":
        return _blocks(quantized, scale, zero_point, scheme)
    if scheme.strategy in ("group", "tensor_group"):
        size = scheme.group_size or 0
        if size <= 0 or quantized.shape[-1] % size:
            raise SchemeError(f"group size {size} does not divide {quantized.shape[-1]} columns")
        stored = list(scale.shape)
        while scale.dim() < 2:
            scale = scale.unsqueeze(1)
            zero_point = zero_point.unsqueeze(1) if zero_point is not None else None
        grouped = quantized.unflatten(-1, (quantized.shape[-1] // size, size))
        if tuple(scale.shape) != tuple(grouped.shape[:-1]):
            raise SchemeError(
                f"scale of shape {stored} does not fit a weight of "
                f"{list(quantized.shape)} in groups of {size}"
            )
        zp = zero_point.unsqueeze(-1) if zero_point is not None else None
        value = _affine(grouped, scale.unsqueeze(-1), zp, global_scale)
        return value.flatten(start_dim=-2).to(dtype)
    _check_fits(scale, quantized)
    return _affine(quantized, scale, zero_point, global_scale)


def _affine(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    global_scale: torch.Tensor | None,
) -> torch.Tensor:
    if global_scale is not None:
        scale = scale / global_scale
    value = q.to(scale.dtype)
    # In place on the cast's own new tensor (same values, no second weight-sized buffer).
    own = value is not q and all(_fits(t, value) for t in (scale, zero_point) if t is not None)
    if zero_point is not None:
        zp = zero_point.to(scale.dtype)
        value = value.sub_(zp) if own else value - zp
    return value.mul_(scale) if own else value * scale


def _fits(scale: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ``scale`` broadcasts over ``values`` (checked by hand: torch.broadcast_shapes
    imports torch.fx, seconds on first use)."""
    short, long = tuple(scale.shape), tuple(values.shape)
    return len(short) <= len(long) and all(
        s in (1, n) for s, n in zip(reversed(short), reversed(long), strict=False)
    )


def _check_fits(scale: torch.Tensor, values: torch.Tensor) -> None:
    if not _fits(scale, values):
        raise SchemeError(
            f"scale of shape {list(scale.shape)} does not fit a weight of {list(values.shape)}"
        )


def _blocks(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, scheme: Scheme
) -> torch.Tensor:
    height, width = scheme.block_structure or (0, 0)
    if height <= 0 or width <= 0 or q.dim() != 2:
        raise SchemeError(f"block structure {scheme.block_structure} does not fit {list(q.shape)}")
    rows, cols = q.shape
    padded = (math.ceil(rows / height) * height, math.ceil(cols / width) * width)
    if padded != (rows, cols):
        q = torch.nn.functional.pad(q, (0, padded[1] - cols, 0, padded[0] - rows))
    blocks = q.reshape(padded[0] // height, height, padded[1] // width, width).transpose(1, 2)
    sb = scale.unsqueeze(-1).unsqueeze(-1)
    _check_fits(sb, blocks)
    zb = zero_point.unsqueeze(-1).unsqueeze(-1) if zero_point is not None else None
    value = _affine(blocks, sb, zb, None).transpose(1, 2).reshape(padded)
    return value[:rows, :cols]


def compressed(parts: dict[str, torch.Tensor], scheme: Scheme) -> torch.Tensor:
    """The weight that compressed-tensors' compressor for ``scheme.format`` decompresses
    ``parts`` (local names: ``weight_packed``, ``weight_scale``, ...) into; transformers'
    fine-grained FP8: ``weight * weight_scale_inv`` in float32, as its ``Fp8Dequantize``."""
    if scheme.format == FINE_GRAINED_FP8:
        weight, inverse = parts["weight"], parts["weight_scale_inv"]
        blocks = scheme.block_structure or weight.shape
        grid = [math.ceil(n / b) for n, b in zip(weight.shape, blocks, strict=False)]
        if inverse.numel() != 1 and list(inverse.shape) != grid:
            raise SchemeError(f"weight_scale_inv of shape {list(inverse.shape)} does not fit a "
                              f"weight of {list(weight.shape)} in blocks of {list(blocks)}")
        inverse = e8m0_to_float32(inverse) if inverse.dtype == torch.uint8 else inverse.float()
        return dequantize_args(weight, inverse, None, scheme)
    scale = parts["weight_scale"]
    zero_point = parts.get("weight_zero_point")
    if scheme.format == "nvfp4-pack-quantized":
        packed = parts["weight_packed"]
        if packed.dtype != torch.uint8 or packed.dim() != 2:
            raise SchemeError(f"weight_packed must be 2-D uint8, got {packed.dtype}")
        values = fp4_values(packed, torch.bfloat16)
        return dequantize_args(
            values,
            scale.to(torch.bfloat16),
            None,
            scheme,
            parts.get("weight_global_scale"),
            torch.bfloat16,
        )
    if scheme.format == "pack-quantized":
        if "weight_shape" not in parts:
            raise SchemeError("weight_shape is missing")
        shape = tuple(int(n) for n in parts["weight_shape"].tolist())
        if (
            zero_point is not None
            and not scheme.symmetric
            and scheme.strategy in ("group", "channel")
        ):
            zp_shape = (*shape[:-1], scale.shape[-1])
            zero_point = unpack_int32(zero_point, scheme.num_bits, zp_shape, dim=0)
        quantized = unpack_int32(parts["weight_packed"], scheme.num_bits, shape)
        return dequantize_args(quantized, scale, zero_point, scheme)
    if scheme.format in ("float-quantized", "naive-quantized", "int-quantized"):
        return dequantize_args(parts["weight"], scale, zero_point, scheme)
    raise SchemeError("unknown compressed-tensors format")


def gpt_oss_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gpt-oss MXFP4 experts (transformers' ``convert_moe_packed_tensors``): 32 e2m1 values per
    block (16 bytes, low nibble first) times ``2**(scale - 127)``, then experts' last two dims
    swapped into the HF parameter's layout."""
    if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or blocks.dim() != 4:
        raise SchemeError(
            f"blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair"
        )
    *prefix, groups, width = blocks.shape
    rows = math.prod(prefix) * groups
    lut = sub_byte_table(FP4_E2M1).to(dtype)
    flat = blocks.reshape(rows, width)
    out = torch.empty(rows, width * 2, dtype=dtype)
    out[:, 0::2] = lut[(flat & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(flat >> 4).to(torch.int)]
    torch.ldexp(out, scales.to(torch.int32).reshape(rows, 1) - 127, out=out)
    out = out.reshape(*prefix, groups, width * 2).view(*prefix, groups * width * 2)
    return out.transpose(1, 2).contiguous()


def logical(
    parts: dict[str, torch.Tensor], scheme: Scheme, dtype: torch.dtype | None
) -> torch.Tensor:
    """The logical value of a grouped weight (``dtype``: cast afterwards, when given)."""
    if scheme.format == MXFP4:
        value = gpt_oss_mxfp4(parts["blocks"], parts["scales"], dtype or torch.bfloat16)
    else:
        value = compressed(parts, scheme)
    return value if dtype is None or value.dtype == dtype else value.to(dtype)
