"""Export a checkpoint (``inspector.export``) to ``.safetensors`` or ``.pt``, streaming.

Tensors are read, converted (FP8 handling from :mod:`inspector.tensors.subclass`, an optional cast)
and written one at a time, so memory is bounded by the largest tensor. Files appear
under their final names only when the whole export succeeded; the source is only read.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from inspector.entry import ByteRange
from inspector.errors import ExportError, InspectorError
from inspector.exporting import writers
from inspector.exporting.writers import Item
from inspector.keys import components as keys
from inspector.tensors import subclass as fp8

if TYPE_CHECKING:
    from inspector.checkpoint import Checkpoint

FORMATS = ("safetensors", "pt")
INDEX_NAME = "model.safetensors.index.json"
Rename = Mapping[str, str] | Callable[[str], str] | None


@dataclass(frozen=True)
class Progress:
    """Reported to ``on_progress``: the phase (write / verify), bytes done of total, the key."""

    phase: str
    done: int
    total: int
    key: str


@dataclass
class Verification:
    """The output re-opened and compared, tensor by tensor, with what was meant to be written."""

    checked: int = 0
    mismatched: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.mismatched

    def __str__(self) -> str:
        if self.ok:
            return f"verified {self.checked} tensors bit-exact in {self.seconds:.1f} s"
        return f"{len(self.mismatched)} of {self.checked} tensors differ: {self.mismatched[:5]}"


@dataclass
class ExportResult:
    """What an export wrote, what it left out and why, and how it checked the result."""

    format: str
    files: list[Path]
    index: Path | None
    tensors: int
    objects: int
    bytes: int
    skipped: dict[str, str]
    conversions: dict[str, str]
    names: dict[str, str]
    seconds: float
    verification: Verification | None

    def summary(self) -> str:
        lines = [
            f"wrote {self.tensors} tensors ({self.bytes / 1e6:,.1f} MB)"
            + (f" and {self.objects} objects" if self.objects else "")
            + f" to {len(self.files)} file(s) in {self.seconds:.1f} s",
            *(f"  {p}" for p in self.files),
        ]
        if self.conversions:
            lines.append(
                f"converted {len(self.conversions)} tensors, e.g. "
                f"{next(iter(self.conversions.values()))}"
            )
        if self.skipped:
            lines.append(
                f"skipped {len(self.skipped)} keys, e.g. "
                + "; ".join(f"{k}: {v}" for k, v in list(self.skipped.items())[:3])
            )
        if self.verification is not None:
            lines.append(str(self.verification))
        return "\n".join(lines)


@dataclass
class _Planned:
    """One tensor of the export: the writer's Item plus where it came from."""

    item: Item
    entry_key: str
    path: tuple
    conversion: str | None


