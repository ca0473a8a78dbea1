"""How an export treats FP8 and other tensor subclasses: one of ``FP8_MODES`` per export.

- ``"dequantize"``: payloads (subclass and plain float8 + scale) -> ``dtype`` (default
  bfloat16), their scale entries consumed; wrappers -> master weight as stored; plain
  float8 without a scale -> upcast to ``dtype``.
- ``"unwrap"``: wrappers -> master weight; subclass payloads -> their logical (outer) dtype;
  plain float8 and scale entries left as stored.
- ``"keep"``: wrappers -> master weight; subclass payloads split into the raw data under
  the key and each scale under ``<key>_<name>`` (torchao's inner tensor names without the
  leading underscore: ``_scale``; NVFP4 adds ``_per_tensor_scale``; NF4 writes
  ``_quantized_scalers``, ``_quantization_factor``, ``_scaler_mean``, ``_nf4``), with the
  rule in each output's ``conversion``. Note the two float8 conventions:
  Float8TrainingTensor divides by its scale, every other payload multiplies. Sharded
  payloads are reassembled when every chunk has the same scale granularity (a per-tensor
  scale per row shard becomes a block scale); plain float8 and scales stay as stored.

Planning reads metadata and chunk pickles only; each output's ``read`` materialises it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from inspector import dtypes
from inspector.entry import ChunkInfo, Entry
from inspector.errors import CorruptCheckpointError, UnsupportedError, UsageError
from inspector.formats.safe_pickle import SubclassRef
from inspector.tensors.detection import Detection
from inspector.tensors.payloads import PAYLOADS, format_key, unwrap
from inspector.tensors.scales import ScalePair

if TYPE_CHECKING:
    import torch

    from inspector.checkpoint import Checkpoint
    from inspector.formats.base import LogicalWeight

FP8_MODE_HELP = {
    "dequantize": "FP8 payloads to the dtype (bfloat16 if as stored)",
    "unwrap": "FP8 training wrappers to their master weights",
    "keep": "raw float8 data plus scales",
    "quantize": "linear weights to FP8 e4m3 + scales (per channel unless fp8_scheme says)",
}
FP8_MODES = tuple(FP8_MODE_HELP)
Fp8Mode = Literal["dequantize", "unwrap", "keep", "quantize"]
DEFAULT_FP8_DTYPE = "bfloat16"


@dataclass(frozen=True)
class Output:
    """One tensor an export writes: its name, the entries it is made from, how it is made.

    ``dtype`` (a name) and ``shape`` are what ``read()`` returns, when known without reading;
    ``raw`` marks stored FP8 bytes or scales, which an export must never cast.
    """

    name: str
    sources: tuple[str, ...]
    conversion: str | None
    reader: Callable[[], torch.Tensor] = field(repr=False, compare=False)
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    raw: bool = False

    def read(self) -> torch.Tensor:
        """Materialise it now (reads only its source entries)."""
        return self.reader()


def check_mode(mode: str) -> Fp8Mode:
    if mode not in FP8_MODES:
        raise UsageError(f"fp8 mode {mode!r} is not one of {', '.join(FP8_MODES)}")
    return mode  # type: ignore[return-value]


def plan_fp8(
    ck: Checkpoint,
    keys: Iterable[str],
    mode: str = "dequantize",
    dtype: str = DEFAULT_FP8_DTYPE,
    scheme: str = "channel",
) -> tuple[list[Output], dict[str, str]]:
    """What to write for ``keys`` under ``mode`` (see the module docstring; ``scheme``: how
    ``"quantize"`` does, one of :data:`inspector.exporting.quantize.SCHEMES`).

    Returns the outputs in key order and, for keys that produce no output of their own,
    the reason (a scale consumed by its weight, a non-tensor entry).
    """
    mode = check_mode(mode)
    dtype = dtypes.name_of(dtype)
    keys = list(keys)
    wanted = set(keys)
    pairs = ck.scale_pairs.by_weight if mode in ("dequantize", "quantize") else {}
    consumed = {p.scale: p.weight for p in pairs.values() if p.weight in wanted}
    grouped = _grouped(ck, wanted) if mode in ("dequantize", "quantize") else {}
    outputs: list[Output] = []
    skipped: dict[str, str] = {}
    for key in keys:
        if key in grouped:
            weight = grouped[key]
            if weight.key in skipped or any(o.name == weight.key for o in outputs):
                if key != weight.key:
                    skipped[key] = f"part of {weight.key}, dequantized into it"
                continue
            outputs.extend(
                _quantized(
                    weight.key, weight.shape, dtype, mode, _logical_output(ck, weight, dtype),
                    scheme,
                )
            )
            if key != weight.key:
                skipped[key] = f"part of {weight.key}, dequantized into it"
            continue
        entry = ck.entry(key)
        if entry.kind == "tensor" and key in ck.logical and key in ck.logical[key].parts.values():
            entry = ck.stored_entry(key)  # the raw part, kept as stored
        if entry.kind != "tensor":
            skipped[key] = "not a tensor"
        elif key in ck.logical and key not in ck.logical[key].parts.values():
            skipped[key] = f"stored as its parts, written as they are in fp8={mode!r}"
        elif key in consumed:
            skipped[key] = f"scale of {consumed[key]}, applied to it"
        else:
            inner: Fp8Mode = "dequantize" if mode == "quantize" else mode
            made = _outputs(ck, entry, ck.detection(key), inner, dtype, pairs)
            if mode == "quantize" and len(made) == 1:
                made = _quantized(key, entry.shape, dtype, mode, made[0], scheme)
            outputs.extend(made)
    return outputs, skipped


def _quantized(
    key: str,
    shape: tuple[int, ...] | None,
    dtype: str,
    mode: str,
    value: Output,
    scheme: str,
) -> list[Output]:
    """``value`` as FP8 ``key`` + its scale when ``mode`` quantizes it, else as it is."""
    from inspector.exporting import quantize

    if mode != "quantize" or not quantize.quantizable(key, shape, value.dtype):
        return [value]
    assert shape is not None
    made = quantize.Quantization(value.read, dtype, scheme)
    scale_shape, scale_dtype = quantize.scale_form(shape, dtype, scheme)
    text = f"{value.conversion or value.dtype} -> float8_e4m3fn, {quantize.describe(scheme)}"
    name = key + quantize.scale_suffix(scheme)
    return [
        Output(key, value.sources, text, made.weight, "float8_e4m3fn", shape, raw=True),
        Output(name, value.sources, f"scale of {key}", made.scale, scale_dtype, scale_shape, True),
    ]


def _grouped(ck: Checkpoint, wanted: set[str]) -> dict[str, LogicalWeight]:
    """Each selected logical weight (``ck.logical``) and its selected stored parts, mapped to
    it (the parts of a weight left out are written as they are stored)."""
    return {
        key: weight
        for weight in ck.logical.values()
        if weight.key in wanted
        for key in (weight.key, *weight.parts.values())
        if key in wanted
    }


def _logical_output(ck: Checkpoint, weight: LogicalWeight, dtype: str) -> Output:
    text = f"{weight.scheme.label} -> {dtype}"
    reader = functools.partial(ck.read, weight.key, dtype)
    sources = tuple(dict.fromkeys((weight.key, *weight.parts.values())))
    return Output(weight.key, sources, text, reader, dtype, weight.shape)


def _outputs(
    ck: Checkpoint,
    entry: Entry,
    found: Detection,
    mode: Fp8Mode,
    dtype: str,
    pairs: dict[str, ScalePair],
) -> list[Output]:
    key, read = entry.key, functools.partial(ck.read_stored, entry.key)
    shape = entry.shape
    if found.kind == "wrapper":
        text = f"unwrap {found.subclass} -> {entry.dtype} master weight"
        return [Output(key, (key,), text, read, entry.dtype, shape)]
    if found.kind == "unknown":
        text = f"values of tensor subclass {found.subclass}"
        return [Output(key, (key,), text, read, entry.dtype, shape)]
    if found.kind == "payload" and mode == "keep":
        return _split(ck, entry, found)
    if found.kind == "payload":
        target = dtype if mode == "dequantize" else entry.dtype
        text = f"{found.subclass} ({found.fp8}) -> {target}"
        return [Output(key, (key,), text, functools.partial(ck.read, key, target), target, shape)]
    if key in pairs:
        pair = pairs[key]
        text = f"{entry.dtype} {pair.granularity} -> {dtype}"
        reader = functools.partial(_read_scaled, ck, pair, dtype)
        return [Output(key, (key, pair.scale), text, reader, dtype, shape)]
    if mode == "dequantize" and entry.dtype in dtypes.FLOAT8:
        text = f"{entry.dtype} -> {dtype} (no scale found)"
        return [Output(key, (key,), text, functools.partial(ck.read, key, dtype), dtype, shape)]
    raw = entry.dtype in dtypes.FLOAT8 or key in ck.scale_pairs.weight_of
    return [Output(key, (key,), None, read, entry.dtype, shape, raw)]


def _read_scaled(ck: Checkpoint, pair: ScalePair, dtype: str) -> torch.Tensor:
    from inspector.tensors.convert import dequantize

    weight, scale = ck.read_stored(pair.weight), ck.read_stored(pair.scale)
    try:
        return dequantize(weight, scale, dtype=dtype, blocks=pair.blocks)
    except (UnsupportedError, ValueError, RuntimeError) as exc:
        raise UnsupportedError(
            f"cannot apply scale {pair.scale} ({exc})", file=ck.location, key=pair.weight
        ) from exc


def _split(ck: Checkpoint, entry: Entry, found: Detection) -> list[Output]:
    key = entry.key
    split = _SplitPayload(ck, entry, found)
    rule = f"{found.subclass}: {PAYLOADS[found.payload or ''].rule}"
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
        self.payload, self.parts = found.payload or "", found.parts
        self._kept: dict[str, torch.Tensor] = {}

    def part(self, name: str | None) -> torch.Tensor:
        import torch

        if name is not None and name in self._kept:
            return self._kept.pop(name)
        error = self.ck.facts(self.entry.key).error
        if error:
            raise CorruptCheckpointError(error, file=self.ck.location, key=self.entry.key)
        fmt = PAYLOADS[self.payload]
        pieces: dict[str | None, list[tuple[ChunkInfo, torch.Tensor]]] = {
            part: [] for part in (None, *self.parts)
        }
        for index, chunk in enumerate(self.entry.chunks):
            payload = unwrap(self.ck.source.read_chunk(self.entry, index))
            if not isinstance(payload, SubclassRef) or format_key(payload.cls) != self.payload:
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
            f"{why}; use fp8='dequantize' or 'unwrap'", file=self.ck.location, key=self.entry.key
        )

    def _assemble(
        self, part: str | None, items: list[tuple[ChunkInfo, torch.Tensor]]
    ) -> torch.Tensor:
        """Place each chunk's piece at its offsets scaled down by the piece's granularity."""
        import torch

        shape = self.entry.shape or ()
        if len(items) == 1 and items[0][0].sizes == shape:
            return items[0][1]
        ratios: tuple[int, ...] | None = None
        for chunk, tensor in items:
            ratio = _ratio(chunk, tensor, shape)
            if ratio is None or (ratios is not None and ratio != ratios):
                raise self._refuse(f"chunks store {part or 'data'} at different granularities")
            ratios = ratio
        assert ratios is not None
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
