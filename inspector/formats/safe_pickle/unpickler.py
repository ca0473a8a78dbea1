"""The only place that unpickles anything.

Every global a pickle names is resolved here, never imported, by one of three policies:
DCP ``.metadata`` resolves only the globals genuine metadata names; plain-data pickles
(torch_checkpointing's ``metadata.pkl``) resolve none at all; ``data.pkl`` and pickled
objects map the few globals genuine checkpoints need to safe stand-ins, refuse known
code-execution entry points with :class:`UnsafeCheckpointError`, and turn everything else
into an inert :class:`Opaque` placeholder that records what it was given and does nothing.
Tensors are not built while unpickling: a torch archive's ``data.pkl`` yields
:class:`TensorRef` / :class:`SubclassRef` descriptions that a source materialises later.
What a pickle builds is bounded by its size (:mod:`.prescan`, :mod:`.budget`), and what it
yields is checked to be a tree of bounded depth and size (:mod:`.walk`), so code walking it
cannot recurse or loop without end.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from typing import Any

from inspector.errors import (
    CorruptCheckpointError,
    InspectorError,
    UnsafeCheckpointError,
    UnsupportedError,
)
from inspector.formats.dcp import metadata as dcp_metadata
from inspector.formats.safe_pickle import budget, policy
from inspector.formats.safe_pickle.prescan import check_sizes
from inspector.formats.safe_pickle.records import Opaque, StorageRef, StorageType, opaque_class
from inspector.formats.safe_pickle.walk import walk_problem
from inspector.gc_pause import paused_gc
from inspector.reprs import bounded_repr
from inspector.storage.base import Stream

MAX_DEPTH = 200  # genuine checkpoints nest a few levels; code walking a value recurses per level
# Walked as a tree, a genuine pickle's value has about as many nodes as the pickle has bytes
# (a tied weight is two references to one tensor); sharing that multiplies it is damage.
_NODES_PER_BYTE = 16
_MIN_NODES = 1 << 16
_MAX_NUMEL = 1 << 62

# ---------------------------------------------------------------------------------------
# Unpicklers


class _Unpickler(pickle.Unpickler):
    """Resolves globals through ``resolve``; refuses persistent ids unless a subclass maps them."""

    def __init__(self, data: bytes | Stream, file: str, key: str | None) -> None:
        self.data = data if isinstance(data, bytes) else None
        self.stream = io.BytesIO(data) if isinstance(data, bytes) else data
        super().__init__(self.stream)
        self.file, self.key = file, key

    def resolve(self, module: str, name: str) -> Any:
        raise NotImplementedError

    def find_class(self, module: str, name: str) -> Any:
        if not isinstance(module, str) or not isinstance(name, str):
            raise self.unsafe(f"non-string global {bounded_repr((module, name), 200)}")
        return self.resolve(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"unexpected persistent id {bounded_repr(pid, 200)}")

    def unsafe(self, what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"pickle refers to {what}, which could run code; refused (nothing was executed)",
            file=self.file,
            key=self.key,
        )


class _MetadataUnpickler(_Unpickler):
    """For DCP ``.metadata``: only the globals a genuine file names; anything else is refused."""

    def resolve(self, module: str, name: str) -> Any:
        value = policy.metadata_global(module, name)
        if value is None:
            raise self.unsafe(f"{module}.{name} (never part of DCP metadata)")
        return value


class _PlainUnpickler(_Unpickler):
    """For pickles of plain data only (torch_checkpointing's ``metadata.pkl``): dicts, lists,
    tuples, strings, numbers, None. Every global is refused, whatever it names."""

    def resolve(self, module: str, name: str) -> Any:
        raise self.unsafe(f"{module}.{name} (this file holds plain data only)")


class DataUnpickler(_Unpickler):
    """For torch archives' ``data.pkl`` and plain pickled objects."""

    def __init__(self, data: bytes | Stream, file: str, key: str | None) -> None:
        super().__init__(data, file, key)
        self.placeholders: dict[str, type[Opaque]] = {}
        self.storages: dict[str, StorageRef] = {}

    def resolve(self, module: str, name: str) -> Any:
        if policy.is_dangerous(module, name):
            raise self.unsafe(f"{module}.{name}")
        value = policy.data_global(module, name)
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
            raise pickle.UnpicklingError(f"unexpected persistent id {bounded_repr(pid, 200)}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, StorageType):
            raise pickle.UnpicklingError(
                f"storage type {bounded_repr(storage_type, 200)} is not a torch storage"
            )
        if not isinstance(key, str) or type(numel) is not int or not 0 <= numel < _MAX_NUMEL:
            raise pickle.UnpicklingError(
                f"bad storage record {bounded_repr((key, numel), 200)} (key, elements)"
            )
        # As torch.load: a key seen before is that first storage again, whatever dtype and
        # size this mention claims (a tensor on it is read as torch would read it).
        return self.storages.setdefault(key, StorageRef(key, storage_type.dtype or "uint8", numel))


def run(unpickler: _Unpickler) -> Any:
    """Check, then unpickle; every failure is an InspectorError naming the file and key."""
    file, key = unpickler.file, unpickler.key
    try:
        size = check_sizes(unpickler.stream, file=file, key=key, data=unpickler.data)
        with paused_gc(), budget.budget(size):
            value = unpickler.load()
    except InspectorError:
        raise
    except RecursionError as exc:
        raise CorruptCheckpointError("pickle nests too deeply", file=file, key=key) from exc
    except MemoryError:  # the machine's limit, not the file's fault (sizes are checked above)
        raise
    except Exception as exc:  # a malformed pickle can raise almost anything
        raise CorruptCheckpointError(
            f"cannot decode pickle ({type(exc).__name__}: {_reason(exc)})", file=file, key=key
        ) from exc
    nodes = _NODES_PER_BYTE * max(size, _MIN_NODES)
    problem = walk_problem(value, max_depth=MAX_DEPTH, max_nodes=nodes)
    if problem is not None:
        raise CorruptCheckpointError(f"cannot use the pickle: {problem}", file=file, key=key)
    return value


def _reason(exc: BaseException) -> str:
    """The exception's text, cut (a message can quote what a pickle holds)."""
    try:
        text = str(exc)
    except Exception:  # a message that cannot itself be printed (an int too long, say)
        return "unprintable"
    return text if len(text) <= 500 else text[:500] + "..."


def load_metadata(data: bytes, *, file: str) -> dcp_metadata.Metadata:
    """Decode a DCP ``.metadata`` pickle into :mod:`inspector.formats.dcp.metadata` records."""
    metadata = run(_MetadataUnpickler(data, file, None))
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CorruptCheckpointError(
            f"pickle holds a {type(metadata).__name__}, not DCP Metadata", file=file
        )
    return metadata


def load_plain(data: bytes, *, file: str) -> Any:
    """Decode a pickle of plain data (no global of any kind is resolved; none runs)."""
    return run(_PlainUnpickler(data, file, None))


def load_data_pickle(data: bytes, *, file: str, key: str | None = None) -> Any:
    """Decode a torch archive's ``data.pkl`` or a plain pickled object.

    Tensors come back as TensorRef / SubclassRef descriptions, unknown classes as Opaque.
    """
    return run(DataUnpickler(data, file, key))


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
