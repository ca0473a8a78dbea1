"""What each global a pickle names resolves to: safe stand-ins for the few that genuine
checkpoints need, refusal for code-execution entry points, placeholders for the rest.

Nothing here imports torch or numpy: torch's dtypes, storages and rebuild functions
become names and descriptions (:mod:`.records`), numpy arrays checked byte strings.
Every stand-in a pickle can reach is immutable (see :mod:`.records`).
"""

from __future__ import annotations

import functools
import io
import math
import pathlib
import re
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any

from inspector import dtypes
from inspector.formats.dcp import metadata as dcp_metadata
from inspector.formats.safe_pickle import budget, deepspeed, dtensor, stdlib
from inspector.formats.safe_pickle.records import (
    PARAMETER,
    TENSOR,
    Allowed,
    BrokenTensor,
    DtypeName,
    Marker,
    NumpyArray,
    NumpyDtype,
    Opaque,
    StorageRef,
    StorageType,
    SubclassRef,
    TensorRef,
    UnknownDtype,
    numpy_reconstruct,
    numpy_scalar,
)
from inspector.reprs import bounded_repr

# Modules (by top-level package) and names whose only use in a pickle is running code.
_DANGEROUS_MODULES = frozenset(
    [
        "os",
        "posix",
        "nt",
        "posixpath",
        "ntpath",
        "subprocess",
        "_posixsubprocess",
        "sys",
        "importlib",
        "runpy",
        "shutil",
        "socket",
        "ctypes",
        "_ctypes",
        "pickle",
        "_pickle",
        "marshal",
        "code",
        "codeop",
        "pty",
        "multiprocessing",
        "webbrowser",
        "types",
        "functools",
        "operator",
        "tempfile",
        "glob",
        "asyncio",
        "threading",
        "_thread",
        "signal",
        "_signal",
        "pdb",
        "timeit",
        "trace",
        "cProfile",
        "profile",
        "platform",
        "sysconfig",
        "ensurepip",
        "venv",
        "pip",
        "setuptools",
        "distutils",
        "zipimport",
        "pkgutil",
        "inspect",
        "gc",
        "weakref",
        "ast",
        "dis",
        "builtins",
        "__builtin__",
        "io",
        "_io",
        "codecs",
        "_codecs",
        "shlex",
        "commands",
        "popen2",
        "requests",
        "urllib",
        "http",
        "ftplib",
        "smtplib",
        "telnetlib",
        "xmlrpc",
        "dill",
    ]
)
_DANGEROUS_TORCH = (
    "torch.load",
    "torch.hub",
    "torch.jit",
    "torch.package",
    "torch.ops",
    "torch._ops",
    "torch.serialization",
    "torch.fx",
    "torch._dynamo",
    "torch._inductor",
    "torch.utils",
    "torch._C",
    "torch.compile",
    "torch.export",
    "torch.library",
    "torch.cuda",
)
_MAX_BUILTIN_BYTES = 1 << 26
# Copies this short (torch.Size of a chunk's offsets, once per chunk) are not charged: each
# call takes at least 4 bytes of pickle, so together they build at most twice its size.
_UNCHARGED_COPY = 8
_MAX_DIMS = 64
_MAX_INT = 1 << 62  # beyond any genuine size, offset or stride (and small enough to print)


def _encoded_size(text: str, encoding: Any) -> int:
    """The most bytes ``text`` encodes to (one per character in latin-1)."""
    latin = isinstance(encoding, str) and encoding.lower().replace("-", "") == "latin1"
    return len(text) * (1 if latin else 4)


class _Copying(Allowed):
    """``kind(iterable)`` (``list``, ``set``, ``dict``, ...), charged by the length of what it
    copies (one call frame: ``torch.Size`` is called for every chunk of a ``.metadata``)."""

    __slots__ = ()

    def __call__(self, *args: Any) -> Any:
        if args and len(args[0]) > _UNCHARGED_COPY:
            budget.charge(len(args[0]), f"{self.name}() of a memoised value")
        return self._fn(*args)


