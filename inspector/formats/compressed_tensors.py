"""Quantized weights stored as several tensors of a Hugging Face folder, grouped into one
logical weight each (names, dtypes and shapes only; values: :mod:`inspector.tensors.packed`).

- compressed-tensors (llm-compressor, served by vLLM): ``config.json`` holds a
  ``quantization_config`` (``quant_method: compressed-tensors``) naming the ``format`` and
  each config group's ``weights`` arguments. Per module ``P``: ``float-quantized`` /
  ``naive-quantized`` store ``P.weight`` (float8 / int8) + ``P.weight_scale``
  [+ ``P.weight_zero_point``]; ``pack-quantized`` stores ``P.weight_packed`` (int32, dense
  bit packing) + ``P.weight_scale`` + ``P.weight_shape`` [+ packed ``P.weight_zero_point``];
  ``nvfp4-pack-quantized`` stores ``P.weight_packed`` (uint8, two e2m1 per byte) +
  ``P.weight_scale`` (float8_e4m3fn per 16) + ``P.weight_global_scale``.
- MXFP4 (gpt-oss, ``quant_method: mxfp4``): ``P_blocks`` (uint8, 16 bytes = 32 e2m1 per
  block) + ``P_scales`` (uint8 e8m0 per block) are the weight ``P``.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Mapping
from typing import Any

from inspector.entry import Entry
from inspector.errors import InspectorError
from inspector.formats import fine_grained_fp8
from inspector.formats.base import MXFP4, LogicalWeight, Scheme, Source
from inspector.storage.base import Storage

CONFIG_FILE = "config.json"
COMPRESSED_TENSORS = "compressed-tensors"
# The parts each compressed-tensors format stores (besides the optional ones).
FORMATS = {
    "float-quantized": ("weight", "weight_scale"),
    "naive-quantized": ("weight", "weight_scale"),
    "int-quantized": ("weight", "weight_scale"),
    "pack-quantized": ("weight_packed", "weight_scale"),
    "nvfp4-pack-quantized": ("weight_packed", "weight_scale"),
}
_OPTIONAL = ("weight_zero_point", "weight_shape", "weight_global_scale")
_MXFP4_PARTS = ("_blocks", "_scales")


def read_config(storage: Storage, name: str) -> dict[str, Any] | None:
    """The ``quantization_config`` of the config.json beside what was opened (``name`` in
    ``storage``), when it names a quantization method handled here; else None."""
    folder = name.rpartition("/")[0]
    path = f"{folder}/{CONFIG_FILE}" if folder else CONFIG_FILE
    try:
        if storage.kind(path) != "file":
            return None
        config = json.loads(storage.read(path))
    except InspectorError:
        return None
    except ValueError:
        return None  # a config.json that is not JSON says nothing about the weights
    if not isinstance(config, dict):
        return None
    quant = config.get("quantization_config") or config.get("compression_config")
    if not isinstance(quant, dict):
        return None
    methods = (COMPRESSED_TENSORS, MXFP4, fine_grained_fp8.QUANT_METHOD)
    return quant if quant.get("quant_method") in methods else None


def group(
    entries: Mapping[str, Entry],
    config: Mapping[str, Any] | None,
    values: Callable[[str], tuple[int, ...] | None] = lambda key: None,
) -> dict[str, LogicalWeight]:
    """Every quantized weight of a folder with ``config`` (see the module docstring), by
    logical key; ``values`` reads a small integer entry (``weight_shape``). A module whose
    parts do not fit its scheme is still grouped; reading it then fails with an error naming
    the key and the scheme."""
    if not config:
        return {}
    if config.get("quant_method") == MXFP4:
        return _mxfp4(entries)
    if config.get("quant_method") == fine_grained_fp8.QUANT_METHOD:
        return fine_grained_fp8.group(entries, config)
    groups = _config_groups(config)
    found: dict[str, LogicalWeight] = {}
    for key in entries:
        prefix, _, role = key.rpartition(".")
        if role not in ("weight_packed", "weight_scale") or prefix + ".weight" in found:
            continue
        if role == "weight_scale" and prefix + ".weight_packed" in entries:
            continue
        scheme = _scheme_for(prefix, groups, config)
        required = FORMATS.get(scheme.format, ("weight_packed", "weight_scale"))
        parts = {r: f"{prefix}.{r}" for r in (*required, *_OPTIONAL) if f"{prefix}.{r}" in entries}
        if "weight" not in parts and (role == "weight_scale" or f"{prefix}.weight" in entries):
            continue  # a scale alone, or a stored weight that is no part of this scheme
        dtype = _scale_dtype(entries, parts, scheme)
        shape = _shape(entries, parts, scheme, values)
        found[f"{prefix}.weight"] = LogicalWeight(f"{prefix}.weight", scheme, parts, dtype, shape)
    return found


def _shape(
    entries: Mapping[str, Entry],
    parts: dict[str, str],
    scheme: Scheme,
    values: Callable[[str], tuple[int, ...] | None],
) -> tuple[int, ...] | None:
    """The dequantized weight's shape: the stored weight's, ``weight_shape``'s values, or
    (NVFP4: two values per byte) the packed tensor's; None when none of them says."""
    if "weight" in parts:
        return entries[parts["weight"]].shape
    if "weight_shape" in parts:
        return values(parts["weight_shape"])
    packed = entries[parts["weight_packed"]].shape if "weight_packed" in parts else None
    if scheme.format == "nvfp4-pack-quantized" and packed and len(packed) == 2:
        return (packed[0], packed[1] * 2)
    return None


