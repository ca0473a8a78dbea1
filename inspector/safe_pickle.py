"""The only place that unpickles anything.

Every global a pickle names is resolved here, never imported: an allow-list maps the
few that genuine checkpoints need to safe stand-ins, known code-execution entry points
raise :class:`UnsafeCheckpointError`, and everything else becomes an inert
:class:`Opaque` placeholder that records what it was given and does nothing.
Tensors are not built while unpickling: a torch archive's ``data.pkl`` yields
:class:`TensorRef` / :class:`SubclassRef` descriptions that a source materialises later.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import pickletools
import re
from collections import OrderedDict, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch

from inspector import dcp_metadata
from inspector.errors import (
    CorruptCheckpointError,
    InspectorError,
    UnsafeCheckpointError,
    UnsupportedError,
)
from inspector.gc_pause import paused_gc

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
class _StorageType:
    dtype: torch.dtype | None  # None: UntypedStorage (bytes; the real dtype comes later)


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
_LEGACY_STORAGE = {name: _StorageType(dtype) for name, dtype in LEGACY_STORAGE_DTYPES.items()}


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
    ("torch.storage", "UntypedStorage"): _StorageType(None),
    ("torch", "UntypedStorage"): _StorageType(None),
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch.torch_version", "TorchVersion"): str,
}


def _metadata_globals() -> dict[tuple[str, str], Any]:
    names = dict(dcp_metadata.CLASSES)
    names[("torch", "Size")] = tuple
    names[("torch.serialization", "_get_layout")] = _get_layout
    for module in ("pathlib", "pathlib._local"):
        for cls, fn in _PATH_CLASSES.items():
            names[(module, cls)] = fn
    return names


def _is_dangerous(module: str, name: str) -> bool:
    root = module.split(".")[0]
    full = f"{module}.{name}"
    if root in ("builtins", "__builtin__"):
        return name not in _SAFE_BUILTINS
    if (module, name) in _DATA_GLOBALS:
        return False
    if root in _DANGEROUS_MODULES:
        return True
    return root == "torch" and any(full == d or full.startswith(d + ".") for d in _DANGEROUS_TORCH)


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


# ---------------------------------------------------------------------------------------
# Unpicklers


class _Unpickler(pickle.Unpickler):
    """Resolves globals through ``resolve``; refuses persistent ids unless a subclass maps them."""

    def __init__(self, data: bytes | BinaryIO, file: str, key: str | None) -> None:
        self.stream = io.BytesIO(data) if isinstance(data, bytes) else data
        super().__init__(self.stream)
        self.file, self.key = file, key

    def resolve(self, module: str, name: str) -> Any:
        raise NotImplementedError

    def find_class(self, module: str, name: str) -> Any:
        if not isinstance(module, str) or not isinstance(name, str):
            raise self.unsafe(f"non-string global {module!r}.{name!r}")
        return self.resolve(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")

    def unsafe(self, what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"pickle refers to {what}, which could run code; refused (nothing was executed)",
            file=self.file,
            key=self.key,
        )


@dataclass(frozen=True)
class UnknownDtype:
    """``torch.<name>`` where this torch has no such attribute: a dtype of a newer torch,
    or damage. Kept by name (inert, not callable) so only the entries using it fail."""

    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name} (unknown to torch {torch.__version__})"


_DTYPE_NAME = re.compile(r"[a-z][a-z0-9_]*")


class _MetadataUnpickler(_Unpickler):
    _allowed: dict[tuple[str, str], Any] | None = None

    def resolve(self, module: str, name: str) -> Any:
        if _MetadataUnpickler._allowed is None:
            _MetadataUnpickler._allowed = _metadata_globals()
        value = self._allowed.get((module, name))
        if value is None and module == "torch":
            value = _torch_global(name)
            if not isinstance(value, torch.dtype):
                value = None
            if not hasattr(torch, name) and _DTYPE_NAME.fullmatch(name):
                value = UnknownDtype(name)
        if value is None:
            raise self.unsafe(f"{module}.{name} (never part of DCP metadata)")
        return value


class _DataUnpickler(_Unpickler):
    """For torch archives' ``data.pkl`` and plain pickled objects."""

    def __init__(self, data: bytes | BinaryIO, file: str, key: str | None) -> None:
        super().__init__(data, file, key)
        self.placeholders: dict[str, type[Opaque]] = {}
        self.storages: dict[str, StorageRef] = {}

    def resolve(self, module: str, name: str) -> Any:
        if module in ("builtins", "__builtin__") and name in _SAFE_BUILTINS:
            return _SAFE_BUILTINS[name]
        if _is_dangerous(module, name):
            raise self.unsafe(f"{module}.{name}")
        value = _DATA_GLOBALS.get((module, name))
        if value is None and module == "torch":
            value = _torch_global(name)
        if value is None and module in ("pathlib", "pathlib._local"):
            value = _PATH_CLASSES.get(name)
        if value is None:
            value = _numpy_global(module, name)
        if value is None:
            label = f"{module}.{name}"
            value = self.placeholders.get(label) or opaque_class(module, name)
            self.placeholders[label] = value
        return value

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 4 and pid[0] == "module":
            return pid[1]  # pre-1.6 files name a saved module's class (already a placeholder)
        if isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage":
            if pid[5] is not None:
                raise UnsupportedError(
                    "storage views (files from torch < 1.0) are not supported",
                    file=self.file,
                    key=self.key,
                )
            pid = pid[:5]
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"storage type {storage_type!r} is not a torch storage")
        if not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
            raise pickle.UnpicklingError(f"bad storage record {key!r} of {numel!r} elements")
        ref = StorageRef(key, storage_type.dtype or torch.uint8, numel)
        self.storages.setdefault(key, ref)
        return ref


