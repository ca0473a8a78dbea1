"""What a tensor entry's chunks hold, found without running anything or reading tensor data.

A DCP chunk is a torch.save archive; the classes it pickles are read from the opcodes of its
small ``data.pkl`` record (``source.chunk_globals``). Only chunks naming a class outside
torch are decoded (``source.describe_chunk``: safe_pickle, tensor bytes are not read) to
learn the facts shown for the entry (``Detection.subclass`` / ``Detection.fp8``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from inspector import dtypes
from inspector.entry import Entry
from inspector.errors import InspectorError, StorageAccessError
from inspector.formats.base import Source
from inspector.formats.safe_pickle import Opaque, SubclassRef
from inspector.tensors.payloads import (
    LEGACY_MODULE,
    PAYLOADS,
    WRAPPER_ATTRS,
    class_name,
    format_key,
    is_tensor_like,
    label,
    name_of,
)

DetectionKind = Literal["plain", "wrapper", "payload", "unknown", "unreadable"]
# Pickle globals that any plain tensor chunk may name; everything else is a foreign class.
_PLAIN_ROOTS = frozenset(["torch", "collections", "builtins", "__builtin__", "_codecs", "copyreg"])
_MAX_LAYERS = 8  # wrappers around wrappers; genuine checkpoints nest one or two


@dataclass(frozen=True, slots=True)
class Detection:
    """What a tensor entry's chunks hold.

    ``kind``: ``plain``, ``wrapper`` (a high-precision tensor wrapped for FP8 training),
    ``payload`` (quantized data + scales, in format ``payload``: training, affine, mx, nvfp4
    or nf4), ``unknown`` (a subclass we cannot convert unless it carries its own storage) or
    ``unreadable`` (``error`` says why). ``classes`` are the foreign globals its pickles name;
    ``parts`` the payload's scale tensors (what ``"keep"`` writes next to the data).
    """

    kind: DetectionKind
    subclass: str | None = None
    fp8: str | None = None
    classes: tuple[str, ...] = ()
    payload: str | None = None
    parts: tuple[str, ...] = ()
    error: str | None = None


PLAIN = Detection("plain")


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
        return PLAIN
    labels, ref = [], value
    while isinstance(ref, SubclassRef) and format_key(ref.cls) == "wrapper":
        labels.append(label(ref.cls))
        inner = ref.attrs.get(WRAPPER_ATTRS[class_name(ref)])
        if not isinstance(inner, SubclassRef):
            return Detection("wrapper", " > ".join(labels), _wrapper_facts(ref, classes), classes)
        if len(labels) >= _MAX_LAYERS or inner is ref:
            error = f"{ref.cls} wraps itself or nests more than {_MAX_LAYERS} layers"
            return Detection("unreadable", " > ".join(labels), classes=classes, error=error)
        ref = inner
    labels.append(label(ref.cls))
    key = format_key(ref.cls)
    if key is None:
        facts = "own storage" if ref.data is not None else None
        return Detection("unknown", " > ".join(labels), facts, classes)
    payload = PAYLOADS[key]
    parts = tuple(p for p in payload.scales if is_tensor_like(ref.attrs.get(p)))
    return Detection("payload", " > ".join(labels), payload.facts(ref), classes, key, parts)


def _wrapper_facts(ref: SubclassRef, classes: tuple[str, ...]) -> str:
    if class_name(ref) == "DTensor":
        return "local shard"
    target = name_of(ref.attrs.get("_dtype"))
    text = f"wrapper -> {target}" if dtypes.is_known(target) else "wrapper"
    if is_tensor_like(ref.attrs.get("_precomputed_scale")):
        text += ", precomputed scale"
    if any(c.startswith(LEGACY_MODULE + ".") for c in classes):
        text += ", legacy torchao names"
    return text


def detect(source: Source, entry: Entry) -> Detection:
    """Scan every chunk's pickle opcodes; decode the first naming a foreign class for facts."""
    if entry.kind != "tensor":
        return PLAIN
    if entry.error:
        return Detection("unreadable", error=entry.error)
    try:
        found = [foreign_classes(source.chunk_globals(entry, i)) for i in range(len(entry.chunks))]
        classes = tuple(dict.fromkeys(c for names in found for c in names))
        if not classes:
            return PLAIN
        first = next(i for i, names in enumerate(found) if names)
        return describe(source.describe_chunk(entry, first), classes)
    except StorageAccessError:
        raise  # the storage failed a request: nothing is known about the chunk
    except InspectorError as exc:
        return Detection("unreadable", error=exc.located)
