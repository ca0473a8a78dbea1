"""Compare two checkpoints key by key, streaming one tensor pair at a time.

Works across formats, layouts (``key_map="auto"`` applies the FQN doctor's best
rewrite), shardings (tensors are compared whole, whatever their chunks) and dtypes
(values compared in float32, or float64 when either side is float64; flagged). With
``fingerprints=True`` each tensor pair is first hashed from its stored bytes (the
fingerprint digest): equal digests mean equal dtype, shape and bits, and those pairs are
not read into memory or compared again.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

import torch

from inspector.analysis.fingerprint import tensor_digest
from inspector.analysis.stats import blocks, layer_index, layer_name, plot_by_layer
from inspector.checkpoint import as_checkpoint

if TYPE_CHECKING:
    import pandas
    from matplotlib.figure import Figure

    from inspector.checkpoint import Checkpoint

KeyMap = str | Mapping[str, str] | Callable[[str], str] | None
STATUSES = ("same", "dtype", "values", "shape", "only_a", "only_b")
DIFF_BLOCK = 1 << 20  # elements per step of the float comparison (a few MB of temporaries)


@dataclass
class Row:
    """One compared key. ``equal`` is True for ``same`` and ``dtype`` (equal within tolerance)."""

    key: str
    key_b: str | None
    status: str
    equal: bool
    kind: str
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    n_diff: int | None = None
    hash_a: str | None = None
    hash_b: str | None = None


COLUMNS = list(Row.__dataclass_fields__)


def diff(
    a: Checkpoint | str | os.PathLike,
    b: Checkpoint | str | os.PathLike,
    *,
    values: bool = True,
    atol: float = 0.0,
    rtol: float = 0.0,
    key_map: KeyMap = "auto",
    include: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
    progress: bool = True,
    fingerprints: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> pandas.DataFrame:
    """One row per key of either side: status, value differences and a content hash per side
    (with ``fingerprints=True``, tensors' fingerprint digests; equal ones are not compared
    further). ``storage_options``: fsspec options for a side given as a URL (for two stores
    that need different options, pass Checkpoints opened with ``inspector.open``)."""
    import pandas
    from tqdm.auto import tqdm

    ck_a, ck_b = as_checkpoint(a, storage_options), as_checkpoint(b, storage_options)
    pairs = [p for p in key_pairs(ck_a, ck_b, key_map) if _selected(p, include, exclude)]
    rows = [
        asdict(
            compare_pair(
                ck_a, ka, ck_b, kb, values=values, atol=atol, rtol=rtol, fingerprints=fingerprints
            )
        )
        for ka, kb in tqdm(pairs, desc="diff", unit="key", disable=not progress)
    ]
    return pandas.DataFrame.from_records(rows, columns=COLUMNS)


def key_pairs(a: Checkpoint, b: Checkpoint, key_map: KeyMap) -> list[tuple[str | None, str | None]]:
    """(key in a, key in b) for every key of either side; None where a side lacks it."""
    rename = _key_function(a, b, key_map)
    keys_b = set(b.keys())
    pairs: list[tuple[str | None, str | None]] = []
    matched: set[str] = set()
    for key in a.keys():
        other = rename(key)
        if other in keys_b and other not in matched:
            matched.add(other)
            pairs.append((key, other))
        else:
            pairs.append((key, None))
    pairs.extend((None, key) for key in b.keys() if key not in matched)
    return pairs


def _key_function(a: Checkpoint, b: Checkpoint, key_map: KeyMap) -> Callable[[str], str]:
    if key_map is None or key_map == "none":
        return lambda key: key
    if key_map == "auto":
        from inspector.analysis.fqn import check_keys

        mapping = check_keys(a, b).mapping()
        return lambda key: mapping.get(key, key)
    if isinstance(key_map, Mapping):
        return lambda key: key_map.get(key, key)
    if callable(key_map):
        return key_map
    raise ValueError(f"key_map must be 'auto', None, a mapping or a callable, not {key_map!r}")


def _selected(
    pair: tuple[str | None, str | None],
    include: Iterable[str] | None,
    exclude: Iterable[str] | None,
) -> bool:
    names = [k for k in pair if k is not None]
    if include is not None and not any(fnmatchcase(k, p) for k in names for p in include):
        return False
    return not (exclude is not None and any(fnmatchcase(k, p) for k in names for p in exclude))


def compare_pair(
    a: Checkpoint,
    key_a: str | None,
    b: Checkpoint,
    key_b: str | None,
    *,
    values: bool = True,
    atol: float = 0.0,
    rtol: float = 0.0,
    fingerprints: bool = False,
) -> Row:
    """Compare ``a[key_a]`` with ``b[key_b]`` (either may be None: present on one side only);
    with ``fingerprints`` equal tensor digests settle it without reading the values."""
    if key_a is None or key_b is None:
        entry = b.entry(key_b or "") if key_a is None else a.entry(key_a)
        status = "only_b" if key_a is None else "only_a"
        row = Row(entry.key, key_b, status, False, entry.kind)
        side = "b" if key_a is None else "a"
        setattr(row, f"dtype_{side}", entry.dtype)
        setattr(row, f"shape_{side}", entry.shape)
        return row
    ea, eb = a.entry(key_a), b.entry(key_b)
    row = Row(key_a, key_b, "same", True, ea.kind, ea.dtype, eb.dtype, ea.shape, eb.shape)
    if ea.kind != eb.kind or ea.shape != eb.shape:
        row.status, row.equal = "shape", False
        return row
    if ea.kind == "object":
        return _compare_objects(row, a, b, values)
    if not values:
        row.status = "same" if ea.dtype == eb.dtype else "dtype"
        return row
    if fingerprints:
        row.hash_a, row.hash_b = tensor_digest(a, key_a), tensor_digest(b, key_b)
        if row.hash_a == row.hash_b:
            row.max_abs_diff, row.max_rel_diff, row.n_diff = 0.0, 0.0, 0
            return row
    ta, tb = a.read(key_a), b.read(key_b)
    if not fingerprints:
        row.hash_a, row.hash_b = tensor_hash(ta), tensor_hash(tb)
    if ta.dtype == tb.dtype and row.hash_a == row.hash_b and _bits_equal(ta, tb):
        row.max_abs_diff, row.max_rel_diff, row.n_diff = 0.0, 0.0, 0
        return row
    row.max_abs_diff, row.max_rel_diff, row.n_diff = value_differences(ta, tb, atol, rtol)
    if row.n_diff:
        row.status, row.equal = "values", False
    elif ta.dtype != tb.dtype:
        row.status = "dtype"
    return row


def _compare_objects(row: Row, a: Checkpoint, b: Checkpoint, values: bool) -> Row:
    if not values:
        return row
    va, vb = a.read_object(row.key), b.read_object(row.key_b or row.key)
    row.hash_a, row.hash_b = object_hash(va), object_hash(vb)
    if row.hash_a != row.hash_b:
        row.status, row.equal = "values", False
    return row


def tensor_hash(tensor: torch.Tensor) -> str:
    """BLAKE2b of the tensor's bytes (stored dtype, row-major), whatever its sharding was."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(str(tensor.dtype).encode())
    for block in blocks(tensor.contiguous()):
        digest.update(block.view(torch.uint8).numpy().data if block.numel() else b"")
    return digest.hexdigest()