# --- sizes a pickle claims, checked before the C unpickler acts on them ----------------------
#
# The C unpickler sizes (and zeroes) its memo table up to the largest index a PUT names, so
# one opcode can take gigabytes; a FRAME announces its length. Genuine pickles number their
# memo entries from 0 and frame their own bytes, so anything beyond the pickle's size is a
# lie. The opcodes are read without building anything: runs of fixed-size opcodes by one
# regular expression, the rest one by one.


def _code(op: pickletools.OpcodeInfo) -> int:
    return op.code.encode("latin-1")[0]


_OPS = {op.name: _code(op) for op in pickletools.opcodes}
_FIXED = {
    _code(op): op.arg.n if op.arg else 0
    for op in pickletools.opcodes
    if not op.arg or op.arg.n >= 0
}
_VARIABLE = {_code(op): op.arg.n for op in pickletools.opcodes if op.arg and op.arg.n < 0}
_CHECKED = {_OPS["LONG_BINPUT"]: "LONG_BINPUT", _OPS["FRAME"]: "FRAME"}
_LENGTH_BYTES = {
    pickletools.TAKEN_FROM_ARGUMENT1: 1,
    pickletools.TAKEN_FROM_ARGUMENT4: 4,
    pickletools.TAKEN_FROM_ARGUMENT4U: 4,
    pickletools.TAKEN_FROM_ARGUMENT8U: 8,
}
_TWO_LINES = {_OPS["GLOBAL"], _OPS["INST"]}


def _opcode_run() -> re.Pattern[bytes]:
    """Any run of opcodes that need no check: fixed-size ones, and those with a one-byte
    length (spelled out per length, so short strings stay inside the run)."""

    def one_of(codes: list[int]) -> bytes:
        return b"[" + b"".join(re.escape(bytes([c])) for c in codes) + b"]"

    fixed = {c: n for c, n in _FIXED.items() if c not in _CHECKED and c != _OPS["STOP"]}
    tokens = [
        one_of([c for c, n in fixed.items() if n == size]) + b"." * size
        for size in sorted(set(fixed.values()))
    ]
    short = [c for c, n in _VARIABLE.items() if n == pickletools.TAKEN_FROM_ARGUMENT1]
    lengths = b"|".join(re.escape(bytes([n])) + b"." * n for n in range(256))
    tokens.append(one_of(short) + b"(?:" + lengths + b")")
    return re.compile(b"(?:" + b"|".join(tokens) + b")*", re.DOTALL)


_UNCHECKED_RUN = _opcode_run()


def _claimed_sizes(data: bytes) -> Iterator[tuple[str, int]]:
    """(opcode, claimed size) for every LONG_BINPUT, PUT and FRAME of the pickle in ``data``
    (BINPUT's one-byte index needs no check)."""
    i, end, frame_end = 0, len(data), 0
    while True:
        i = _UNCHECKED_RUN.match(data, i).end()
        if i >= end:
            raise ValueError("the pickle ends without a STOP opcode")
        op = data[i]
        if op == _OPS["STOP"]:
            return
        if op in _CHECKED and i + 1 + _FIXED[op] <= end:
            claimed = int.from_bytes(data[i + 1 : i + 1 + _FIXED[op]], "little")
            if op == _OPS["FRAME"]:
                if i < frame_end:  # the C unpickler answers a nested frame with MemoryError
                    raise ValueError(f"a frame begins at byte {i}, inside the previous one")
                frame_end = i + 9 + claimed
            yield _CHECKED[op], claimed
            i += 1 + _FIXED[op]
        elif _VARIABLE.get(op) == pickletools.UP_TO_NEWLINE:
            line_end = data.index(b"\n", i + 1)
            if op == _OPS["PUT"]:
                yield "PUT", int(data[i + 1 : line_end])
            i = line_end + 1
            if op in _TWO_LINES:
                i = data.index(b"\n", i) + 1
        elif op in _VARIABLE:
            width = _LENGTH_BYTES[_VARIABLE[op]]
            i += 1 + width + int.from_bytes(data[i + 1 : i + 1 + width], "little")
        else:
            known = "ends inside" if op in _FIXED else "has an unknown"
            raise ValueError(f"the pickle {known} opcode {op:#04x} at byte {i}")