def _scale_dtype(entries: Mapping[str, Entry], parts: dict[str, str], scheme: Scheme) -> str | None:
    """compressed-tensors dequantizes into the scale's dtype (NVFP4: bfloat16)."""
    if scheme.format == "nvfp4-pack-quantized":
        return "bfloat16"
    scale = entries.get(parts.get("weight_scale", ""))
    return scale.dtype if scale is not None else None


def _config_groups(config: Mapping[str, Any]) -> list[tuple[list[str], Scheme]]:
    default = str(config.get("format") or "")
    out = []
    for spec in (config.get("config_groups") or {}).values():
        if not isinstance(spec, dict) or not isinstance(spec.get("weights"), dict):
            continue
        fmt = str(spec.get("format") or default)
        out.append((list(spec.get("targets") or []), Scheme.from_args(fmt, spec["weights"])))
    return out


def _scheme_for(
    prefix: str, groups: list[tuple[list[str], Scheme]], config: Mapping[str, Any]
) -> Scheme:
    """The config group whose ``re:`` target matches the module, else the only class-name
    targeted group (module classes are not known from weights alone)."""
    for targets, scheme in groups:
        if any(t.startswith("re:") and re.match(t[3:], prefix) for t in targets):
            return scheme
    plain = [s for targets, s in groups if not all(t.startswith("re:") for t in targets)]
    if plain:
        return plain[0]
    return Scheme(str(config.get("format") or "unknown"))


def _mxfp4(entries: Mapping[str, Entry]) -> dict[str, LogicalWeight]:
    found = {}
    for key, entry in entries.items():
        if not key.endswith("_blocks") or entry.dtype != "uint8":
            continue
        base = key.removesuffix("_blocks")
        if base + "_scales" not in entries or base in entries:
            continue
        shape = None
        if entry.shape and len(entry.shape) == 4:
            experts, rows, groups, width = entry.shape
            shape = (experts, groups * width * 2, rows)
        parts = {"blocks": key, "scales": base + "_scales"}
        found[base] = LogicalWeight(
            base, Scheme(MXFP4, 4, "float", "group", 32), parts, "bfloat16", shape
        )
    return found


def logical_weights(source: Source, entries: Mapping[str, Entry]) -> dict[str, LogicalWeight]:
    """The grouped weights of a safetensors folder whose config.json names a quantization
    method (other formats have none: nothing is read for them)."""
    if not source.format.startswith("safetensors"):
        return {}
    try:
        config = read_config(source.storage, source.name)
        return group(entries, config, lambda key: small_ints(source, entries[key]))
    except (AttributeError, TypeError, ValueError):
        return {}  # a quantization_config of another shape: the parts stay plain entries


_INT_CODES = {"int64": "q", "int32": "i"}
_MAX_SMALL = 8


def small_ints(source: Source, entry: Entry) -> tuple[int, ...] | None:
    """The values of a small stored 1-D integer tensor (a ``weight_shape``), read as bytes
    without torch; None when it is not one (reading the weight then says what is wrong)."""
    code = _INT_CODES.get(entry.dtype or "")
    if code is None or entry.shape is None or len(entry.shape) != 1 or len(entry.chunks) != 1:
        return None
    count = entry.shape[0]
    where = source.chunk_bytes(entry, 0)
    size = count * struct.calcsize("<" + code)
    if not 0 < count <= _MAX_SMALL or where is None or where.length != size:
        return None
    try:
        data = where.storage.read(where.name, where.offset, where.length)
    except InspectorError:
        return None
    if len(data) != where.length:
        return None
    found = struct.unpack(f"<{count}{code}", data)
    return found if all(n >= 0 for n in found) else None