def export(
    ck_or_path: Checkpoint | str | os.PathLike,
    out: str | os.PathLike,
    format: str = "safetensors",
    *,
    dtype: torch.dtype | None = None,
    fp8: str = "dequantize",
    model_only: bool = True,
    flatten: bool = True,
    nested: bool = False,
    include: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
    rename: Rename = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    verify: bool = True,
    on_error: str = "fail",
    progress: bool = True,
    on_progress: Callable[[Progress], None] | None = None,
) -> ExportResult:
    """Write the checkpoint's tensors (model only by default) as safetensors or ``.pt``.

    safetensors: ``out`` is a folder (one ``model.safetensors``, or
    ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json`` past
    ``max_shard_size``) or a ``*.safetensors`` file. pt: ``out`` is the file; a flat dict
    of plain tensors, or with ``nested=True`` the stored nesting (like torch's
    ``dcp_to_torch_save``). ``fp8``: "dequantize" (to ``dtype`` or bfloat16), "unwrap" or
    "keep" (see :mod:`inspector.tensors.subclass`). ``flatten`` drops the ``model.`` component prefix
    (decided from the stored nesting, not the spelling). ``rename``: exact stored keys
    (e.g. a KeyReport's ``mapping()``) then regex -> replacement, or a callable.
    ``on_error``: "fail" or "skip" entries that cannot be read.
    """
    from inspector.checkpoint import as_checkpoint

    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, not {format!r}")
    if on_error not in ("fail", "skip"):
        raise ValueError(f"on_error must be 'fail' or 'skip', not {on_error!r}")
    if nested and (format != "pt" or rename is not None):
        raise ValueError("nested=True writes the stored nesting of a .pt; rename does not apply")
    started = time.perf_counter()
    ck = as_checkpoint(ck_or_path)
    out = Path(out).expanduser()
    _refuse_inside_source(ck, out)
    selected, skipped = _select(ck, model_only, include, exclude, on_error, format)
    tensor_keys = [k for k in selected if ck.entry(k).kind == "tensor"]
    outputs, consumed = _fp8_plan(ck, tensor_keys, fp8, dtype, on_error)
    skipped |= consumed
    planned = _name_outputs(ck, outputs, dtype, flatten, rename)
    objects = [k for k in selected if ck.entry(k).kind == "object"]
    meter = _Meter(sum(p.item.nbytes for p in planned), progress, on_progress)
    try:
        if format == "safetensors":
            files, index, done = _write_safetensors(
                ck, out, planned, fp8, dtype, max_shard_size, overwrite, on_error, skipped, meter
            )
            written_objects = 0
        else:
            files, written_objects, done = _write_pt(
                ck, out, planned, objects, nested, overwrite, on_error, skipped, meter
            )
            index = None
    finally:
        meter.close()
    kept = [p for p in planned if p.item.name in done]
    target = files[0] if index is None else index
    verification = _verify(target, kept, nested, progress, on_progress) if verify else None
    return ExportResult(
        format=format,
        files=files,
        index=index,
        tensors=len(kept),
        objects=written_objects,
        bytes=sum(p.item.nbytes for p in kept),
        skipped=skipped,
        conversions={p.item.name: p.conversion for p in kept if p.conversion},
        names={p.entry_key: p.item.name for p in kept if p.entry_key != p.item.name},
        seconds=time.perf_counter() - started,
        verification=verification,
    )


# --- what to write ----------------------------------------------------------------------


def _refuse_inside_source(ck: Checkpoint, out: Path) -> None:
    """Never write into a checkpoint folder, nor over a file the checkpoint is made of."""
    source, target = Path(ck.path).resolve(), out.resolve()
    if source.is_dir() and (target == source or source in target.parents):
        raise ExportError("output would be written inside the source checkpoint", file=out)
    folder = source if source.is_dir() else source.parent
    files = {_resolved(folder, name) for name in ck.source_files} - {None} | {source}
    candidates = {target} | {target / n for n in ("model.safetensors", INDEX_NAME)}
    if candidates & files or any(p.name.startswith("model-") and p.parent == target for p in files):
        raise ExportError("output would overwrite a file of the source checkpoint", file=out)


def _resolved(folder: Path, name: str) -> Path | None:
    """``folder / name`` resolved; None for a name no file can have (a NUL byte, say)."""
    try:
        return (folder / name).resolve()
    except (ValueError, OSError):
        return None


def _select(
    ck: Checkpoint, model_only: bool, include, exclude, on_error: str, format: str
) -> tuple[list[str], dict[str, str]]:
    chosen, skipped = [], {}
    include, exclude = list(include or []), list(exclude or [])
    for entry in ck.entries():
        names = (entry.key, keys.view_key(entry, "flattened"))
        if model_only and entry.component != "model":
            continue
        if include and not any(fnmatchcase(n, p) for n in names for p in include):
            continue
        if any(fnmatchcase(n, p) for n in names for p in exclude):
            continue
        if entry.kind == "object" and format != "pt":
            skipped[entry.key] = "not a tensor (safetensors holds tensors only)"
        elif entry.error:
            if on_error == "fail":
                raise ExportError(
                    f"cannot be read ({entry.error}); pass on_error='skip' to leave it out",
                    file=ck.path,
                    key=entry.key,
                )
            skipped[entry.key] = f"unreadable: {entry.error}"
        else:
            chosen.append(entry.key)
    return chosen, skipped