def _sized(kind: type) -> Callable[..., Any]:
    """``bytes(n)`` / ``bytearray(n)`` (zeros) or of a string or a buffer, charged by the
    bytes it makes, each call also capped: a tiny pickle must not allocate gigabytes."""

    def build(*args: Any) -> Any:
        source = args[0] if args else b""
        if isinstance(source, int):
            size = source
        elif isinstance(source, str):
            size = _encoded_size(source, args[1] if len(args) > 1 else None)
        else:
            size = len(source)
        if size > _MAX_BUILTIN_BYTES:
            raise ValueError(f"{kind.__name__} of {size} bytes is larger than any genuine value")
        budget.charge(size, f"{kind.__name__}()")
        return kind(*args)

    return build


def _text(value: Any = "") -> str:
    """``str(x)`` (and ``torch.torch_version.TorchVersion``) of text or a number only: the
    text of a container could be gigabytes."""
    if not isinstance(value, (str, int, float)):
        raise ValueError(f"str() of a {type(value).__name__} is never part of a checkpoint")
    return str(value)


_TUPLE = _Copying(tuple, "builtins.tuple")
_TEXT = Allowed(_text, "builtins.str")
_SAFE_BUILTINS: dict[str, Any] = {
    "set": _Copying(set, "builtins.set"),
    "frozenset": _Copying(frozenset, "builtins.frozenset"),
    "bytearray": Allowed(_sized(bytearray), "builtins.bytearray"),
    "complex": complex,
    "slice": slice,
    "int": int,
    "float": float,
    "str": _TEXT,
    "bytes": Allowed(_sized(bytes), "builtins.bytes"),
    "bool": bool,
    "list": _Copying(list, "builtins.list"),
    "dict": _Copying(dict, "builtins.dict"),
    "tuple": _TUPLE,
    "object": object,
}

# ---------------------------------------------------------------------------------------
# Rebuild functions: what torch's own _rebuild_* become.


def _ints(value: Any, what: str) -> tuple[int, ...]:
    """A size or stride: at most 64 plain ints in ``[0, 2**62)`` (so every message can
    print it), whose product is below ``2**62`` too."""
    if not isinstance(value, (tuple, list)) or len(value) > _MAX_DIMS:
        raise ValueError(f"{what} must be a tuple of at most {_MAX_DIMS} ints")
    if not all(type(v) is int and 0 <= v < _MAX_INT for v in value):
        raise ValueError(f"{what} must be made of ints in [0, 2**62), got {bounded_repr(value)}")
    if math.prod(value) >= _MAX_INT:
        raise ValueError(f"{what} {list(value)} has more than 2**62 elements")
    return tuple(value)


def _dtype(value: Any) -> str:
    if not isinstance(value, DtypeName):
        raise ValueError(f"bad dtype {bounded_repr(value, 200)}")
    return str(value)


def _tensor_ref(
    storage: Any, offset: Any, size: Any, stride: Any, dtype: Any, grad: Any
) -> TensorRef | BrokenTensor:
    """The tensor's description, or why it describes none (only its key is marked)."""
    try:
        return _checked_tensor_ref(storage, offset, size, stride, dtype, grad)
    except ValueError as exc:
        return BrokenTensor(str(exc))


def _checked_tensor_ref(
    storage: Any, offset: Any, size: Any, stride: Any, dtype: Any, grad: Any
) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise ValueError(f"tensor storage is {type(storage).__name__}, not a storage record")
    if type(offset) is not int or not 0 <= offset < _MAX_INT:
        raise ValueError(f"bad storage offset {bounded_repr(offset)}")
    shape, strides = _ints(size, "size"), _ints(stride, "stride")
    if len(shape) != len(strides):
        raise ValueError(f"size {shape} and stride {strides} differ in length")
    ref = TensorRef(storage, offset, shape, strides, _dtype(dtype), bool(grad))
    if ref.extent and offset + ref.extent > storage.numel:
        raise ValueError(
            f"tensor {list(shape)} at element {offset} reaches past its storage "
            f"of {storage.numel} elements"
        )
    return ref


