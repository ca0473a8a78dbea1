"""What an export writes: the chosen entries, each output's final name, dtype and shape, and
how it is produced; and the vocabulary of exports (formats, FP8 modes, dtypes, shard size).

A plan is computed from metadata and chunk pickles alone (no tensor data is read and, for
plain copies, torch is not imported); :mod:`.run` writes it.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from inspector import dtypes
from inspector.errors import ExportError, UsageError
from inspector.exporting.fp8 import DEFAULT_FP8_DTYPE, Output, plan_fp8
from inspector.formats.writing import Item
from inspector.keys.spellings import view_key
from inspector.reprs import bounded_repr

if TYPE_CHECKING:
    import torch

    from inspector.checkpoint import Checkpoint

EXPORT_FORMATS = ("safetensors", "pt", "hf", "dcp", "megatron")
MODEL_FOLDER_FORMATS = ("hf", "dcp", "megatron")  # whole models under another family's names
# From this size an export is worth worker processes (a fork server's import of torch and
# each worker's re-planning cost about 2 s), one per core up to MAX_SUGGESTED_WORKERS.
PARALLEL_BYTES = 4 << 30
MAX_SUGGESTED_WORKERS = 8
# The architectures of exporting/hf/ (listed here so the CLI's help need not load the adapters).
ARCHITECTURE_NAMES = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3")
CAST_DTYPES = ("bfloat16", "float16", "float32")  # what the app and CLI offer to cast to
ON_ERROR = ("fail", "skip")
DEFAULT_SHARD_SIZE = "5GB"  # huggingface_hub's default (decimal)
INDEX_NAME = "model.safetensors.index.json"
Rename = Mapping[str, str] | Callable[[str], str] | None

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


def parse_size(value: int | str) -> int:
    """``5GB`` (decimal, like huggingface_hub), ``512MiB``, or a number of bytes."""
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(str(value))
        if not match or match.group(2).upper() not in _UNITS:
            raise UsageError(f"cannot read size {value!r}; use e.g. '5GB', '500MB' or bytes")
        size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size <= 0:
        raise UsageError(f"size must be positive, got {value!r}")
    return size


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise UsageError(f"{name} must be one of {', '.join(choices)}, not {value!r}",
                         option=(name, name))


@dataclass(frozen=True)
class Planned:
    """One tensor of the export: the writer's Item plus where it came from and how it was made.

    ``path`` is the nested path a ``nested=True`` .pt places it at.
    """

    item: Item
    entry_key: str
    path: tuple[Any, ...]
    conversion: str | None


def select(
    ck: Checkpoint,
    model_only: bool,
    include: Iterable[str] | None,
    exclude: Iterable[str] | None,
    on_error: str,
    tensors_only: bool,
) -> tuple[list[str], dict[str, str]]:
    """The stored keys to export (matched against stored and flattened spellings), and the
    keys left out with the reason (unreadable ones only in skip mode)."""
    chosen, skipped = [], {}
    include, exclude = list(include or []), list(exclude or [])
    for entry in ck.entries():
        names = (entry.key, view_key(entry, "flattened"))
        if model_only and entry.component != "model":
            continue
        if include and not any(fnmatchcase(n, p) for n in names for p in include):
            continue
        if any(fnmatchcase(n, p) for n in names for p in exclude):
            continue
        error = ck.facts(entry.key).error
        if entry.kind == "object" and tensors_only:
            skipped[entry.key] = "not a tensor (safetensors holds tensors only)"
        elif error:
            _refuse_or_skip(ck, entry.key, error, on_error, skipped)
        else:
            chosen.append(entry.key)
    return chosen, skipped


def _refuse_or_skip(
    ck: Checkpoint, key: str, error: str, on_error: str, skipped: dict[str, str]
) -> None:
    if on_error == "fail":
        raise ExportError(
            f"cannot be read ({error}); pass on_error='skip' to leave it out",
            file=ck.location,
            key=key,
        )
    skipped[key] = f"unreadable: {error}"


def outputs(
    ck: Checkpoint,
    tensor_keys: list[str],
    mode: str,
    dtype: str | None,
    on_error: str,
    scheme: str = "channel",
) -> tuple[list[Output], dict[str, str]]:
    """The FP8 plan (``scheme``: how ``mode="quantize"`` does); planning scans chunk
    pickles, which can find damage that open did not."""
    found, consumed = plan_fp8(ck, tensor_keys, mode, dtype or DEFAULT_FP8_DTYPE, scheme)
    skipped: dict[str, str] = {}
    unreadable = set()
    for key in tensor_keys:
        error = ck.facts(key).error
        if error:
            _refuse_or_skip(ck, key, error, on_error, skipped)
            unreadable.add(key)
    return [o for o in found if o.sources[0] not in unreadable], {**consumed, **skipped}


def name_outputs(
    ck: Checkpoint, found: list[Output], dtype: str | None, flatten: bool, rename: Rename
) -> list[Planned]:
    """Each output's final name (flattened and renamed), dtype after the optional cast, and
    how its bytes are made; two outputs with one name are refused."""
    rename_fn = _rename_function(rename, ck)
    planned: list[Planned] = []
    seen: dict[str, str] = {}
    for output in found:
        entry = ck.entry(output.sources[0])
        suffix = output.name[len(entry.key) :]
        base = view_key(entry, "flattened") if flatten else entry.key
        name = rename_fn(entry.key, base) + suffix  # split FP8 parts follow their tensor
        if name in seen:
            raise ExportError(
                f"two tensors would both be written as {name!r}: "
                f"{seen[name]!r} and {output.name!r}",
                key=name,
            )
        seen[name] = output.name
        item_dtype, shape, reader, cast = _output_form(output, dtype)
        path = (*entry.nested_path[:-1], str(entry.nested_path[-1]) + suffix)
        plain = output.conversion is None and not cast and output.name == entry.key
        ranges = functools.partial(ck.byte_ranges, entry.key) if plain else None
        item = Item(name, item_dtype, shape, reader, ranges)
        planned.append(Planned(item, entry.key, path, _conversion(output, item_dtype, cast)))
    return planned


def _output_form(
    output: Output, dtype: str | None
) -> tuple[str, tuple[int, ...], Callable[[], torch.Tensor], bool]:
    """(dtype, shape, reader, cast?) of an output after the export's optional cast."""
    if output.dtype is None or output.shape is None:  # split FP8 parts: learn by reading once
        probe = output.read()
        out_dtype, shape = str(probe.dtype).removeprefix("torch."), tuple(probe.shape)
        del probe
    else:
        out_dtype, shape = output.dtype, tuple(output.shape)
    if dtype is not None and dtype != out_dtype and _castable(output, out_dtype):
        return dtype, shape, functools.partial(_cast, output, dtype), True
    return out_dtype, shape, output.read, False