def _fp8_plan(
    ck: Checkpoint, tensor_keys: list[str], mode: str, dtype: torch.dtype | None, on_error: str
) -> tuple[list[fp8.Output], dict[str, str]]:
    """FP8 plan; planning scans chunk pickles, which can find damage that open did not."""
    outputs, consumed = fp8.plan(ck, tensor_keys, mode, dtype or torch.bfloat16)
    unreadable = {k: e.error for k in tensor_keys if (e := ck.entry(k)).error}
    if unreadable and on_error == "fail":
        key, why = next(iter(unreadable.items()))
        raise ExportError(
            f"cannot be read ({why}); pass on_error='skip' to leave it out", file=ck.path, key=key
        )
    skipped = {k: f"unreadable: {why}" for k, why in unreadable.items()}
    return [o for o in outputs if o.sources[0] not in unreadable], {**consumed, **skipped}


def _name_outputs(
    ck: Checkpoint,
    outputs: list[fp8.Output],
    dtype: torch.dtype | None,
    flatten: bool,
    rename: Rename,
) -> list[_Planned]:
    rename_fn = _rename_function(rename, ck)
    planned, seen = [], {}
    for output in outputs:
        entry = ck.entry(output.sources[0])
        suffix = output.name[len(entry.key) :]
        base = keys.view_key(entry, "flattened") if flatten else entry.key
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
        planned.append(_Planned(item, entry.key, path, _conversion(output, item_dtype, cast)))
    return planned


def _output_form(output: fp8.Output, dtype: torch.dtype | None):
    """(dtype, shape, reader, cast?) of an output after the export's optional cast."""
    if output.dtype is None or output.shape is None:  # split FP8 parts: learn by reading once
        probe = output.read()
        out_dtype, shape = probe.dtype, tuple(probe.shape)
        del probe
    else:
        out_dtype, shape = output.dtype, tuple(output.shape)
    if dtype is not None and dtype != out_dtype and _castable(output, out_dtype):
        return dtype, shape, lambda: output.read().to(dtype), True
    return out_dtype, shape, output.read, False


def _castable(output: fp8.Output, dtype: torch.dtype) -> bool:
    """Only high-precision values are cast: never float8 data, scales or split FP8 parts."""
    return dtype.is_floating_point and dtype.itemsize > 1 and not output.raw


def _conversion(output: fp8.Output, dtype: torch.dtype, cast: bool) -> str | None:
    if not cast:
        return output.conversion
    text = f"cast to {str(dtype).removeprefix('torch.')}"
    return f"{output.conversion}; {text}" if output.conversion else text


def _rename_function(rename: Rename, stored: Container[str]) -> Callable[[str, str], str]:
    """(stored key, current name) -> final name.

    A mapping's stored keys (e.g. all of a KeyReport's ``mapping()``) rename exactly and are
    never also patterns; its other entries are regexes, compiled when first needed.
    """
    if rename is None:
        return lambda key, name: name
    if callable(rename):
        return lambda key, name: rename(name)
    exact = dict(rename)
    patterns: list[tuple[re.Pattern, str]] | None = None

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


# --- writing ------------------------------------------------------------------------------


class _Meter:
    """A tqdm bar in bytes plus the caller's callback."""

    def __init__(self, total: int, progress: bool, callback, phase: str = "write") -> None:
        from tqdm.auto import tqdm

        self.total, self.done, self.callback, self.phase = total, 0, callback, phase
        self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=phase, disable=not progress)

    def __call__(self, item: Item) -> None:
        self.done += item.nbytes
        self.bar.update(item.nbytes)
        if self.callback is not None:
            self.callback(Progress(self.phase, self.done, self.total, item.name))

    def close(self) -> None:
        self.bar.close()


def _retrying(
    write: Callable[[list[Item]], None], items: list[Item], on_error: str, skipped: dict[str, str]
) -> list[Item]:
    """Write ``items``; in skip mode an item that fails to read is dropped and the file redone.

    Returns the items actually written.
    """
    while True:
        try:
            write(items)
            return items
        except InspectorError as exc:
            failed = exc.key if exc.key in {i.name for i in items} else None
            if on_error != "skip" or failed is None:
                raise
            skipped[failed] = f"unreadable: {exc.reason}"
            items = [i for i in items if i.name != failed]