def _rebuild_tensor(
    storage: Any, storage_offset: Any, size: Any, stride: Any
) -> TensorRef | BrokenTensor:
    dtype = DtypeName(storage.dtype) if isinstance(storage, StorageRef) else None
    return _tensor_ref(storage, storage_offset, size, stride, dtype, False)


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    metadata: Any = None,
) -> TensorRef | BrokenTensor:
    dtype = DtypeName(storage.dtype) if isinstance(storage, StorageRef) else None
    return _tensor_ref(storage, storage_offset, size, stride, dtype, requires_grad)


def _rebuild_tensor_v3(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> TensorRef | BrokenTensor:
    if isinstance(storage, StorageRef) and isinstance(dtype, DtypeName):
        width = dtypes.itemsize(dtype)
        if storage.dtype != "uint8" or storage.numel % width:
            return BrokenTensor(f"untyped storage of {storage.numel} bytes cannot hold {dtype}")
        storage = StorageRef(storage.key, str(dtype), storage.numel // width)
    return _tensor_ref(storage, storage_offset, size, stride, dtype, requires_grad)


def _rebuild_meta(dtype: Any, size: Any, stride: Any, requires_grad: Any) -> TensorRef:
    return TensorRef(
        None, 0, _ints(size, "size"), _ints(stride, "stride"), _dtype(dtype), bool(requires_grad)
    )


def _rebuild_parameter(
    data: Any, requires_grad: Any, backward_hooks: Any, state: Any = None
) -> Any:
    return data


def _rebuild_wrapper_subclass(
    cls: Any,
    dtype: Any,
    size: Any,
    stride: Any,
    storage_offset: Any,
    layout: Any,
    device: Any,
    requires_grad: Any,
) -> SubclassRef:
    name = getattr(cls, "global_name", None) or bounded_repr(cls, 200)
    outer = str(dtype) if isinstance(dtype, DtypeName) else None
    return SubclassRef(str(name), outer, _ints(size, "size"))


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if not callable(func) or not isinstance(args, tuple):
        raise ValueError(f"{bounded_repr(func, 200)} is not a rebuild function")
    value = func(*args)
    if isinstance(state, tuple) and len(state) == 2:
        parts = [part or {} for part in state]
        budget.charge(sum(map(len, parts)), "tensor subclass state")
        state = {**parts[0], **parts[1]}
    if isinstance(state, dict):
        budget.charge(len(state), "tensor subclass state")
    if new_type in (TENSOR, PARAMETER) or not isinstance(new_type, type):
        return value
    if isinstance(value, SubclassRef):
        attrs = {**value.attrs, **state} if isinstance(state, dict) else value.attrs
        return SubclassRef(value.cls, value.dtype, value.shape, attrs, value.data)
    if isinstance(value, TensorRef) and issubclass(new_type, Opaque):
        attrs = dict(state) if isinstance(state, dict) else {}
        return SubclassRef(new_type.global_name, value.dtype, value.shape, attrs, data=value)
    return value


def _defaultdict(factory: Any = None, *items: Any) -> defaultdict:
    """``collections.defaultdict(factory)``: the factory is kept, never called (a decoded
    value is read, not added to)."""
    if items:
        budget.charge(len(items[0]), "defaultdict()")
    return defaultdict(factory, *items)


def _codecs_encode(text: Any, encoding: str = "utf-8") -> bytes:
    """Protocol-2 pickles spell ``bytes`` as ``_codecs.encode(str, 'latin1')``."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise ValueError(
            f"refusing _codecs.encode({type(text).__name__}, {bounded_repr(encoding, 200)})"
        )
    if len(text) > _MAX_BUILTIN_BYTES:
        raise ValueError("_codecs.encode of a string larger than any genuine value")
    budget.charge(_encoded_size(text, encoding), "_codecs.encode")
    return text.encode(encoding)


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    """``copyreg._reconstructor`` (protocol 0/1 objects), limited to placeholders and builtins."""
    if isinstance(cls, type) and issubclass(cls, Opaque):
        return cls(state) if state is not None else cls()
    if base in (object,) and cls in (object,):
        return object()
    if cls is base and base in _SAFE_BUILTINS.values():
        return base(state) if state is not None else base()
    raise ValueError(
        f"copyreg._reconstructor({bounded_repr(cls, 200)}, {bounded_repr(base, 200)}) "
        "is not allowed"
    )


# torch's legacy typed storage classes (``torch.FloatStorage``, ...) and their dtypes.
LEGACY_STORAGE_DTYPES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}
_LEGACY_STORAGE = {name: StorageType(dtype) for name, dtype in LEGACY_STORAGE_DTYPES.items()}
_UNTYPED = StorageType(None)
_LAYOUTS = frozenset(
    [
        "strided",
        "sparse_coo",
        "sparse_csr",
        "sparse_csc",
        "sparse_bsr",
        "sparse_bsc",
        "_mkldnn",
        "jagged",
    ]
)
_MEMORY_FORMATS = frozenset(
    ["contiguous_format", "channels_last", "channels_last_3d", "preserve_format"]
)
_NAMED = {n: Marker(f"torch.{n}") for n in _LAYOUTS | _MEMORY_FORMATS}
_DTYPE_NAME = re.compile(r"[a-z][a-z0-9_]*")
_DTYPES = {name: DtypeName(name) for name in dtypes.NAMES} | {
    alias: DtypeName(name) for alias, name in dtypes.ALIASES.items()
}


def _torch_global(name: str) -> Any:
    """``torch.<name>``: a dtype (as its name), a layout or memory format (as its name),
    ``Size`` (a tuple), a storage class, or the Tensor marker; None for anything else."""
    if name in _DTYPES:
        return _DTYPES[name]
    if name in _NAMED:
        return _NAMED[name]
    if name == "Size":
        return _TUPLE
    if name == "device":
        return _DEVICE
    if name == "Tensor":
        return TENSOR
    if name == "UntypedStorage":
        return _UNTYPED
    return _LEGACY_STORAGE.get(name)


def _device(kind: Any, index: Any = None) -> str:
    if not isinstance(kind, str) or (index is not None and not isinstance(index, int)):
        raise ValueError(f"bad torch.device({bounded_repr((kind, index), 200)})")
    return kind if index is None else f"{kind}:{index}"


_DEVICE = Allowed(_device, "torch.device")


def _get_layout(name: Any) -> Marker:
    layout = name.removeprefix("torch.") if isinstance(name, str) else None
    if layout not in _LAYOUTS:
        raise ValueError(f"unknown layout {bounded_repr(name, 200)}")
    return _NAMED[layout]


def _path_parts(parts: tuple[Any, ...]) -> tuple[str, ...]:
    if not all(isinstance(p, str) for p in parts):
        raise ValueError("a pickled path is made of strings")
    budget.charge(sum(map(len, parts)), "a path")
    return parts


def _pure_path(*parts: Any) -> pathlib.PurePath:
    return pathlib.PurePosixPath(*_path_parts(parts))


def _pure_windows_path(*parts: Any) -> pathlib.PurePath:
    return pathlib.PureWindowsPath(*_path_parts(parts))


_PATH_CLASSES = {
    "PosixPath": Allowed(_pure_path, "pathlib.PurePosixPath"),
    "PurePosixPath": Allowed(_pure_path, "pathlib.PurePosixPath"),
    "Path": Allowed(_pure_path, "pathlib.PurePosixPath"),
    "WindowsPath": Allowed(_pure_windows_path, "pathlib.PureWindowsPath"),
    "PureWindowsPath": Allowed(_pure_windows_path, "pathlib.PureWindowsPath"),
}


def _allowed(module: str, functions: dict[str, Callable[..., Any]]) -> dict[tuple[str, str], Any]:
    return {(module, n): Allowed(fn, f"{module}.{n}") for n, fn in functions.items()}


_DATA_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): _Copying(OrderedDict, "collections.OrderedDict"),
    ("collections", "defaultdict"): Allowed(_defaultdict, "collections.defaultdict"),
    ("_io", "BytesIO"): io.BytesIO,
    ("io", "BytesIO"): io.BytesIO,
    ("torch.storage", "UntypedStorage"): _UNTYPED,
    ("torch.nn.parameter", "Parameter"): PARAMETER,
    ("torch.torch_version", "TorchVersion"): _TEXT,
    **_allowed("_codecs", {"encode": _codecs_encode}),
    **_allowed("copyreg", {"_reconstructor": _reconstructor}),
    **_allowed(
        "torch._utils",
        {
            "_rebuild_tensor": _rebuild_tensor,
            "_rebuild_tensor_v2": _rebuild_tensor_v2,
            "_rebuild_tensor_v3": _rebuild_tensor_v3,
            "_rebuild_parameter": _rebuild_parameter,
            "_rebuild_parameter_with_state": _rebuild_parameter,
            "_rebuild_wrapper_subclass": _rebuild_wrapper_subclass,
            "_rebuild_meta_tensor_no_storage": _rebuild_meta,
        },
    ),
    **_allowed(
        "torch._tensor",
        {"_rebuild_from_type_v2": _rebuild_from_type, "_rebuild_from_type": _rebuild_from_type},
    ),
    **_allowed("torch.serialization", {"_get_layout": _get_layout}),
}
_DATA_GLOBALS |= dtensor.GLOBALS | stdlib.GLOBALS | deepspeed.GLOBALS
for _module in ("numpy", "numpy.core.multiarray", "numpy._core.multiarray"):
    _DATA_GLOBALS |= {
        (_module, "ndarray"): NumpyArray,
        (_module, "dtype"): NumpyDtype,
        **_allowed(_module, {"_reconstruct": numpy_reconstruct, "scalar": numpy_scalar}),
    }


# ``torch.Size`` in ``.metadata``, called for every chunk (200k times in a large file): torch
# pickles it as ``torch.Size(<tuple>)``, so the stand-in is that tuple. ``().__add__`` returns
# an exact tuple unchanged (a memoised one called a million times copies nothing) and refuses
# any other argument; being C, it costs no Python frame, and a method-wrapper has no state a
# pickle could change.
_METADATA_SIZE = ().__add__


@functools.cache
def _metadata_table() -> dict[tuple[str, str], Any]:
    """Built on first use, so that ``inspector.formats.dcp.metadata`` (whose classes it
    holds) can be imported first."""
    names: dict[tuple[str, str], Any] = dict(dcp_metadata.CLASSES)
    names[("torch", "Size")] = _METADATA_SIZE
    names[("torch.serialization", "_get_layout")] = _DATA_GLOBALS[
        ("torch.serialization", "_get_layout")
    ]
    for module in ("pathlib", "pathlib._local"):
        for cls, fn in _PATH_CLASSES.items():
            names[(module, cls)] = fn
    return names


def metadata_global(module: str, name: str) -> Any:
    """What a global in DCP ``.metadata`` stands for; None: never part of genuine metadata."""
    value = _metadata_table().get((module, name))
    if value is None and module == "torch":
        value = _DTYPES.get(name)
        if value is None and _DTYPE_NAME.fullmatch(name) and name not in _NAMED:
            value = UnknownDtype(name)
    return value


def is_dangerous(module: str, name: str) -> bool:
    """Whether the global's only use in a pickle is running code (refused outright)."""
    root = module.split(".")[0]
    full = f"{module}.{name}"
    if root in ("builtins", "__builtin__"):
        return name not in _SAFE_BUILTINS
    if (module, name) in _DATA_GLOBALS:
        return False
    if root in _DANGEROUS_MODULES:
        return True
    return root == "torch" and any(full == d or full.startswith(d + ".") for d in _DANGEROUS_TORCH)


def data_global(module: str, name: str) -> Any:
    """The safe stand-in for a global in a ``data.pkl`` or pickled object; None: unknown
    (the unpickler puts an inert placeholder there)."""
    if module in ("builtins", "__builtin__"):
        return _SAFE_BUILTINS.get(name)
    value = _DATA_GLOBALS.get((module, name))
    if value is None and module == "torch":
        value = _torch_global(name)
    if value is None and module in ("pathlib", "pathlib._local"):
        value = _PATH_CLASSES.get(name)
    return value
