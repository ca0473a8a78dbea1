"""Tensor subclasses and FP8: recognise them without running anything, make plain tensors.

Detection. A DCP chunk is a torch.save archive; the classes it pickles are read from the
opcodes of its small ``data.pkl`` record (``source.chunk_globals``). Only chunks naming a
class outside torch are decoded (``source.describe_chunk``: safe_pickle, tensor bytes are
not read) to learn the facts shown in ``Entry.subclass`` / ``Entry.fp8``. Plain float8
entries are paired with their scale siblings from key names, dtypes and shapes alone
(``mark_scaled_pairs``), in every format.

Conversion. ``to_plain`` (used by ``Checkpoint.read``) and ``dequantize`` follow each
producer's convention with plain torch ops, bit-identical to torchao 0.18:

- ``WeightWithDynamicFloat8CastTensor`` (and the Delayed / Static variants, DTensor): the
  high-precision master weight ``_tensor`` as stored; nothing is quantized.
- ``Float8TrainingTensor`` (legacy name ``torchao.float8.float8_tensor.Float8Tensor``):
  ``_data.to(orig_dtype) / _scale``; ``_scale`` is a scalar, per-row or per-column.
- ``Float8Tensor`` (torchao.quantization): ``(qdata.float() * scale).to(dtype)``, ``scale``
  per tensor, per row or per block (repeated over its block).
- ``MXTensor``: ``element * 2**(scale - 127)``, one E8M0 scale per ``block_size`` (32)
  elements along the last dimension; elements float8, fp6 or packed fp4 (low nibble first).
- ``NVFP4Tensor``: ``fp4(qdata) * float(scale) [* per_tensor_scale]``, one E4M3 scale per 16.
- ``NF4Tensor``: 4-bit codes looked up in its ``nf4`` table times double-quantized scalers.
- Plain float8 + scale sibling (DeepSeek-V3 / HF ``weight_scale_inv`` 128x128 blocks, edge
  blocks partial; ``*_scale`` / ``*.scale`` per tensor or per row; torchao-flattened
  ``_qdata`` + ``_scale``): ``(weight.float() * scale repeated per block).to(dtype)``.

Export plans (``plan``) take one of ``FP8_MODES``:

- ``"dequantize"``: payloads (subclass and plain float8 + scale) -> ``dtype`` (default
  bfloat16), their scale entries consumed; wrappers -> master weight as stored; plain
  float8 without a scale -> upcast to ``dtype``.
- ``"unwrap"``: wrappers -> master weight; subclass payloads -> their logical (outer) dtype;
  plain float8 and scale entries left as stored.
- ``"keep"``: wrappers -> master weight; subclass payloads split into the raw data under
  the key and each scale under ``<key>_<name>`` (torchao's inner tensor names without the
  leading underscore: ``_scale``; NVFP4 adds ``_per_tensor_scale``; NF4 writes
  ``_quantized_scalers``, ``_quantization_factor``, ``_scaler_mean``, ``_nf4``), with the
  rule above in each output's ``conversion``. Note the two float8 conventions:
  Float8TrainingTensor divides by its scale, every other payload multiplies. Sharded
  payloads are reassembled when every chunk has the same scale granularity (a per-tensor
  scale per row shard becomes a block scale); plain float8 and scales stay as stored.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from inspector.entry import ChunkInfo, Entry
from inspector.errors import CorruptCheckpointError, InspectorError, UnsupportedError
from inspector.formats.safe_pickle import Opaque, SubclassRef, TensorRef
from inspector.tensors import dequant

if TYPE_CHECKING:
    from inspector.checkpoint import Checkpoint
    from inspector.formats.base import Source

FP8_MODES = ("dequantize", "unwrap", "keep")
FLOAT8_DTYPES = frozenset(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)
DEFAULT_BLOCK = 128
# Pickle globals that any plain tensor chunk may name; everything else is a foreign class.
_PLAIN_ROOTS = frozenset(["torch", "collections", "builtins", "__builtin__", "_codecs", "copyreg"])
_LEGACY_MODULE = "torchao.float8.float8_tensor"
_WRAPPER_ATTRS = {
    "WeightWithDynamicFloat8CastTensor": "_tensor",
    "WeightWithDelayedFloat8CastTensor": "_tensor",
    "WeightWithStaticFloat8CastTensor": "_tensor",
    "DTensor": "_local_tensor",
}


# --- what a class is ------------------------------------------------------------------------


def class_name(value: SubclassRef) -> str:
    return value.cls.rsplit(".", 1)[-1]


def _name_of(x: Any) -> str:
    return str(x).removeprefix("torch.")


def _attr(ref: SubclassRef, name: str) -> Any:
    if name not in ref.attrs:
        raise UnsupportedError(
            f"{ref.cls} has no attribute {name!r} (saved by another torchao version?)"
        )
    return ref.attrs[name]


def _dtype_of(x: Any) -> torch.dtype | None:
    return x.dtype if isinstance(x, (torch.Tensor, TensorRef, SubclassRef)) else None


def _shape_of(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if isinstance(x, (torch.Tensor, TensorRef, SubclassRef)) else ()


def scale_blocks(
    shape: tuple[int, ...], scale_shape: tuple[int, ...], prefer: int | None = DEFAULT_BLOCK
) -> tuple[int, ...] | None:
    """Block size per dimension of ``shape`` that a scale of ``scale_shape`` implies, or None.

    One scale value covers the whole tensor; a 1-D scale of ``shape[0]`` values is per row.
    Otherwise each dimension holds ``ceil(size / block)`` scales; ``prefer`` (128, the
    DeepSeek-V3 / Hugging Face block) wins where it fits, since partial edge blocks make the
    block size ambiguous from shapes alone.
    """
    if math.prod(scale_shape) == 1:
        return tuple(shape)
    if len(scale_shape) == 1 and len(shape) == 2 and scale_shape[0] == shape[0]:
        return (1, shape[1])
    if len(scale_shape) != len(shape):
        return None
    blocks = []
    for size, count in zip(shape, scale_shape, strict=True):
        if count == 0 or count > size:
            return None
        if count == size:
            blocks.append(1)
        elif count == 1:
            blocks.append(size)
        elif prefer and math.ceil(size / prefer) == count:
            blocks.append(prefer)
        elif math.ceil(size / math.ceil(size / count)) == count:
            blocks.append(math.ceil(size / count))
        else:
            return None
    return tuple(blocks)


def granularity(shape: tuple[int, ...], blocks: tuple[int, ...] | None) -> str:
    """``per-tensor``, ``per-row``, ``per-column`` or ``block AxB`` for a scale layout."""
    if blocks is None:
        return "unmatched"
    if tuple(blocks) == tuple(shape):
        return "per-tensor"
    if len(shape) == 2 and blocks == (1, shape[1]):
        return "per-row"
    if len(shape) == 2 and blocks == (shape[0], 1):
        return "per-column"
    inner = list(blocks)
    while len(inner) > 2 and inner[0] == 1:
        inner.pop(0)
    return "block " + "x".join(map(str, inner))


# --- payload formats (torchao subclasses that hold quantized data) ----------------------------


def _training(ref: SubclassRef, dtype: torch.dtype) -> torch.Tensor:
    orig = ref.attrs.get("_orig_dtype", ref.dtype)
    return dequant.float8_training(_attr(ref, "_data"), _attr(ref, "_scale"), orig)


def _affine(ref: SubclassRef, dtype: torch.dtype) -> torch.Tensor:
    return dequant.affine_float8(_attr(ref, "qdata"), _attr(ref, "scale"), dtype)


def _mx(ref: SubclassRef, dtype: torch.dtype) -> torch.Tensor:
    return dequant.mx(
        _attr(ref, "qdata"),
        _attr(ref, "scale"),
        _attr(ref, "elem_dtype"),
        _attr(ref, "block_size"),
        ref.shape,
        bool(ref.attrs.get("is_swizzled_scales")),
        dtype,
    )


def _nvfp4(ref: SubclassRef, dtype: torch.dtype) -> torch.Tensor:
    return dequant.nvfp4(
        _attr(ref, "qdata"),
        _attr(ref, "scale"),
        ref.attrs.get("per_tensor_scale"),
        _attr(ref, "block_size"),
        ref.shape,
        bool(ref.attrs.get("is_swizzled_scales")),
        dtype,
    )


def _nf4(ref: SubclassRef, dtype: torch.dtype) -> torch.Tensor:
    return dequant.nf4(
        _attr(ref, "quantized_data"),
        _attr(ref, "quantized_scalers"),
        _attr(ref, "quantization_factor"),
        _attr(ref, "scaler_mean"),
        _attr(ref, "nf4"),
        _attr(ref, "block_size"),
        _attr(ref, "scaler_block_size"),
        ref.shape,
        ref.dtype,
    )


def _scale_facts(ref: SubclassRef, data: str, scale: str) -> str:
    shape, scale_shape = _shape_of(ref.attrs.get(data)), _shape_of(ref.attrs.get(scale))
    blocks = scale_blocks(shape, scale_shape, prefer=None)
    return f"{_name_of(_dtype_of(ref.attrs.get(data)))} data + {granularity(shape, blocks)} scale"


def _mx_facts(ref: SubclassRef) -> str:
    elem = ref.attrs.get("elem_dtype")
    elem = dequant.FP4_E2M1 if elem == getattr(torch, "float4_e2m1fn_x2", None) else elem
    text = f"MX {_name_of(elem)} data + e8m0 scale per {ref.attrs.get('block_size')}"
    return text + (" (swizzled)" if ref.attrs.get("is_swizzled_scales") else "")


def _nvfp4_facts(ref: SubclassRef) -> str:
    text = f"NVFP4 fp4_e2m1 data + float8_e4m3fn scale per {ref.attrs.get('block_size')}"
    if isinstance(ref.attrs.get("per_tensor_scale"), (torch.Tensor, TensorRef)):
        text += " + per-tensor scale"
    return text + (" (swizzled)" if ref.attrs.get("is_swizzled_scales") else "")


def _nf4_facts(ref: SubclassRef) -> str:
    return (
        f"NF4 data, block {ref.attrs.get('block_size')}, "
        f"int8 scalers per {ref.attrs.get('scaler_block_size')}"
    )


@dataclass(frozen=True)
class _Format:
    """How one payload class stores its data and scales, and how to dequantize it."""

    data: str
    scales: tuple[str, ...]
    rule: str
    convert: Callable[[SubclassRef, torch.dtype], torch.Tensor]
    facts: Callable[[SubclassRef], str]


_FORMATS = {
    "training": _Format(
        "_data",
        ("_scale",),
        "value = data.to(orig_dtype) / scale",
        _training,
        lambda r: _scale_facts(r, "_data", "_scale"),
    ),
    "affine": _Format(
        "qdata",
        ("scale",),
        "value = data.float() * scale, repeated over its blocks",
        _affine,
        lambda r: _scale_facts(r, "qdata", "scale"),
    ),
    "mx": _Format(
        "qdata",
        ("scale",),
        "value = element * 2**(scale - 127), one e8m0 scale per block along the last dim",
        _mx,
        _mx_facts,
    ),
    "nvfp4": _Format(
        "qdata",
        ("scale", "per_tensor_scale"),
        "value = fp4(data) * scale [* per_tensor_scale], one e4m3 scale per 16 elements",
        _nvfp4,
        _nvfp4_facts,
    ),
    "nf4": _Format(
        "quantized_data",
        ("quantized_scalers", "quantization_factor", "scaler_mean", "nf4"),
        "value = nf4[code] * (quantized_scalers / quantization_factor + scaler_mean)",
        _nf4,
        _nf4_facts,
    ),
}


def _format_key(cls: str) -> str | None:
    """Which payload format a class name is, or ``"wrapper"``; None when unknown."""
    module, _, name = cls.rpartition(".")
    if name in _WRAPPER_ATTRS and module.split(".")[0] in ("torchao", "torch"):
        return "wrapper"
    if not module.startswith("torchao"):
        return None
    if name == "Float8TrainingTensor" or (name == "Float8Tensor" and module == _LEGACY_MODULE):
        return "training"
    return {
        "Float8Tensor": "affine",
        "MXTensor": "mx",
        "NVFP4Tensor": "nvfp4",
        "NF4Tensor": "nf4",
    }.get(name)


def _label(cls: str) -> str:
    key = _format_key(cls)
    if key is None:
        return cls
    name = cls.rpartition(".")[2]
    return f"{name} (legacy {_LEGACY_MODULE})" if cls.startswith(_LEGACY_MODULE) else name


# --- detection ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Detection:
    """What a tensor entry's chunks hold, found from their pickles without reading tensor data.

    ``kind``: ``plain``, ``wrapper`` (a high-precision tensor wrapped for FP8 training),
    ``payload`` (quantized data + scales, in format ``payload``: training, affine, mx, nvfp4
    or nf4), ``unknown`` (a subclass we cannot convert unless it carries its own storage) or
    ``unreadable`` (``error`` says why). ``classes`` are the foreign globals its pickles name;
    ``parts`` the payload's scale tensors (what ``"keep"`` writes next to the data).
    """

    kind: str
    subclass: str | None = None
    fp8: str | None = None
    classes: tuple[str, ...] = ()
    payload: str | None = None
    parts: tuple[str, ...] = ()
    error: str | None = None


def foreign_classes(names: Iterable[str]) -> list[str]:
    """The pickle globals that a plain tensor chunk would not name (subclasses, their configs)."""
    return [
        n
        for n in dict.fromkeys(names)
        if n.split(".")[0] not in _PLAIN_ROOTS or n.startswith("torch.distributed.")
    ]


def describe(value: Any, classes: Iterable[str] = ()) -> Detection:
    """Detection for one decoded chunk (TensorRef / SubclassRef, materialised or not)."""
    classes = tuple(classes)
    if isinstance(value, Opaque):
        return Detection("unknown", value.global_name, "not a tensor pickle", classes)
    if not isinstance(value, SubclassRef):
        return Detection("plain")
    labels, ref = [], value
    while isinstance(ref, SubclassRef) and _format_key(ref.cls) == "wrapper":
        labels.append(_label(ref.cls))
        inner = ref.attrs.get(_WRAPPER_ATTRS[class_name(ref)])
        if not isinstance(inner, SubclassRef):
            return Detection("wrapper", " > ".join(labels), _wrapper_facts(ref, classes), classes)
        ref = inner
    labels.append(_label(ref.cls))
    key = _format_key(ref.cls)
    if key is None:
        facts = "own storage" if ref.data is not None else None
        return Detection("unknown", " > ".join(labels), facts, classes)
    fmt = _FORMATS[key]
    parts = tuple(p for p in fmt.scales if isinstance(ref.attrs.get(p), (torch.Tensor, TensorRef)))
    return Detection("payload", " > ".join(labels), fmt.facts(ref), classes, key, parts)


def _wrapper_facts(ref: SubclassRef, classes: tuple[str, ...]) -> str:
    if class_name(ref) == "DTensor":
        return "local shard"
    target = ref.attrs.get("_dtype")
    text = f"wrapper -> {_name_of(target)}" if isinstance(target, torch.dtype) else "wrapper"
    if isinstance(ref.attrs.get("_precomputed_scale"), (torch.Tensor, TensorRef)):
        text += ", precomputed scale"
    if any(c.startswith(_LEGACY_MODULE + ".") for c in classes):
        text += ", legacy torchao names"
    return text


def detect(source: Source, entry: Entry) -> Detection:
    """Scan every chunk's pickle opcodes; decode the first naming a foreign class for facts."""
    if entry.kind != "tensor":
        return Detection("plain")
    if entry.error:
        return Detection("unreadable", error=entry.error)
    try:
        found = [foreign_classes(source.chunk_globals(entry, i)) for i in range(len(entry.chunks))]
        classes = tuple(dict.fromkeys(c for names in found for c in names))
        if not classes:
            return Detection("plain")
        first = next(i for i, names in enumerate(found) if names)
        return describe(source.describe_chunk(entry, first), classes)
    except InspectorError as exc:
        return Detection("unreadable", error=exc.located)
    except OSError as exc:
        return Detection("unreadable", error=f"cannot read {exc.filename} ({exc.strerror})")


