"""What each global a pickle names resolves to: safe stand-ins for the few genuine
checkpoints need, refusal for code-execution entry points, placeholders for the rest."""

from __future__ import annotations

import io
import pathlib
import re
from collections import OrderedDict, defaultdict
from typing import Any

import torch

from inspector.formats.dcp import metadata as dcp_metadata
from inspector.formats.safe_pickle.records import (
    Opaque,
    StorageRef,
    StorageType,
    SubclassRef,
    TensorRef,
    UnknownDtype,
)

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


def _sized(kind: type) -> Any:
    """``bytes(n)`` / ``bytearray(n)`` would let a tiny pickle allocate gigabytes."""

    def build(*args: Any) -> Any:
        if args and isinstance(args[0], int) and args[0] > _MAX_BUILTIN_BYTES:
            raise ValueError(f"{kind.__name__}({args[0]}) is larger than any genuine value")
        return kind(*args)

    return build


_SAFE_BUILTINS = {
    "set": set,
    "frozenset": frozenset,
    "bytearray": _sized(bytearray),
    "complex": complex,
    "slice": slice,
    "int": int,
    "float": float,
    "str": str,
    "bytes": _sized(bytes),
    "bool": bool,
    "list": list,
    "dict": dict,
    "tuple": tuple,
    "object": object,
}


# ---------------------------------------------------------------------------------------
# Rebuild functions: what torch's own _rebuild_* become.


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list, torch.Size)) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(f"{what} must be a tuple of ints, got {value!r}")
    if any(v < 0 for v in value):
        raise ValueError(f"{what} has a negative entry: {tuple(value)}")
    return tuple(value)


def _tensor_ref(
    storage: Any, offset: Any, size: Any, stride: Any, dtype: Any, grad: Any
) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise ValueError(f"tensor storage is {type(storage).__name__}, not a storage record")
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"bad storage offset {offset!r}")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"bad dtype {dtype!r}")
    shape, strides = _ints(size, "size"), _ints(stride, "stride")
    if len(shape) != len(strides):
        raise ValueError(f"size {shape} and stride {strides} differ in length")
    return TensorRef(storage, offset, shape, strides, dtype, bool(grad))


def _rebuild_tensor(storage, storage_offset, size, stride):
    return _tensor_ref(
        storage, storage_offset, size, stride, getattr(storage, "dtype", None), False
    )


def _rebuild_tensor_v2(
    storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None
):
    return _tensor_ref(
        storage, storage_offset, size, stride, getattr(storage, "dtype", None), requires_grad
    )


def _rebuild_tensor_v3(
    storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None
):
    if isinstance(storage, StorageRef) and isinstance(dtype, torch.dtype):
        if storage.dtype != torch.uint8 or storage.numel % dtype.itemsize:
            raise ValueError(f"untyped storage of {storage.numel} bytes cannot hold {dtype}")
        storage = StorageRef(storage.key, dtype, storage.numel // dtype.itemsize)
    return _tensor_ref(storage, storage_offset, size, stride, dtype, requires_grad)


def _rebuild_meta(dtype, size, stride, requires_grad):
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"bad dtype {dtype!r}")
    return TensorRef(
        None, 0, _ints(size, "size"), _ints(stride, "stride"), dtype, bool(requires_grad)
    )


def _rebuild_parameter(data, requires_grad, backward_hooks, state=None):
    return data


def _rebuild_wrapper_subclass(
    cls, dtype, size, stride, storage_offset, layout, device, requires_grad
):
    name = getattr(cls, "global_name", getattr(cls, "__name__", repr(cls)))
    return SubclassRef(name, dtype if isinstance(dtype, torch.dtype) else None, _ints(size, "size"))


def _rebuild_from_type(func, new_type, args, state):
    if not callable(func):
        raise ValueError(f"{func!r} is not a rebuild function")
    value = func(*args)
    if isinstance(state, tuple) and len(state) == 2:
        state = {**(state[0] or {}), **(state[1] or {})}
    if new_type in (torch.Tensor, torch.nn.Parameter) or not isinstance(new_type, type):
        return value
    if isinstance(value, SubclassRef):
        if isinstance(state, dict):
            value.attrs.update(state)
        return value
    if isinstance(value, TensorRef) and issubclass(new_type, Opaque):
        attrs = dict(state) if isinstance(state, dict) else {}
        return SubclassRef(new_type.global_name, value.dtype, value.shape, attrs, data=value)
    return value