def object_hash(value: Any) -> str:
    """A hash of a decoded non-tensor value (tensors inside hashed by content)."""
    digest = hashlib.blake2b(digest_size=16)

    def feed(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            digest.update(tensor_hash(v).encode())
        elif isinstance(v, dict):
            digest.update(b"{")
            for k in sorted(v, key=repr):
                feed(k)
                feed(v[k])
            digest.update(b"}")
        elif isinstance(v, (list, tuple)):
            digest.update(b"[" if isinstance(v, list) else b"(")
            for item in v:
                feed(item)
            digest.update(b"]")
        else:
            digest.update(repr(v).encode())
            digest.update(b";")

    feed(value)
    return digest.hexdigest()


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def value_differences(
    a: torch.Tensor, b: torch.Tensor, atol: float = 0.0, rtol: float = 0.0
) -> tuple[float, float, int]:
    """(max |a-b|, max |a-b|/|b|, elements outside ``atol + rtol*|b|``), block by block.

    NaN equals NaN and same-signed infinities are equal; anything else against NaN/Inf
    counts as different with an infinite difference.
    """
    work = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    max_abs, max_rel, n_diff = 0.0, 0.0, 0
    for xa, xb in zip(blocks(a, DIFF_BLOCK), blocks(b, DIFF_BLOCK), strict=True):
        x, y = xa.to(work), xb.to(work)
        same = (x == y) | (x.isnan() & y.isnan())
        delta = (x - y).abs()
        delta = torch.where(same, torch.zeros_like(delta), delta.nan_to_num(nan=math.inf))
        scale = torch.where(y.isfinite(), y.abs(), torch.zeros_like(y))
        rel = torch.where(delta == 0, torch.zeros_like(delta), delta / scale)
        n_diff += int((delta > atol + rtol * scale).sum())
        if delta.numel():
            max_abs = max(max_abs, float(delta.max()))
            max_rel = max(max_rel, float(rel.max()))
    return max_abs, max_rel, n_diff


def summarize(table: pandas.DataFrame) -> dict[str, int]:
    """Rows per status, in the canonical order (zero counts included)."""
    counts = table["status"].value_counts()
    return {status: int(counts.get(status, 0)) for status in STATUSES}


def layer_differences(table: pandas.DataFrame) -> pandas.DataFrame:
    """The compared tensors inside the layers: ``layer``, ``name`` (the key with its layer
    index as ``*``), ``key`` and ``max_abs_diff`` (0 for bit-equal pairs), from a diff table
    whose values were compared."""
    import pandas

    rows = []
    for key, kind, diff_value in zip(
        table["key"], table["kind"], table["max_abs_diff"], strict=True
    ):
        index = layer_index(key)
        if kind != "tensor" or index is None or diff_value is None or math.isnan(diff_value):
            continue
        rows.append(
            {"layer": index, "name": layer_name(key), "key": key, "max_abs_diff": diff_value}
        )
    return pandas.DataFrame(rows, columns=["layer", "name", "key", "max_abs_diff"])


def plot_layer_differences(table: pandas.DataFrame, *, ax: Any = None) -> Figure:
    """One line per parameter name: the largest difference against the layer index."""
    figure = plot_by_layer(layer_differences(table), "max_abs_diff", "max |a - b|", ax=ax)
    (ax if ax is not None else figure.axes[0]).set_title("largest difference per layer")
    return figure
