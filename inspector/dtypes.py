"""Dtypes by name: one vocabulary for every format and record, without importing torch.

A name is torch's spelling without ``torch.`` (``float32``, ``bfloat16``,
``float8_e4m3fn``). Records carry names, so opening and listing a checkpoint never loads
torch; :func:`to_torch` loads it when a tensor is materialised. Every public function that
takes a dtype accepts a ``torch.dtype`` or its name (:func:`name_of`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from inspector.errors import InspectorError, UsageError

if TYPE_CHECKING:
    import torch

# name -> (bytes per element, kind); sub-byte and packed dtypes count whole bytes, as torch does.
_TABLE: dict[str, tuple[int, str]] = {
    "float64": (8, "float"),
    "float32": (4, "float"),
    "float16": (2, "float"),
    "bfloat16": (2, "float"),
    "float8_e4m3fn": (1, "float8"),
    "float8_e5m2": (1, "float8"),
    "float8_e4m3fnuz": (1, "float8"),
    "float8_e5m2fnuz": (1, "float8"),
    "float8_e8m0fnu": (1, "scale8"),
    "float4_e2m1fn_x2": (1, "packed"),
    "complex128": (16, "complex"),
    "complex64": (8, "complex"),
    "complex32": (4, "complex"),
    "int64": (8, "int"),
    "int32": (4, "int"),
    "int16": (2, "int"),
    "int8": (1, "int"),
    "uint64": (8, "int"),
    "uint32": (4, "int"),
    "uint16": (2, "int"),
    "uint8": (1, "int"),
    "bool": (1, "bool"),
    **{f"int{n}": (1, "sub-byte") for n in range(1, 8)},
    **{f"uint{n}": (1, "sub-byte") for n in range(1, 8)},
    "qint32": (4, "quantized"),
    "qint8": (1, "quantized"),
    "quint8": (1, "quantized"),
    "quint4x2": (1, "quantized"),
    "quint2x4": (1, "quantized"),
    "bits16": (2, "bits"),
    "bits8": (1, "bits"),
    "bits1x8": (1, "bits"),
    "bits2x4": (1, "bits"),
    "bits4x2": (1, "bits"),
}
# torch's other spellings of the same dtypes (``torch.float`` is ``torch.float32``).
ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "cfloat": "complex64",
    "cdouble": "complex128",
    "chalf": "complex32",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "bit": "uint1",
}
# The short names people type (``--dtype bf16``), in any case.
SHORT_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}
NAMES = tuple(_TABLE)
FLOAT8 = frozenset(n for n, (_, kind) in _TABLE.items() if kind == "float8")
# Floating dtypes a high-precision value can be cast to (float8 and packed ones are payloads).
HIGH_PRECISION = frozenset({"float64", "float32", "float16", "bfloat16"})


def is_known(name: Any) -> bool:
    return isinstance(name, str) and name in _TABLE


def name_of(dtype: Any) -> str:
    """The canonical name of a ``torch.dtype`` or of a name (torch's aliases such as
    ``"float"``, a ``"torch."`` prefix and the short names ``bf16``, ``fp16``, ``fp32``,
    ``fp64`` are accepted). A bad name is an InspectorError that lists the valid ones."""
    text = str(dtype).removeprefix("torch.") if _is_torch_dtype(dtype) else dtype
    if isinstance(text, str):
        text = text.removeprefix("torch.")
        text = ALIASES.get(text, SHORT_NAMES.get(text.lower(), text))
        if text in _TABLE:
            return text
    raise UsageError(
        f"unknown dtype {dtype!r}; use a torch.dtype, one of {', '.join(SHORT_NAMES)} or one "
        f"of: {', '.join(NAMES[:22])}, ..."
    )


def optional_name(dtype: Any) -> str | None:
    """:func:`name_of`, passing None through (an unset dtype option)."""
    return None if dtype is None else name_of(dtype)


def itemsize(name: str) -> int:
    """Bytes per element (1 for packed and sub-byte dtypes, as torch counts them)."""
    return _TABLE[name][0]


def is_floating(name: str) -> bool:
    return _TABLE[name][1] in ("float", "float8", "scale8", "packed")


def is_real(name: str) -> bool:
    """Plain real numbers torch converts to float64: floats, float8, ints, bool."""
    return name in _TABLE and _TABLE[name][1] in ("float", "float8", "scale8", "int", "bool")


def is_complex(name: str) -> bool:
    return _TABLE[name][1] == "complex"


def to_torch(name: str) -> torch.dtype:
    """The ``torch.dtype`` of a name (imports torch)."""
    import torch

    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise InspectorError(f"this torch ({torch.__version__}) has no dtype {name!r}")
    return value


def _is_torch_dtype(value: Any) -> bool:
    return type(value).__name__ == "dtype" and type(value).__module__ == "torch"