def annotate(entry: Entry, found: Detection) -> None:
    """Record a detection in the entry's display fields."""
    if found.subclass:
        entry.subclass, entry.fp8 = found.subclass, found.fp8
    if found.error and not entry.error:
        entry.error = found.error


# --- plain float8 entries paired with scale siblings ------------------------------------------


@dataclass(frozen=True)
class ScalePair:
    """A plain float8 entry and the entry holding its (multiplicative) scales."""

    weight: str
    scale: str
    blocks: tuple[int, ...]
    granularity: str


def _scale_candidates(key: str) -> list[str]:
    names = [key + "_scale_inv", key + "_scale", key + ".scale"]
    if key.endswith("_qdata"):
        names.append(key.removesuffix("_qdata") + "_scale")
    return names


def scaled_pairs(entries: Iterable[Entry]) -> dict[str, ScalePair]:
    """Plain float8 tensors whose scale sibling exists and fits their shape, by weight key."""
    by_key = {e.key: e for e in entries}
    pairs = {}
    for weight in by_key.values():
        if weight.kind != "tensor" or weight.dtype not in FLOAT8_DTYPES or not weight.shape:
            continue
        for name in _scale_candidates(weight.key):
            scale = by_key.get(name)
            if scale is None or scale.kind != "tensor" or scale.shape is None:
                continue
            blocks = scale_blocks(weight.shape, scale.shape)
            if blocks is not None:
                pairs[weight.key] = ScalePair(
                    weight.key, name, blocks, granularity(weight.shape, blocks)
                )
                break
    return pairs


