"""Plain tensors from what chunks hold: wrappers unwrapped, payloads dequantized the way
their producer does (bit-identical to torchao 0.18, without importing it), plain float8
scaled by a sibling's block scales (see :mod:`.payloads` and :mod:`.scales`)."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from inspector import dtypes
from inspector.errors import CorruptCheckpointError, UnsupportedError
from inspector.formats.safe_pickle import SubclassRef
from inspector.tensors import broadcast, dequant
from inspector.tensors.payloads import attr, class_name, format_key, unwrap
from inspector.tensors.scales import scale_blocks


def _torch_dtype(value: Any) -> torch.dtype:
    return value if isinstance(value, torch.dtype) else dtypes.to_torch(dtypes.name_of(value))


def _training(ref: SubclassRef, dtype: torch.dtype) -> torch.Tensor:
    orig = ref.attrs.get("_orig_dtype", ref.dtype)
    return dequant.float8_training(attr(ref, "_data"), attr(ref, "_scale"), _torch_dtype(orig))


def _affine(ref: SubclassRef, dtype: torch.dtype) -> torch.Tensor:
    return dequant.affine_float8(attr(ref, "qdata"), attr(ref, "scale"), dtype)


def _mx(ref: SubclassRef, dtype: torch.dtype) -> torch.Tensor:
    return dequant.mx(
        attr(ref, "qdata"),
        attr(ref, "scale"),
        attr(ref, "elem_dtype"),
        attr(ref, "block_size"),
        ref.shape,
        bool(ref.attrs.get("is_swizzled_scales")),
        dtype,
    )


def _nvfp4(ref: SubclassRef, dtype: torch.dtype) -> torch.Tensor:
    return dequant.nvfp4(
        attr(ref, "qdata"),
        attr(ref, "scale"),
        ref.attrs.get("per_tensor_scale"),
        attr(ref, "block_size"),
        ref.shape,
        bool(ref.attrs.get("is_swizzled_scales")),
        dtype,
    )


def _nf4(ref: SubclassRef, dtype: torch.dtype) -> torch.Tensor:
    return dequant.nf4(
        attr(ref, "quantized_data"),
        attr(ref, "quantized_scalers"),
        attr(ref, "quantization_factor"),
        attr(ref, "scaler_mean"),
        attr(ref, "nf4"),
        attr(ref, "block_size"),
        attr(ref, "scaler_block_size"),
        ref.shape,
        _torch_dtype(ref.dtype),
    )


def _int(ref: SubclassRef, dtype: torch.dtype) -> torch.Tensor:
    """``Int8Tensor.dequantize(dtype)`` computes in ``dtype``; ``IntxUnpackedToInt8Tensor``
    takes no dtype: it computes in its own and is cast afterwards."""
    own = dtype if class_name(ref) == "Int8Tensor" else _torch_dtype(ref.dtype)
    zero_point = ref.attrs.get("zero_point")
    return dequant.affine_int(
        attr(ref, "qdata"),
        attr(ref, "scale"),
        zero_point if isinstance(zero_point, torch.Tensor) else None,
        tuple(attr(ref, "block_size")),
        own,
    )


CONVERTERS = {
    "training": _training,
    "affine": _affine,
    "mx": _mx,
    "nvfp4": _nvfp4,
    "nf4": _nf4,
    "int": _int,
}


def dequantize(
    value: torch.Tensor | SubclassRef,
    scale: torch.Tensor | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    blocks: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """A plain tensor for ``value``, in ``dtype`` (default: its logical dtype).

    ``value`` is a materialised subclass description (wrappers give their master weight,
    payloads are dequantized the way torchao does) or a plain tensor; a float8 tensor with
    ``scale`` is dequantized per block (``blocks`` inferred from the shapes, 128 preferred;
    ``dtype`` defaults to bfloat16 there, as plain float8 records no logical dtype).
    """
    target = None if dtype is None else _torch_dtype(dtype)
    if isinstance(value, SubclassRef):
        inner = unwrap(value)
        if isinstance(inner, torch.Tensor):
            if class_name(value) != "DTensor":  # a DTensor holds its local shard only
                _check_shape(inner, value.shape)
            return _cast(inner, target)
        key = format_key(inner.cls)
        if key is None:
            if isinstance(inner.data, torch.Tensor):
                return _cast(inner.data, target)
            raise UnsupportedError(f"cannot convert tensor subclass {inner.cls} to a plain tensor")
        _refuse_repeated(inner.cls, *inner.attrs.values())
        goal = target or _torch_dtype(inner.dtype)
        result = CONVERTERS[key](inner, goal)
        return result if result.dtype == goal else result.to(goal)
    if scale is None:
        return _cast(value, target)
    _refuse_repeated("a float8 tensor with scales", value)
    if scale.dtype == torch.uint8:
        scale = dequant.e8m0_to_float32(scale)
    blocks = blocks or scale_blocks(tuple(value.shape), tuple(scale.shape))
    if blocks is None:
        raise UnsupportedError(
            f"scale of shape {list(scale.shape)} does not fit a tensor of {list(value.shape)}"
        )
    if scale.dim() != value.dim():
        scale = scale.reshape([math.ceil(n / b) for n, b in zip(value.shape, blocks, strict=True)])
    return dequant.block_float8(value, scale, blocks, target or torch.bfloat16)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor if dtype is None else broadcast.cast(tensor, dtype)


def _refuse_repeated(what: str, *parts: Any) -> None:
    """Quantized data that repeats stored values (stride 0) would be dequantized into a
    dense tensor of its full size: never what a quantizer saves, so refused."""
    if any(isinstance(p, torch.Tensor) and broadcast.repeated_dims(p) for p in parts):
        raise UnsupportedError(f"{what} stores repeated values (a stride-0 view): not supported")


def _check_shape(inner: torch.Tensor, outer: tuple[int, ...]) -> None:
    """A wrapper's master weight must have the wrapper's shape."""
    if tuple(inner.shape) != tuple(outer):
        raise ValueError(f"wrapped tensor has shape {list(inner.shape)}, wrapper {list(outer)}")


def to_plain(
    value: torch.Tensor | SubclassRef,
    dtype: torch.dtype | str | None = None,
    *,
    file: str | os.PathLike | None = None,
    key: str | None = None,
) -> torch.Tensor:
    """A plain tensor holding what a chunk value represents: plain tensors as they are,
    subclasses through ``dequantize`` (errors name ``file`` and ``key``)."""
    if isinstance(value, torch.Tensor):
        return value
    try:
        return dequantize(value, dtype=dtype)
    except UnsupportedError as exc:
        raise UnsupportedError(exc.reason, file=file, key=key) from None
    except (ValueError, RuntimeError, IndexError, TypeError) as exc:
        raise CorruptCheckpointError(
            f"{value.cls} payload is inconsistent ({exc})", file=file, key=key
        ) from exc