def _codecs_encode(text: Any, encoding: str = "utf-8") -> bytes:
    """Protocol-2 pickles spell ``bytes`` as ``_codecs.encode(str, 'latin1')``."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise ValueError(f"refusing _codecs.encode({type(text).__name__}, {encoding!r})")
    return text.encode(encoding)


def _reconstructor(cls, base, state):
    """``copyreg._reconstructor`` (protocol 0/1 objects), limited to placeholders and builtins."""
    if isinstance(cls, type) and issubclass(cls, Opaque):
        return cls(state) if state is not None else cls()
    if base in (object,) and cls in (object,):
        return object()
    if cls is base and base in _SAFE_BUILTINS.values():
        return base(state) if state is not None else base()
    raise ValueError(f"copyreg._reconstructor({cls!r}, {base!r}) is not allowed")


def _torch_global(name: str) -> Any:
    value = getattr(torch, name, None)
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return value
    if name == "Size":
        return torch.Size
    if name == "device":
        return torch.device
    if name in ("Tensor",):
        return torch.Tensor
    if name.endswith("Storage"):
        return _LEGACY_STORAGE.get(name)
    return None


# torch's legacy typed storage classes (``torch.FloatStorage``, ...) and their dtypes.
LEGACY_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}
_LEGACY_STORAGE = {name: StorageType(dtype) for name, dtype in LEGACY_STORAGE_DTYPES.items()}


def _get_layout(name: Any) -> torch.layout:
    layout = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(layout, torch.layout):
        raise ValueError(f"unknown layout {name!r}")
    return layout


def _pure_path(*parts: Any) -> pathlib.PurePath:
    return pathlib.PurePosixPath(*(str(p) for p in parts))


def _pure_windows_path(*parts: Any) -> pathlib.PurePath:
    return pathlib.PureWindowsPath(*(str(p) for p in parts))


_PATH_CLASSES = {
    "PosixPath": _pure_path,
    "PurePosixPath": _pure_path,
    "Path": _pure_path,
    "WindowsPath": _pure_windows_path,
    "PureWindowsPath": _pure_windows_path,
}

_DATA_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("collections", "defaultdict"): defaultdict,
    ("_codecs", "encode"): _codecs_encode,
    ("copyreg", "_reconstructor"): _reconstructor,
    ("_io", "BytesIO"): io.BytesIO,
    ("io", "BytesIO"): io.BytesIO,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch._utils", "_rebuild_meta_tensor_no_storage"): _rebuild_meta,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch._tensor", "_rebuild_from_type"): _rebuild_from_type,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("torch.storage", "UntypedStorage"): StorageType(None),
    ("torch", "UntypedStorage"): StorageType(None),
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch.torch_version", "TorchVersion"): str,
}


def _metadata_table() -> dict[tuple[str, str], Any]:
    names: dict[tuple[str, str], Any] = dict(dcp_metadata.CLASSES)
    names[("torch", "Size")] = tuple
    names[("torch.serialization", "_get_layout")] = _get_layout
    for module in ("pathlib", "pathlib._local"):
        for cls, fn in _PATH_CLASSES.items():
            names[(module, cls)] = fn
    return names


_METADATA_GLOBALS = _metadata_table()
_DTYPE_NAME = re.compile(r"[a-z][a-z0-9_]*")


def metadata_global(module: str, name: str) -> Any:
    """What a global in DCP ``.metadata`` stands for; None: never part of genuine metadata."""
    value = _METADATA_GLOBALS.get((module, name))
    if value is None and module == "torch":
        value = _torch_global(name)
        if not isinstance(value, torch.dtype):
            value = None
        if not hasattr(torch, name) and _DTYPE_NAME.fullmatch(name):
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
    if value is None:
        value = _numpy_global(module, name)
    return value


def _numpy_global(module: str, name: str) -> Any:
    if module not in ("numpy", "numpy.core.multiarray", "numpy._core.multiarray"):
        return None
    if name not in ("_reconstruct", "scalar", "ndarray", "dtype"):
        return None
    import numpy

    if name == "ndarray":
        return numpy.ndarray
    if name == "dtype":
        return numpy.dtype
    multiarray = getattr(numpy, "_core", None) or numpy.core
    return getattr(multiarray.multiarray, name)
