"""Plain stand-ins for torch's DCP metadata classes, which ``.metadata`` pickles decode into.

safe_pickle maps the globals a genuine ``.metadata`` names
(``torch.distributed.checkpoint.metadata.*``, ``filesystem._StorageInfo``, and the
``planner`` records Megatron-Core adds as ``all_local_plans``) to these
classes: they only hold the pickled fields, run nothing, and spare ``inspector.open``
the import of ``torch.distributed`` (about a second and 50 MB). Attribute names match
torch's, so code reads them the same way; absent fields read as their defaults.
"""

from __future__ import annotations

from typing import Any

from inspector.formats.safe_pickle.records import Allowed, FrozenClass, Immutable
from inspector.reprs import bounded_repr

# torch's TensorProperties pickles its memory format as this enum's value (0, 1, 2).
MEMORY_FORMATS = ("contiguous_format", "channels_last", "preserve_format")


class _Record(metaclass=FrozenClass):
    """Fields arrive through pickle's BUILD (``__dict__`` update of the instance); defaults
    are class attributes, which no pickle can change (see FrozenClass)."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={bounded_repr(v, 200)}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    __hash__ = object.__hash__


class Metadata(_Record):
    state_dict_metadata: Any = None
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: Any = None
    all_local_plans: Any = None  # Megatron-Core keeps every rank's SavePlan here


class MetadataIndex(_Record):
    fqn: Any = None
    offset: Any = None
    index: Any = None


class TensorStorageMetadata(_Record):
    properties: Any = None
    size: Any = None
    chunks: Any = None


class BytesStorageMetadata(_Record):
    pass


class ChunkStorageMetadata(_Record):
    offsets: Any = None
    sizes: Any = None


class TensorProperties(_Record):
    dtype: Any = None
    layout: Any = None
    requires_grad: Any = False
    memory_format: Any = None
    pin_memory: Any = False

    def __setstate__(self, state: Any) -> None:
        """torch pickles ``(dtype, layout, requires_grad, memory_format_code, pin_memory)``."""
        if isinstance(state, dict):
            vars(self).update(state)
            return
        if not isinstance(state, tuple) or len(state) != 5:
            raise ValueError(f"TensorProperties state {state!r} is not a 5-tuple")
        self.dtype, self.layout, self.requires_grad, code, self.pin_memory = state
        self.memory_format = MEMORY_FORMATS[code] if code in (0, 1, 2) else code


class StorageMeta(_Record):
    checkpoint_id: Any = None
    save_id: Any = None
    load_id: Any = None
    modules: Any = ()


class StorageInfo(_Record):
    """``filesystem._StorageInfo``: where one item's bytes lie."""

    relative_path: Any = None
    offset: Any = None
    length: Any = None
    transform_descriptors: Any = None


# --- the save planner's records (``torch.distributed.checkpoint.planner``), which Megatron-Core
# pickles into ``.metadata`` as ``all_local_plans``: kept for display, never used to read.


class SavePlan(_Record):
    items: Any = ()
    storage_data: Any = None
    planner_data: Any = None
    usable: Any = True


class WriteItem(_Record):
    index: Any = None
    type: Any = None
    bytes_io_data: Any = None
    tensor_data: Any = None


class TensorWriteData(_Record):
    chunk: Any = None
    properties: Any = None
    size: Any = None


_WRITE_ITEM_TYPES = ("TENSOR", "SHARD", "BYTE_IO")


class WriteItemType(Immutable, metaclass=FrozenClass):
    """``WriteItemType(n)``, the enum a pickle rebuilds by calling the class with its value."""

    __slots__ = ("name", "value")
    name: str
    value: int

    def __init__(self, value: Any) -> None:
        if type(value) is not int or not 0 < value <= len(_WRITE_ITEM_TYPES):
            raise ValueError(f"unknown WriteItemType {value!r}")
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "name", _WRITE_ITEM_TYPES[value - 1])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WriteItemType) and other.value == self.value

    def __hash__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"WriteItemType.{self.name}"


def _memory_format_code(value: Any) -> Any:
    """``_MEM_FORMAT_ENCODING(value)``: the enum member is kept as its plain value."""
    if value not in (0, 1, 2):
        raise ValueError(f"unknown memory format encoding {value!r}")
    return value


CLASSES = (
    {
        ("torch.distributed.checkpoint.metadata", cls.__name__): cls
        for cls in (
            Metadata,
            MetadataIndex,
            TensorStorageMetadata,
            BytesStorageMetadata,
            ChunkStorageMetadata,
            TensorProperties,
            StorageMeta,
        )
    }
    | {
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): Allowed(
            _memory_format_code, "_MEM_FORMAT_ENCODING"
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    }
    | {
        ("torch.distributed.checkpoint.planner", cls.__name__): cls
        for cls in (SavePlan, WriteItem, TensorWriteData, WriteItemType)
    }
)
