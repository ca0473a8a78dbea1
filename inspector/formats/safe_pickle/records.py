"""What decoding yields in place of objects we never build: inert placeholders, dtype names,
and tensor and array descriptions that a format materialises later (it knows where the
bytes are).

Anything a pickle can reach twice (a global, a memoised object) is immune to pickle's BUILD
opcode and to ``setattr``: a file can shape only its own decoded values, never the
stand-ins later files are decoded with.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inspector.formats.safe_pickle import budget
from inspector.reprs import bounded_repr


class Immutable:
    """Mixin: refuses pickle's BUILD (``__setstate__``) and attribute assignment."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise TypeError(f"{type(self).__name__} stand-in cannot be given state")

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError(f"{type(self).__name__} stand-in is immutable")

    def __delattr__(self, name: str) -> None:
        raise TypeError(f"{type(self).__name__} stand-in is immutable")


class FrozenClass(type):
    """Metaclass of stand-in classes that pickles name as globals: no attribute of the class
    can be set, so decoding one file cannot change how the next is decoded."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise TypeError(f"stand-in class {cls.__name__} is immutable")

    def __delattr__(cls, name: str) -> None:
        raise TypeError(f"stand-in class {cls.__name__} is immutable")


class Allowed(Immutable):
    """An allow-listed function as a pickle sees it: callable, nothing else."""

    __slots__ = ("_fn", "name")
    _fn: Callable[..., Any]
    name: str

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "name", name)

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)

    def __repr__(self) -> str:
        return f"<allowed {self.name}>"


class DtypeName(str):
    """A ``torch.<dtype>`` a pickle named, kept as its name (a str, so records can use it
    as is); :func:`materialize` turns it into the ``torch.dtype`` in decoded objects."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"torch.{self!s}"


class Marker(Immutable):
    """A torch class a pickle names only to say what it rebuilds (``torch.Tensor``,
    ``torch.nn.Parameter``): compared, never instantiated."""

    __slots__ = ("name",)
    name: str

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)

    def __repr__(self) -> str:
        return self.name


TENSOR = Marker("torch.Tensor")
PARAMETER = Marker("torch.nn.Parameter")


class Opaque:
    """Inert stand-in for a class or function a pickle names but we never import.

    It accepts whatever the pickle passes (constructor arguments, state, items) and
    keeps it for display; ``global_name`` says what it stood in for. Each decoded file
    gets its own placeholder classes (:func:`opaque_class`), so they share nothing.
    """

    global_name = "?"
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: Any
    items: list[Any]

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
        return describe_opaque(self)


def describe_opaque(obj: Opaque, budget: int = 2000) -> str:
    """``<module.Class(args) state=... (not loaded)>``, cut at ``budget`` characters and
    safe on shared or cyclic contents (repr of a decoded value is bounded by the file)."""
    parts = [bounded_repr(a, budget) for a in obj.args] + [
        f"{k}={bounded_repr(v, budget)}" for k, v in obj.kwargs.items()
    ]
    text = f"<{obj.global_name}({', '.join(parts)})"
    if obj.state is not None:
        text += f" state={bounded_repr(obj.state, budget)}"
    if obj.items:
        text += f" items={bounded_repr(obj.items, budget)}"
    return text[:budget] + " (not loaded)>"


def opaque_class(module: str, name: str) -> type[Opaque]:
    """A distinct placeholder class per global, so isinstance and NEWOBJ work on it."""
    label = f"{module}.{name}"
    safe_name = "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "Opaque"
    return type(safe_name, (Opaque,), {"global_name": label, "__module__": __name__})


@dataclass(frozen=True, slots=True)
class StorageRef:
    """A storage record of a torch archive: ``data/<key>``, ``numel`` elements of ``dtype``."""

    key: str
    dtype: str
    numel: int

    def __setstate__(self, state: Any) -> None:
        raise TypeError("StorageRef cannot be given state")