def _write_safetensors(
    ck,
    out: Path,
    planned: list[_Planned],
    mode: str,
    dtype,
    max_shard_size,
    overwrite: bool,
    on_error: str,
    skipped: dict[str, str],
    meter: _Meter,
) -> tuple[list[Path], Path | None, set[str]]:
    single_file = out.suffix == ".safetensors"
    folder = out.parent if single_file else out
    items = [_keyed(p) for p in planned]
    shards = writers.plan_shards(items, writers.parse_size(max_shard_size))
    if single_file and len(shards) > 1:
        raise ExportError(
            f"needs {len(shards)} shards of at most {max_shard_size}; "
            "give a folder instead of a .safetensors file",
            file=out,
        )
    for item in items:
        writers.safetensors_dtype(item.dtype, item.name)
    metadata = _metadata(ck, mode, dtype)
    folder.mkdir(parents=True, exist_ok=True)
    names = [out.name] if single_file else _shard_names(len(shards))
    weight_map: dict[str, str] = {}
    with writers.atomic_files(folder, overwrite) as files:
        for name, shard in zip(names, shards, strict=True):
            temp = files.temp_for(folder / name)
            done = _retrying(
                lambda part, temp=temp: writers.write_safetensors(temp, part, metadata, meter),
                shard,
                on_error,
                skipped,
            )
            weight_map |= {i.name: name for i in done}
        index = None
        if len(shards) > 1:
            index = folder / INDEX_NAME
            total = sum(i.nbytes for i in items if i.name in weight_map)
            body = {"metadata": {"total_size": total}, "weight_map": weight_map}
            files.temp_for(index).write_text(json.dumps(body, indent=2) + "\n")
        written = files.commit()
    return [p for p in written if p != index], index, set(weight_map)


def _keyed(planned: _Planned) -> Item:
    """The Item, with read errors re-labelled by the output name (for skip-and-retry)."""
    item = planned.item

    def labelled(fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            try:
                return fn()
            except InspectorError as exc:
                raise type(exc)(exc.reason, file=exc.file, key=item.name) from exc

        return call

    ranges = labelled(item.ranges) if item.ranges is not None else None
    return Item(item.name, item.dtype, item.shape, labelled(item.produce), ranges)


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _metadata(ck: Checkpoint, mode: str, dtype: torch.dtype | None) -> dict[str, str]:
    from inspector import __version__

    return {
        "format": "pt",
        "source": str(ck.path),
        "source_format": ck.format,
        "fp8": mode,
        "dtype": str(dtype).removeprefix("torch.") if dtype else "as stored",
        "exported_by": f"checkpoint-inspector {__version__}",
    }


def _write_pt(
    ck,
    out: Path,
    planned: list[_Planned],
    objects: list[str],
    nested: bool,
    overwrite: bool,
    on_error: str,
    skipped: dict[str, str],
    meter: _Meter,
) -> tuple[list[Path], int, set[str]]:
    values = {}
    for key in objects:
        try:
            value = ck.read_object(key)
        except InspectorError as exc:
            if on_error != "skip":
                raise
            skipped[key] = f"unreadable: {exc.reason}"
            continue
        problem = _weights_only_problem(value)
        if problem:
            skipped[key] = f"not loadable with torch.load(weights_only=True): {problem}"
        else:
            values[key] = value
    out.parent.mkdir(parents=True, exist_ok=True)
    with writers.atomic_files(out.parent, overwrite) as files:
        temp = files.temp_for(out)

        def write(items: list[Item]) -> None:
            names = {i.name for i in items}
            kept = [p for p in planned if p.item.name in names]
            writers.write_torch_save(temp, _pt_structure(ck, kept, items, values, nested), meter)

        done = _retrying(write, [_keyed(p) for p in planned], on_error, skipped)
        written = files.commit()
    return written, len(values), {i.name for i in done}


def _pt_structure(
    ck, planned: list[_Planned], items: list[Item], objects: dict[str, Any], nested: bool
) -> dict:
    """The dict a .pt holds: flat by output name, or nested like the stored paths."""
    by_name = {i.name: i for i in items}
    leaves = [(p.path if nested else (p.item.name,), by_name[p.item.name]) for p in planned]
    leaves += [(ck.entry(k).nested_path if nested else (k,), v) for k, v in objects.items()]
    root: dict = {}
    for path, value in leaves:
        _set_nested(root, path, value)
    return root


def _set_nested(root: dict, path: tuple, value: Any) -> None:
    """Place ``value`` at ``path``, creating dicts (or lists for integer steps) like DCP does."""
    node: Any = root
    for step, following in itertools.pairwise(path):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            node.extend(None for _ in range(step + 1 - len(node)))
            node[step] = node[step] if node[step] is not None else empty
            node = node[step]
        else:
            node = node.setdefault(step, empty)
    last = path[-1]
    if isinstance(node, list):
        node.extend(None for _ in range(last + 1 - len(node)))
    node[last] = value


_WEIGHTS_ONLY_TYPES = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.Size)