def _cast(output: Output, dtype: str) -> torch.Tensor:
    from inspector.tensors import broadcast

    return broadcast.cast(output.read(), dtypes.to_torch(dtype))


def _castable(output: Output, dtype: str) -> bool:
    """Only high-precision values are cast: never float8 data, scales or split FP8 parts."""
    return dtype in dtypes.HIGH_PRECISION and not output.raw


def _conversion(output: Output, dtype: str, cast: bool) -> str | None:
    if not cast:
        return output.conversion
    text = f"cast to {dtype}"
    return f"{output.conversion}; {text}" if output.conversion else text


def _rename_function(rename: Rename, stored: Container[str]) -> Callable[[str, str], str]:
    """(stored key, current name) -> final name.

    A mapping's stored keys (e.g. all of a KeyReport's ``mapping()``) rename exactly and are
    never also patterns; its other entries are regexes, compiled when first needed.
    """
    if rename is None:
        return lambda key, name: name
    if callable(rename):
        function = rename
        return lambda key, name: function(name)
    exact = dict(rename)
    patterns: list[tuple[re.Pattern[str], str]] | None = None

    def apply(key: str, name: str) -> str:
        nonlocal patterns
        if key in exact:
            return exact[key]
        if name in exact:
            return exact[name]
        if patterns is None:
            patterns = [(re.compile(p), r) for p, r in exact.items() if p not in stored]
        for pattern, replacement in patterns:
            name = pattern.sub(replacement, name)
        return name

    return apply


def plan_shards(items: Sequence[Item], max_shard_size: int) -> list[list[Item]]:
    """Greedy, order-preserving split; a tensor larger than the limit gets a shard alone."""
    shards: list[list[Item]] = [[]]
    used = 0
    for item in items:
        if shards[-1] and used + item.nbytes > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(item)
        used += item.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` (Hugging Face's names)."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


MAX_LIST_INDEX = 1 << 20  # a list step past this would be padded with a million Nones


def nested_structure(leaves: Iterable[tuple[str, tuple[Any, ...], Any]]) -> dict[Any, Any]:
    """A dict with each ``(key, path, value)``'s value placed at its path, creating dicts (or
    lists for integer steps, padded with None) like DCP's unflattening does. A path that
    cannot be placed (a negative or huge list index, a step into a value, two values at
    one place) is an ExportError naming the key."""
    tree = _Tree()
    for key, path, value in leaves:
        try:
            tree.place(path, value)
        except ExportError as exc:
            raise ExportError(exc.reason, key=key) from None
    return tree.finish()


class _Tree:
    """The nested structure being built; its own containers are told apart from values."""

    def __init__(self) -> None:
        self.root: dict[Any, Any] = {}
        self.lists: list[list[Any]] = []
        self.own = {id(self.root)}

    def place(self, path: tuple[Any, ...], value: Any) -> None:
        if not path:
            raise ExportError("has no nested path")
        node: Any = self.root
        for step, following in itertools.pairwise(path):
            found = self._slot(node, step)
            if found is _EMPTY:
                found = [] if isinstance(following, int) else {}
                self.own.add(id(found))
                if isinstance(found, list):
                    self.lists.append(found)
                node[step] = found
            elif id(found) not in self.own:
                raise ExportError(f"nested path step {bounded_repr(step, 100)} leads into a value")
            node = found
        if self._slot(node, path[-1]) is not _EMPTY:
            where = bounded_repr(path[-1], 100)
            raise ExportError(f"two values would be written at nested path step {where}")
        node[path[-1]] = value

    @staticmethod
    def _slot(node: Any, step: Any) -> Any:
        """What lies at ``step`` of ``node`` (a list padded up to it), or ``_EMPTY``."""
        if isinstance(node, dict):
            return node.get(step, _EMPTY)
        if type(step) is not int or not 0 <= step < MAX_LIST_INDEX:
            where = bounded_repr(step, 100)
            raise ExportError(f"list index {where} in a nested path is out of range")
        node.extend(_EMPTY for _ in range(step + 1 - len(node)))
        return node[step]

    def finish(self) -> dict[Any, Any]:
        for items in self.lists:
            items[:] = [None if v is _EMPTY else v for v in items]
        return self.root


_EMPTY = object()


def suggested_workers(nbytes: int, cpus: int | None = None) -> int:
    """How many worker processes an export of ``nbytes`` of tensors is worth: one below
    ``PARALLEL_BYTES``, else one per core (``os.cpu_count()``), at most 8."""
    import os

    if nbytes < PARALLEL_BYTES:
        return 1
    return max(1, min(cpus or os.cpu_count() or 1, MAX_SUGGESTED_WORKERS))
