"""What decoding yields in place of objects we never build: inert placeholders and
tensor descriptions (materialised later, by the format that knows where the bytes are)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class Opaque:
    """Inert stand-in for a class or function a pickle names but we never import.

    It accepts whatever the pickle passes (constructor arguments, state, items) and
    keeps it for display; ``global_name`` says what it stood in for.
    """

    global_name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        obj = super().__new__(cls)
        obj.args, obj.kwargs, obj.state, obj.items = args, kwargs, None, []
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items.append((key, value))

    def append(self, value: Any) -> None:
        self.items.append(value)

    def extend(self, values: Any) -> None:
        self.items.extend(values)

    def __reduce__(self) -> Any:
        raise TypeError(f"placeholder for {self.global_name} cannot be pickled")

    def __repr__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        text = f"<{self.global_name}({', '.join(parts)})"
        if self.state is not None:
            text += f" state={self.state!r}"
        if self.items:
            text += f" items={self.items!r}"
        return text + " (not loaded)>"


def opaque_class(module: str, name: str) -> type[Opaque]:
    """A distinct placeholder class per global, so isinstance and NEWOBJ work on it."""
    label = f"{module}.{name}"
    safe_name = "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "Opaque"
    return type(safe_name, (Opaque,), {"global_name": label, "__module__": __name__})


@dataclass(frozen=True)
class StorageRef:
    """A storage record of a torch archive: ``data/<key>``, ``numel`` elements of ``dtype``."""

    key: str
    dtype: torch.dtype
    numel: int


@dataclass
class TensorRef:
    """A plain tensor described by a pickle: a strided view into a storage record."""

    storage: StorageRef | None
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False


@dataclass
class SubclassRef:
    """A tensor subclass instance: its class name, outer dtype/shape and pickled attributes."""

    cls: str
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    data: TensorRef | None = None


@dataclass(frozen=True)
class StorageType:
    dtype: torch.dtype | None  # None: UntypedStorage (bytes; the real dtype comes later)


@dataclass(frozen=True)
class UnknownDtype:
    """``torch.<name>`` where this torch has no such attribute: a dtype of a newer torch,
    or damage. Kept by name (inert, not callable) so only the entries using it fail."""

    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name} (unknown to torch {torch.__version__})"