def _check_sizes(unpickler: _Unpickler) -> None:
    """Refuse a pickle that claims more than its own size could justify (see above); the
    stream is left where it was."""
    stream = unpickler.stream
    start = stream.tell()
    if isinstance(stream, io.BytesIO):
        data = stream.getbuffer()[start:].tobytes()
        claims = _claimed_sizes(data)
        limit = len(data)
    else:  # a pre-1.6 file's pickles, read in place: pickletools finds their ends
        limit = stream.seek(0, os.SEEK_END) - start
        stream.seek(start)
        claims = (
            (op.name, arg)
            for op, arg, _ in pickletools.genops(stream)
            if op.name in ("PUT", "BINPUT", "LONG_BINPUT", "FRAME")
        )
    try:
        for name, claimed in claims:
            if claimed > limit:
                raise CorruptCheckpointError(
                    f"pickle opcode {name} claims {claimed}, more than its {limit} bytes "
                    "could ever need",
                    file=unpickler.file,
                    key=unpickler.key,
                )
    except (ValueError, IndexError) as exc:
        raise CorruptCheckpointError(
            f"not a well-formed pickle ({exc})", file=unpickler.file, key=unpickler.key
        ) from exc
    finally:
        stream.seek(start)


def _run(unpickler: _Unpickler) -> Any:
    try:
        _check_sizes(unpickler)
        with paused_gc():
            return unpickler.load()
    except InspectorError:
        raise
    except RecursionError as exc:
        raise CorruptCheckpointError(
            "pickle nests too deeply", file=unpickler.file, key=unpickler.key
        ) from exc
    except MemoryError:  # the machine's limit, not the file's fault (sizes are checked above)
        raise
    except Exception as exc:  # a malformed pickle can raise almost anything
        raise CorruptCheckpointError(
            f"cannot decode pickle ({type(exc).__name__}: {exc})",
            file=unpickler.file,
            key=unpickler.key,
        ) from exc


def load_metadata(data: bytes, *, file: str) -> dcp_metadata.Metadata:
    """Decode a DCP ``.metadata`` pickle into :mod:`inspector.dcp_metadata` records."""
    metadata = _run(_MetadataUnpickler(data, file, None))
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CorruptCheckpointError(
            f"pickle holds a {type(metadata).__name__}, not DCP Metadata", file=file
        )
    return metadata


def load_data_pickle(data: bytes, *, file: str, key: str | None = None) -> Any:
    """Decode a torch archive's ``data.pkl`` or a plain pickled object.

    Tensors come back as TensorRef / SubclassRef descriptions, unknown classes as Opaque.
    """
    return _run(_DataUnpickler(data, file, key))


_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


def load_legacy_torch(f: BinaryIO, *, file: str) -> tuple[Any, list[StorageRef]]:
    """Decode a pre-1.6 (non-zip) torch.save file's pickles, leaving ``f`` at its first storage.

    The file holds five pickles (magic number, format version, system info, the object,
    the storage keys) and then each storage's bytes; returns the object and the storages
    in file order.
    """
    if _run(_DataUnpickler(f, file, None)) != _LEGACY_MAGIC:
        raise CorruptCheckpointError("a pickle file, but not one torch.save wrote", file=file)
    version, sys_info = (_run(_DataUnpickler(f, file, None)) for _ in range(2))
    if version != _LEGACY_PROTOCOL:
        raise UnsupportedError(f"legacy torch.save format version {version!r}", file=file)
    if not isinstance(sys_info, dict) or sys_info.get("little_endian") is not True:
        raise UnsupportedError("legacy torch.save file from a big-endian machine", file=file)
    unpickler = _DataUnpickler(f, file, None)
    value = _run(unpickler)
    keys = _run(_DataUnpickler(f, file, None))
    if not isinstance(keys, list) or not all(k in unpickler.storages for k in keys):
        raise CorruptCheckpointError(
            "legacy torch.save storage list does not match the object's storages", file=file
        )
    return value, [unpickler.storages[k] for k in keys]


def referenced_globals(data: bytes) -> list[str]:
    """Names of the globals a pickle refers to, found by reading its opcodes (nothing runs)."""
    names: list[str] = []
    strings: list[str] = []
    try:
        for opcode, arg, _pos in pickletools.genops(data):
            if opcode.name in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", "."))
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str):
                strings.append(arg)
    except Exception:  # truncated or garbled: report what was seen so far
        pass
    return list(dict.fromkeys(names))