def _weights_only_problem(value: Any) -> str | None:
    """Why ``value`` cannot round-trip through ``torch.load(weights_only=True)``, or None."""
    if isinstance(value, _WEIGHTS_ONLY_TYPES):
        return None
    if isinstance(value, torch.Tensor):
        return "holds a tensor inside an object"
    if isinstance(value, dict):
        for k, v in value.items():
            problem = _weights_only_problem(k) or _weights_only_problem(v)
            if problem:
                return problem
        return None
    if isinstance(value, (list, tuple, set, frozenset)):
        return next((p for p in map(_weights_only_problem, value) if p), None)
    return f"a {type(value).__module__}.{type(value).__qualname__}"


# --- checking -----------------------------------------------------------------------------


def _verify(
    path: Path, planned: list[_Planned], nested: bool, progress: bool, callback
) -> Verification:
    """Re-open the output and compare each tensor's bytes with what was meant to be written:
    the source's bytes for copied tensors, a fresh production for converted ones."""
    import inspector

    started = time.perf_counter()
    written = inspector.open(path)
    result = Verification()
    meter = _Meter(sum(p.item.nbytes for p in planned), progress, callback, phase="verify")
    try:
        for p in planned:
            key = ".".join(map(str, p.path)) if nested else p.item.name
            result.checked += 1
            if not _written_as_planned(written, key, p.item):
                result.mismatched.append(p.item.name)
            meter(p.item)
    finally:
        meter.close()
    result.seconds = time.perf_counter() - started
    return result


def _written_as_planned(written: Checkpoint, key: str, item: Item) -> bool:
    if key not in written:
        return False
    entry = written.entry(key)
    if (entry.dtype, entry.shape) != (item.dtype, item.shape):
        return False
    ours = written.byte_ranges(key)
    source = item.ranges() if item.ranges is not None else None
    if ours is None:
        return False
    if source is not None:
        return _same_stream(_range_blocks(ours), _range_blocks(source))
    tensor = item.produce().contiguous()
    return _same_stream(_range_blocks(ours), iter([writers.empty_bytes_view(tensor)]))


_BLOCK = 1 << 23


def _range_blocks(ranges: list[ByteRange]) -> Iterator[bytes]:
    for byte_range in ranges:
        with open(byte_range.path, "rb") as f:
            f.seek(byte_range.offset)
            left = byte_range.length
            while left:
                block = f.read(min(left, _BLOCK))
                if not block:
                    return
                left -= len(block)
                yield block


def _same_stream(a: Iterator[Any], b: Iterator[Any]) -> bool:
    """Whether two streams of byte blocks (cut anywhere) hold the same bytes."""
    left, right = memoryview(b""), memoryview(b"")
    while True:
        if not left:
            left = memoryview(next(a, b"")).cast("B")
        if not right:
            right = memoryview(next(b, b"")).cast("B")
        if not left or not right:
            return not left and not right
        n = min(len(left), len(right))
        if left[:n] != right[:n]:
            return False
        left, right = left[n:], right[n:]
