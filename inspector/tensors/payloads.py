"""How each tensor subclass stores its values: which attribute holds the data, which the
scales, the dequantization rule, and the facts shown for it (no torch, no torchao).

Wrappers (``WeightWithDynamicFloat8CastTensor`` and its Delayed / Static variants, DTensor)
hold a plain high-precision tensor; payloads hold quantized data plus scales:

- ``training``: ``Float8TrainingTensor`` (legacy ``torchao.float8.float8_tensor.Float8Tensor``)
- ``affine``: torchao.quantization ``Float8Tensor``
- ``mx``: ``MXTensor``; ``nvfp4``: ``NVFP4Tensor``; ``nf4``: ``NF4Tensor``
- ``int``: ``Int8Tensor`` and ``IntxUnpackedToInt8Tensor`` (int1-int8 codes in int8, affine)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inspector.errors import UnsupportedError
from inspector.formats.safe_pickle import SubclassRef, TensorRef
from inspector.tensors.scales import granularity, scale_blocks

LEGACY_MODULE = "torchao.float8.float8_tensor"
WRAPPER_ATTRS = {
    "WeightWithDynamicFloat8CastTensor": "_tensor",
    "WeightWithDelayedFloat8CastTensor": "_tensor",
    "WeightWithStaticFloat8CastTensor": "_tensor",
    "DTensor": "_local_tensor",
}
FP4_E2M1 = "fp4_e2m1"
_PACKED_FP4 = "float4_e2m1fn_x2"


def class_name(value: SubclassRef) -> str:
    return value.cls.rsplit(".", 1)[-1]


def name_of(x: Any) -> str:
    """A dtype (torch.dtype, name, or torchao's element-format string) as plain text."""
    return str(x).removeprefix("torch.")


def attr(ref: SubclassRef, name: str) -> Any:
    if name not in ref.attrs:
        raise UnsupportedError(
            f"{ref.cls} has no attribute {name!r} (saved by another torchao version?)"
        )
    return ref.attrs[name]


def is_tensor_like(x: Any) -> bool:
    """A tensor, materialised or described (anything with a dtype and a shape)."""
    return isinstance(x, (TensorRef, SubclassRef)) or (
        hasattr(x, "dtype") and hasattr(x, "shape") and hasattr(x, "stride")
    )


def dtype_of(x: Any) -> str | None:
    return name_of(x.dtype) if is_tensor_like(x) and x.dtype is not None else None


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if is_tensor_like(x) else ()


def format_key(cls: str) -> str | None:
    """Which payload format a class name is, or ``"wrapper"``; None when unknown."""
    module, _, name = cls.rpartition(".")
    if name in WRAPPER_ATTRS and module.split(".")[0] in ("torchao", "torch"):
        return "wrapper"
    if not module.startswith("torchao"):
        return None
    if name == "Float8TrainingTensor" or (name == "Float8Tensor" and module == LEGACY_MODULE):
        return "training"
    return {
        "Float8Tensor": "affine",
        "MXTensor": "mx",
        "NVFP4Tensor": "nvfp4",
        "NF4Tensor": "nf4",
        "Int8Tensor": "int",
        "IntxUnpackedToInt8Tensor": "int",
    }.get(name)


def label(cls: str) -> str:
    """How a class is shown: its name (torchao's), noting legacy module names."""
    if format_key(cls) is None:
        return cls
    name = cls.rpartition(".")[2]
    return f"{name} (legacy {LEGACY_MODULE})" if cls.startswith(LEGACY_MODULE) else name


def unwrap(ref: Any) -> Any:
    """Strip wrapper layers (a DTensor around a payload, ...); at most one per pickled layer,
    and a wrapper that contains itself is refused."""
    seen: set[int] = set()
    while isinstance(ref, SubclassRef) and format_key(ref.cls) == "wrapper":
        if id(ref) in seen:
            raise UnsupportedError(f"{ref.cls} wraps itself")
        seen.add(id(ref))
        ref = attr(ref, WRAPPER_ATTRS[class_name(ref)])
    return ref


def _scale_facts(ref: SubclassRef, data: str, scale: str) -> str:
    shape, scale_shape = shape_of(ref.attrs.get(data)), shape_of(ref.attrs.get(scale))
    blocks = scale_blocks(shape, scale_shape, prefer=None)
    return f"{dtype_of(ref.attrs.get(data))} data + {granularity(shape, blocks)} scale"


def _mx_facts(ref: SubclassRef) -> str:
    elem = name_of(ref.attrs.get("elem_dtype"))
    elem = FP4_E2M1 if elem == _PACKED_FP4 else elem
    text = f"MX {elem} data + e8m0 scale per {ref.attrs.get('block_size')}"
    return text + (" (swizzled)" if ref.attrs.get("is_swizzled_scales") else "")


def _nvfp4_facts(ref: SubclassRef) -> str:
    text = f"NVFP4 fp4_e2m1 data + float8_e4m3fn scale per {ref.attrs.get('block_size')}"
    if is_tensor_like(ref.attrs.get("per_tensor_scale")):
        text += " + per-tensor scale"
    return text + (" (swizzled)" if ref.attrs.get("is_swizzled_scales") else "")


def _nf4_facts(ref: SubclassRef) -> str:
    return (
        f"NF4 data, block {ref.attrs.get('block_size')}, "
        f"int8 scalers per {ref.attrs.get('scaler_block_size')}"
    )


def _int_facts(ref: SubclassRef) -> str:
    shape = ref.shape
    block = tuple(ref.attrs.get("block_size") or ())
    if len(block) == len(shape) == 2 and block[0] == 1 and block[1] < shape[1]:
        layout = f"group {block[1]}"
    else:
        layout = granularity(shape, block if len(block) == len(shape) else None)
    bits = name_of(ref.attrs.get("target_dtype", "int8"))
    text = f"{bits} data + {layout} scale" if bits == "int8" else f"{bits} in int8 + {layout} scale"
    if is_tensor_like(ref.attrs.get("zero_point")):
        text += " + zero point"
    if ref.attrs.get("act_quant_kwargs") is not None or ref.attrs.get("activation_quantization"):
        text += ", dynamic activation quantization"
    return text


@dataclass(frozen=True)
class Payload:
    """How one payload class stores its data and scales, and what is shown about it."""

    data: str
    scales: tuple[str, ...]
    rule: str
    facts: Callable[[SubclassRef], str]


PAYLOADS = {
    "training": Payload(
        "_data",
        ("_scale",),
        "value = data.to(orig_dtype) / scale",
        lambda r: _scale_facts(r, "_data", "_scale"),
    ),
    "affine": Payload(
        "qdata",
        ("scale",),
        "value = data.float() * scale, repeated over its blocks",
        lambda r: _scale_facts(r, "qdata", "scale"),
    ),
    "mx": Payload(
        "qdata",
        ("scale",),
        "value = element * 2**(scale - 127), one e8m0 scale per block along the last dim",
        _mx_facts,
    ),
    "nvfp4": Payload(
        "qdata",
        ("scale", "per_tensor_scale"),
        "value = fp4(data) * scale [* per_tensor_scale], one e4m3 scale per 16 elements",
        _nvfp4_facts,
    ),
    "nf4": Payload(
        "quantized_data",
        ("quantized_scalers", "quantization_factor", "scaler_mean", "nf4"),
        "value = nf4[code] * (quantized_scalers / quantization_factor + scaler_mean)",
        _nf4_facts,
    ),
    "int": Payload(
        "qdata",
        ("scale", "zero_point"),
        "value = (data - zero_point) * scale, one scale per block of block_size",
        _int_facts,
    ),
}