def mark_scaled_pairs(entries: list[Entry]) -> None:
    """Fill ``fp8`` of plain float8 entries and of the scale entries paired with them."""
    pairs = scaled_pairs(entries)
    by_key = {e.key: e for e in entries}
    for pair in pairs.values():
        parent = pair.weight.rpartition(".")[0]
        suffix = pair.scale[len(parent) + 1 :] if parent else pair.scale
        by_key[pair.weight].fp8 = by_key[pair.weight].fp8 or f"{pair.granularity} {suffix}"
        by_key[pair.scale].fp8 = by_key[pair.scale].fp8 or f"scale of {pair.weight}"
    for e in entries:
        if e.kind == "tensor" and e.dtype in FLOAT8_DTYPES and e.key not in pairs and not e.fp8:
            e.fp8 = "no scale found"


# --- conversion ---------------------------------------------------------------------------


def _payload_of(ref: SubclassRef) -> SubclassRef | torch.Tensor:
    """Strip wrapper layers (DTensor around a payload, ...)."""
    while isinstance(ref, SubclassRef) and _format_key(ref.cls) == "wrapper":
        ref = _attr(ref, _WRAPPER_ATTRS[class_name(ref)])
    return ref


def dequantize(
    value: torch.Tensor | SubclassRef,
    scale: torch.Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
    blocks: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """A plain tensor for ``value``, in ``dtype`` (default: its logical dtype).

    ``value`` is a materialised subclass description (wrappers give their master weight,
    payloads are dequantized the way torchao does) or a plain tensor; a float8 tensor with
    ``scale`` is dequantized per block (``blocks`` inferred from the shapes, 128 preferred;
    ``dtype`` defaults to bfloat16 there, as plain float8 records no logical dtype).
    """
    if isinstance(value, SubclassRef):
        inner = _payload_of(value)
        if isinstance(inner, torch.Tensor):
            return inner if dtype is None else inner.to(dtype)
        key = _format_key(inner.cls)
        if key is None:
            if isinstance(inner.data, torch.Tensor):
                return inner.data if dtype is None else inner.data.to(dtype)
            raise UnsupportedError(f"cannot convert tensor subclass {inner.cls} to a plain tensor")
        target = dtype or inner.dtype
        value = _FORMATS[key].convert(inner, target)
        return value if value.dtype == target else value.to(target)
    if scale is None:
        return value if dtype is None else value.to(dtype)
    if scale.dtype == torch.uint8:
        scale = dequant.e8m0_to_float32(scale)
    blocks = blocks or scale_blocks(tuple(value.shape), tuple(scale.shape))
    if blocks is None:
        raise UnsupportedError(
            f"scale of shape {list(scale.shape)} does not fit a tensor of {list(value.shape)}"
        )
    if scale.dim() != value.dim():
        scale = scale.reshape([math.ceil(n / b) for n, b in zip(value.shape, blocks, strict=True)])
    return dequant.block_float8(value, scale, blocks, dtype or torch.bfloat16)


def to_plain(
    value: torch.Tensor | SubclassRef,
    dtype: torch.dtype | None = None,
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


# --- export plans -------------------------------------------------------------------------


@dataclass(frozen=True)
class Output:
    """One tensor an export writes: its name, the entries it is made from, how it is made."""

    name: str
    sources: tuple[str, ...]
    conversion: str | None
    reader: Callable[[], torch.Tensor] = field(repr=False, compare=False)
    dtype: torch.dtype | None = None  # what read() returns, when known without reading
    shape: tuple[int, ...] | None = None
    raw: bool = False  # stored FP8 bytes or scales: an export must not cast them

    def read(self) -> torch.Tensor:
        """Materialise it now (reads only its source entries)."""
        return self.reader()


def plan(
    ck: Checkpoint,
    keys: Iterable[str],
    mode: str = "dequantize",
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[list[Output], dict[str, str]]:
    """What to write for ``keys`` under ``mode`` (see the module docstring).

    Returns the outputs in key order and, for keys that produce no output of their own,
    the reason (a scale consumed by its weight, a non-tensor entry).
    """
    if mode not in FP8_MODES:
        raise ValueError(f"fp8 mode {mode!r} is not one of {', '.join(FP8_MODES)}")
    keys = list(keys)
    wanted = set(keys)
    pairs = scaled_pairs(ck.entries()) if mode == "dequantize" else {}
    consumed = {p.scale: p.weight for p in pairs.values() if p.weight in wanted}
    outputs: list[Output] = []
    skipped: dict[str, str] = {}
    for key in keys:
        entry = ck.entry(key)
        if entry.kind != "tensor":
            skipped[key] = "not a tensor"
        elif key in consumed:
            skipped[key] = f"scale of {consumed[key]}, applied to it"
        else:
            outputs.extend(_outputs(ck, entry, ck.inspect_subclass(key), mode, dtype, pairs))
    return outputs, skipped


def _outputs(
    ck: Checkpoint,
    entry: Entry,
    found: Detection,
    mode: str,
    dtype: torch.dtype,
    pairs: dict[str, ScalePair],
) -> list[Output]:
    key, read = entry.key, functools.partial(ck.read, entry.key)
    shape = entry.shape
    if found.kind == "wrapper":
        text = f"unwrap {found.subclass} -> {entry.dtype_name} master weight"
        return [Output(key, (key,), text, read, entry.dtype, shape)]
    if found.kind == "unknown":
        text = f"values of tensor subclass {found.subclass}"
        return [Output(key, (key,), text, read, entry.dtype, shape)]
    if found.kind == "payload" and mode == "keep":
        return _split(ck, entry, found)
    if found.kind == "payload":
        target = dtype if mode == "dequantize" else entry.dtype
        text = f"{found.subclass} ({found.fp8}) -> {_name_of(target)}"
        return [Output(key, (key,), text, functools.partial(ck.read, key, target), target, shape)]
    if key in pairs:
        pair = pairs[key]
        text = f"{entry.dtype_name} {pair.granularity} -> {_name_of(dtype)}"
        reader = functools.partial(_read_scaled, ck, pair, dtype)
        return [Output(key, (key, pair.scale), text, reader, dtype, shape)]
    if mode == "dequantize" and entry.dtype in FLOAT8_DTYPES:
        text = f"{entry.dtype_name} -> {_name_of(dtype)} (no scale found)"
        return [Output(key, (key,), text, functools.partial(ck.read, key, dtype), dtype, shape)]
    raw = entry.dtype in FLOAT8_DTYPES or (entry.fp8 or "").startswith("scale of")
    return [Output(key, (key,), None, read, entry.dtype, shape, raw)]


def _read_scaled(ck: Checkpoint, pair: ScalePair, dtype: torch.dtype) -> torch.Tensor:
    weight, scale = ck.read(pair.weight), ck.read(pair.scale)
    try:
        return dequantize(weight, scale, dtype=dtype, blocks=pair.blocks)
    except (UnsupportedError, ValueError, RuntimeError) as exc:
        raise UnsupportedError(
            f"cannot apply scale {pair.scale} ({exc})", file=ck.path, key=pair.weight
        ) from exc


def _split(ck: Checkpoint, entry: Entry, found: Detection) -> list[Output]:
    key = entry.key
    split = _SplitPayload(ck, entry, found)
    rule = f"{found.subclass}: {_FORMATS[found.payload].rule}"
    outputs = [
        Output(key, (key,), f"raw data of {rule}", functools.partial(split.part, None), raw=True)
    ]
    for part in found.parts:
        name = f"{key}_{part.lstrip('_')}"
        reader = functools.partial(split.part, part)
        outputs.append(Output(name, (key,), f"{part} of {rule}", reader, raw=True))
    return outputs


class _SplitPayload:
    """Reads a payload entry's chunks once and hands out its data and scales ("keep" mode).

    Scales read along with the data are kept (they are small) until asked for.
    """

    def __init__(self, ck: Checkpoint, entry: Entry, found: Detection) -> None:
        self.ck, self.entry = ck, entry
        self.payload, self.parts = found.payload, found.parts
        self._kept: dict[str, torch.Tensor] = {}

    def part(self, name: str | None) -> torch.Tensor:
        if name in self._kept:
            return self._kept.pop(name)
        if self.entry.error:
            raise CorruptCheckpointError(self.entry.error, file=self.ck.path, key=self.entry.key)
        fmt = _FORMATS[self.payload]
        pieces: dict[str | None, list[tuple[ChunkInfo, torch.Tensor]]] = {
            part: [] for part in (None, *self.parts)
        }
        for index, chunk in enumerate(self.entry.chunks):
            payload = _payload_of(self.ck.source.read_chunk(self.entry, index))
            if not isinstance(payload, SubclassRef) or _format_key(payload.cls) != self.payload:
                raise self._refuse(f"chunk {index} does not hold a {self.payload} payload")
            if len(self.entry.chunks) > 1 and payload.attrs.get("is_swizzled_scales"):
                raise self._refuse("sharded payload with swizzled scales cannot be kept as is")
            for part, items in pieces.items():
                tensor = payload.attrs.get(fmt.data if part is None else part)
                if not isinstance(tensor, torch.Tensor):
                    raise self._refuse(f"chunk {index} lacks its {part or fmt.data}")
                items.append((chunk, tensor))
        whole = {part: self._assemble(part, items) for part, items in pieces.items()}
        self._kept = {p: t for p, t in whole.items() if p is not None and p != name}
        return whole[name]

    def _refuse(self, why: str) -> UnsupportedError:
        return UnsupportedError(
            f"{why}; use fp8='dequantize' or 'unwrap'", file=self.ck.path, key=self.entry.key
        )

    def _assemble(self, part: str | None, items: list[tuple[ChunkInfo, torch.Tensor]]):
        """Place each chunk's piece at its offsets scaled down by the piece's granularity."""
        shape = self.entry.shape
        if len(items) == 1 and items[0][0].sizes == shape:
            return items[0][1]
        ratios = None
        for chunk, tensor in items:
            ratio = _ratio(chunk, tensor, shape)
            if ratio is None or (ratios is not None and ratio != ratios):
                raise self._refuse(f"chunks store {part or 'data'} at different granularities")
            ratios = ratio
        out = torch.empty(
            [math.ceil(n / r) for n, r in zip(shape, ratios, strict=True)], dtype=items[0][1].dtype
        )
        for chunk, tensor in items:
            where = tuple(
                slice(o // r, o // r + s // r)
                for o, s, r in zip(chunk.offsets, chunk.sizes, ratios, strict=True)
            )
            out[where] = tensor.reshape(out[where].shape)
        return out


def _ratio(
    chunk: ChunkInfo, tensor: torch.Tensor, shape: tuple[int, ...]
) -> tuple[int, ...] | None:
    """How many logical elements one stored element of ``tensor`` spans, per dimension."""
    stored = tuple(tensor.shape) if tensor.dim() == len(shape) else None
    if stored is None and tensor.numel() == 1:
        stored = (1,) * len(shape)
    if stored is None:
        return None
    ratio = []
    for offset, size, n in zip(chunk.offsets, chunk.sizes, stored, strict=True):
        if n == 0 or size % n or offset % (size // n):
            return None
        ratio.append(size // n)
    return tuple(ratio)