@dataclass(frozen=True, slots=True)
class BrokenTensor:
    """A tensor rebuild whose arguments describe no readable tensor (a size or stride that
    is not a list of small ints, an offset past its storage, ...): only its key is marked,
    with ``reason``; the rest of the pickle decodes."""

    reason: str

    def __setstate__(self, state: Any) -> None:
        """Already unreadable: state changes nothing."""


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A plain tensor described by a pickle: a strided view into a storage record."""

    storage: StorageRef | None
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: bool = False
    damage: str | None = None  # why its key cannot be read (set by BUILD only)

    def __setstate__(self, state: Any) -> None:
        """torch would re-point the tensor with ``set_(*state)``: its values are not the
        described ones, so the key is marked unreadable (nothing else changes)."""
        damage = f"the pickle gives the tensor state {bounded_repr(state, 100)}; refusing it"
        object.__setattr__(self, "damage", damage)

    @property
    def extent(self) -> int:
        """Elements spanned from the first to the last one (strides allowed; 0 if empty)."""
        if not math.prod(self.shape):
            return 0
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))

    @property
    def overlapping(self) -> bool:
        """Whether two of its elements share storage other than by repeating one along a
        stride-0 dimension (``expand``): ``as_strided`` views only, whose element count the
        storage does not bound."""
        dims = sorted((s, n) for n, s in zip(self.shape, self.stride, strict=True) if n > 1 and s)
        reach = 1
        for stride, size in dims:
            if stride < reach:
                return True
            reach += (size - 1) * stride
        return False


@dataclass(frozen=True, slots=True)
class SubclassRef:
    """A tensor subclass instance: its class name, outer dtype/shape and pickled attributes
    (read-only once built; ``attrs`` values may be TensorRefs or, materialised, tensors)."""

    cls: str
    dtype: str | None
    shape: tuple[int, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    data: Any = None

    def __setstate__(self, state: Any) -> None:
        raise TypeError("SubclassRef cannot be given state")


@dataclass(frozen=True, slots=True)
class StorageType:
    """A torch storage class (``torch.FloatStorage``; None dtype: ``UntypedStorage``)."""

    dtype: str | None

    def __setstate__(self, state: Any) -> None:
        raise TypeError("storage type stand-in cannot be given state")


@dataclass(frozen=True, slots=True)
class UnknownDtype:
    """``torch.<name>`` of a dtype this inspector does not know: a newer torch's, or damage.
    Kept by name (inert, not callable) so only the entries using it fail."""

    name: str

    def __setstate__(self, state: Any) -> None:
        raise TypeError("UnknownDtype cannot be given state")

    def __repr__(self) -> str:
        return f"torch.{self.name} (an unknown dtype)"


# --- numpy values, described (never built: a forged dtype can crash numpy) -------------------

_NUMPY_KINDS = "biuf"  # bool, signed, unsigned, float: plain numbers only


class NumpyDtype(Immutable, metaclass=FrozenClass):
    """``numpy.dtype(code)`` of a plain numeric type (``'<f8'``, ``'u4'``, ``'?'``); object,
    structured and subarray dtypes are refused."""

    __slots__ = ("byteorder", "code")
    code: str
    byteorder: str

    def __init__(self, code: Any, align: Any = False, copy: Any = True) -> None:
        if not (isinstance(code, str) and len(code) >= 2 and code[0] in _NUMPY_KINDS):
            raise ValueError(f"numpy dtype {bounded_repr(code, 200)} is not a plain number type")
        if not code[1:].isdigit() or int(code[1:]) not in (1, 2, 4, 8):
            raise ValueError(f"numpy dtype {bounded_repr(code, 200)} has an unsupported size")
        object.__setattr__(self, "code", code)
        object.__setattr__(self, "byteorder", "|" if code[1:] == "1" else "<")

    def __setstate__(self, state: Any) -> None:
        """numpy pickles ``(version, byteorder, subdtype, names, fields, ...)``: only a
        plain dtype without names, fields or subarray is accepted."""
        if not isinstance(state, tuple) or len(state) < 5:
            raise ValueError(f"numpy dtype state {bounded_repr(state, 200)} is malformed")
        _, order, subarray, names, fields = state[:5]
        if subarray is not None or names is not None or fields is not None:
            raise ValueError("structured or subarray numpy dtypes are not supported")
        if order not in ("<", "|", "="):
            raise ValueError(f"numpy byte order {bounded_repr(order, 200)} is not little-endian")
        object.__setattr__(self, "byteorder", order)

    @property
    def itemsize(self) -> int:
        return int(self.code[1:])

    @property
    def struct_code(self) -> str:
        kind, size = self.code[0], self.itemsize
        return {"b": "?", "i": "bhiq", "u": "BHIQ", "f": "?ehfd"}[kind][
            0 if kind == "b" else [1, 2, 4, 8].index(size) + (kind == "f")
        ]

    def __repr__(self) -> str:
        return f"numpy.dtype({self.code!r})"


class NumpyArray(metaclass=FrozenClass):
    """``numpy.ndarray`` rebuilt by ``_reconstruct`` + BUILD: shape, dtype and raw bytes,
    checked to agree (no element is allocated that the file does not hold)."""

    def __init__(self, *args: Any) -> None:
        self.shape: tuple[int, ...] = ()
        self.dtype: NumpyDtype | None = None
        self.data = b""
        self.fortran = False

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != 5:
            raise ValueError(f"numpy array state {bounded_repr(state, 200)} is malformed")
        _, shape, dtype, fortran, data = state
        if not isinstance(dtype, NumpyDtype) or type(fortran) is not bool:
            raise ValueError("numpy array of an unsupported dtype or order")
        if not (isinstance(shape, tuple) and all(type(n) is int and n >= 0 for n in shape)):
            raise ValueError(f"numpy array shape {bounded_repr(shape, 200)} is malformed")
        if not isinstance(data, (bytes, bytearray, str)) or len(data) != math.prod(shape) * (
            dtype.itemsize
        ):
            raise ValueError("numpy array has data of the wrong size for its shape")
        if not isinstance(data, bytes):
            budget.charge(len(data), "numpy array data")
            data = data.encode("latin-1") if isinstance(data, str) else bytes(data)
        self.shape, self.dtype, self.data, self.fortran = shape, dtype, data, fortran

    def to_numpy(self) -> Any:
        """The array, built from its checked bytes with ``numpy.frombuffer``."""
        import numpy

        if self.dtype is None:
            return numpy.empty(self.shape)
        flat = numpy.frombuffer(self.data, dtype=self.dtype.code)
        return flat.reshape(self.shape, order="F" if self.fortran else "C").copy()

    def __repr__(self) -> str:
        code = self.dtype.code if self.dtype else "?"
        return f"<numpy.ndarray {code} {list(self.shape)} (decoded as bytes)>"


def numpy_scalar(dtype: Any, data: Any) -> Any:
    """``numpy.core.multiarray.scalar(dtype, bytes)``: the value as a Python number."""
    if not isinstance(dtype, NumpyDtype):
        raise ValueError("numpy scalar of an unsupported dtype")
    if isinstance(data, str) and len(data) == dtype.itemsize:
        data = data.encode("latin-1")
    if not isinstance(data, bytes) or len(data) != dtype.itemsize:
        raise ValueError("numpy scalar data has the wrong size")
    return struct.unpack("<" + dtype.struct_code, data)[0]


def numpy_reconstruct(cls: Any, shape: Any, code: Any) -> NumpyArray:
    """``numpy.core.multiarray._reconstruct(ndarray, (0,), b'b')``: an empty array to BUILD."""
    if cls is not NumpyArray:
        raise ValueError(f"_reconstruct of {bounded_repr(cls, 200)} is not supported")
    return NumpyArray()
