"""Compare two checkpoints key by key, streaming one tensor pair at a time.

Works across formats, layouts (``key_map="auto"`` applies the FQN doctor's best
rewrite), shardings (tensors are compared whole, whatever their chunks) and dtypes
(values compared in float32, or float64 when either side is float64; flagged). With
``fingerprints=True`` each tensor pair is first hashed from its stored bytes (the
fingerprint digest): equal digests mean equal dtype, shape and bits, and those pairs are
not read into memory or compared again.

A view that repeats its stored values (stride 0, ``expand``) is never made dense: two that
repeat along the same dimensions are compared by what they store (their hashes cover the
stored values and the shape); against a plain tensor, one is compared block by block, in
time bounded by the plain side's real size. Two that repeat along different dimensions are
an UnsupportedError naming the key. Decoded objects are hashed by structure, each shared
part once, so memo-shared or cyclic values cost what they store.
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
from inspector.analysis.stats import layer_index, layer_name, plot_by_layer
from inspector.checkpoint import as_checkpoint
from inspector.errors import UnsupportedError
from inspector.formats.base import bytes_view
from inspector.formats.safe_pickle import NumpyArray, Opaque, SubclassRef
from inspector.reprs import bounded_repr, utf8
from inspector.tensors import broadcast

if TYPE_CHECKING:
    import pandas
    from matplotlib.figure import Figure

    from inspector.checkpoint import Checkpoint

KeyMap = str | Mapping[str, str] | Callable[[str], str] | None
STATUSES = ("same", "dtype", "values", "shape", "only_a", "only_b")
DIFF_BLOCK = 1 << 20  # elements per step of the float comparison (a few MB of temporaries)
_HASH_BLOCK = 1 << 22


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
    rel_l2_diff: float | None = None
    cosine: float | None = None
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
    if key_map is None or key_map == "none" or (key_map == "auto" and a is b):
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
            _equal_values(row)
            return row
    ta = a.read(key_a)
    tb = ta if a is b and key_a == key_b else b.read(key_b)  # a checkpoint against itself
    repeated_a, repeated_b = broadcast.repeated_dims(ta), broadcast.repeated_dims(tb)
    if repeated_a and repeated_b:
        if repeated_a != repeated_b:
            raise UnsupportedError(
                f"both sides repeat stored values (stride 0), along dimensions {repeated_a} "
                f"and {repeated_b}: not compared",
                key=key_a,
            )
        sa = broadcast.stored(ta)
        sb = sa if tb is ta else broadcast.stored(tb)
        return _compare_values(row, sa, sb, atol, rtol, ta, hashed=fingerprints)
    return _compare_values(row, ta, tb, atol, rtol, hashed=fingerprints)


def _compare_values(
    row: Row,
    ta: torch.Tensor,
    tb: torch.Tensor,
    atol: float,
    rtol: float,
    repeated: torch.Tensor | None = None,
    *,
    hashed: bool = False,
) -> Row:
    """Fill the row's value columns; ``repeated``: the tensor both sides repeat like (so
    ``ta`` and ``tb`` are the values they store, and each difference counts that often);
    ``hashed``: the row already holds the sides' fingerprint digests."""
    if not hashed:
        row.hash_a = tensor_hash(ta, repeated)
        row.hash_b = row.hash_a if tb is ta else tensor_hash(tb, repeated)
    if ta.dtype == tb.dtype and row.hash_a == row.hash_b and (tb is ta or _bits_equal(ta, tb)):
        _equal_values(row)
        return row
    found = value_differences(ta, tb, atol, rtol)
    row.max_abs_diff, row.max_rel_diff = found.max_abs, found.max_rel
    row.rel_l2_diff, row.cosine = found.rel_l2, found.cosine
    row.n_diff = found.n_diff * (broadcast.repeats(repeated) if repeated is not None else 1)
    if row.n_diff:
        row.status, row.equal = "values", False
    elif ta.dtype != tb.dtype:
        row.status = "dtype"
    return row


def _equal_values(row: Row) -> None:
    row.max_abs_diff, row.max_rel_diff, row.rel_l2_diff, row.n_diff = 0.0, 0.0, 0.0, 0
    row.cosine = 1.0


def _compare_objects(row: Row, a: Checkpoint, b: Checkpoint, values: bool) -> Row:
    if not values:
        return row
    key_b = row.key_b or row.key
    row.hash_a = object_hash(a.read_object(row.key))
    same = a is b and key_b == row.key  # a checkpoint against itself
    row.hash_b = row.hash_a if same else object_hash(b.read_object(key_b))
    if row.hash_a != row.hash_b:
        row.status, row.equal = "values", False
    return row


def tensor_hash(tensor: torch.Tensor, repeated: torch.Tensor | None = None) -> str:
    """BLAKE2b of the tensor's bytes (stored dtype, row-major), whatever its sharding was;
    with ``repeated``, of the values ``tensor`` stores for that repeated view, and its shape."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(str(tensor.dtype).encode())
    if repeated is not None:
        digest.update(f"repeated as {list(repeated.shape)} {repeated.stride()}".encode())
    for block in broadcast.flat_blocks(tensor, _HASH_BLOCK):
        digest.update(bytes_view(block) if block.numel() else b"")
    return digest.hexdigest()


def object_hash(value: Any) -> str:
    """A hash of a decoded non-tensor value (tensors inside hashed by content), built from
    the hashes of its parts: each shared part is hashed once, a part that contains itself
    is hashed as a back reference, and nothing recurses."""
    done: dict[int, bytes] = {}
    active: set[int] = set()
    stack: list[tuple[Any, list[Any] | None, bytes]] = [(value, None, b"")]
    while stack:
        item, finished, tag = stack.pop()
        if finished is not None:  # every part hashed (or on the path: a cycle)
            active.discard(id(item))
            digest = hashlib.blake2b(tag, digest_size=16)
            for part in finished:
                digest.update(done.get(id(part), b"<cycle>"))
            done[id(item)] = digest.digest()
            continue
        if id(item) in done or id(item) in active:
            continue
        parts = _parts(item)
        if parts is None:
            done[id(item)] = _leaf_hash(item)
            continue
        active.add(id(item))
        stack.append((item, parts[1], parts[0]))
        stack.extend((p, None, b"") for p in parts[1] if id(p) not in done)
    return done[id(value)].hex()


def _parts(item: Any) -> tuple[bytes, list[Any]] | None:
    """A container's tag and the parts its hash is made of, in order; None for a leaf."""
    if isinstance(item, dict):
        keys = sorted(item, key=bounded_repr)
        return b"dict", [x for k in keys for x in (k, item[k])]
    if isinstance(item, (set, frozenset)):
        return type(item).__name__.encode(), sorted(item, key=bounded_repr)
    if isinstance(item, (list, tuple)):
        return type(item).__name__.encode(), list(item)
    if isinstance(item, slice):
        return b"slice", [item.start, item.stop, item.step]
    if isinstance(item, SubclassRef):
        return utf8(item.cls), [item.dtype, item.shape, item.attrs, item.data]
    if isinstance(item, Opaque):
        return utf8(item.global_name), [item.args, item.kwargs, item.state, item.items]
    if isinstance(item, NumpyArray):
        item = item.to_numpy()
    if type(item).__name__ == "ndarray" and type(item).__module__ == "numpy":
        return b"ndarray", [item.shape, item.dtype.str[1:], item.tobytes()]
    return None


def _leaf_hash(item: Any) -> bytes:
    if isinstance(item, torch.Tensor):
        return tensor_hash(item).encode()
    if isinstance(item, str):
        data = b"str:" + utf8(item)
    elif isinstance(item, (bytes, bytearray)):
        data = b"bytes:" + bytes(item)
    elif isinstance(item, int) and not isinstance(item, bool):
        data = b"int:" + format(item, "x").encode()  # decimal text refuses huge ints
    else:
        data = f"{type(item).__qualname__}:{bounded_repr(item)}".encode()
    return hashlib.blake2b(data, digest_size=16).digest()


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    pairs = zip(
        broadcast.flat_blocks(a, _HASH_BLOCK), broadcast.flat_blocks(b, _HASH_BLOCK), strict=True
    )
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in pairs)


@dataclass(frozen=True)
class Differences:
    """How two tensors of one shape differ: the largest absolute and relative differences,
    the elements outside the tolerance, and over the positions where both are finite,
    ||a - b|| / ||b|| and the cosine of the angle between them (NaN where undefined)."""

    max_abs: float
    max_rel: float
    n_diff: int
    rel_l2: float
    cosine: float


def value_differences(
    a: torch.Tensor, b: torch.Tensor, atol: float = 0.0, rtol: float = 0.0
) -> Differences:
    """The :class:`Differences` of ``a`` from ``b``, block by block.

    NaN equals NaN and same-signed infinities are equal; anything else against NaN/Inf
    counts as different with an infinite difference.
    """
    work = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    max_abs, max_rel, n_diff = 0.0, 0.0, 0
    sums = torch.zeros(4, dtype=torch.float64)  # a.b, a.a, b.b, (a-b).(a-b)
    pairs = zip(
        broadcast.flat_blocks(a, DIFF_BLOCK), broadcast.flat_blocks(b, DIFF_BLOCK), strict=True
    )
    for xa, xb in pairs:
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
        sums += _products(xa, xb)
    ab, aa, bb, dd = (float(v) for v in sums)
    rel_l2 = math.sqrt(dd / bb) if bb else (0.0 if dd == 0 else math.inf)
    cosine = ab / math.sqrt(aa * bb) if aa and bb else (1.0 if dd == 0 and aa == bb else math.nan)
    return Differences(max_abs, max_rel, n_diff, rel_l2, cosine)


def _products(xa: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
    """a.b, a.a, b.b and (a-b).(a-b) in float64 over the positions where both are finite."""
    x, y = xa.reshape(-1).to(torch.float64), xb.reshape(-1).to(torch.float64)
    both = x.isfinite() & y.isfinite()
    if not bool(both.all()):
        x, y = x[both], y[both]
    d = x - y
    return torch.stack([torch.dot(x, y), torch.dot(x, x), torch.dot(y, y), torch.dot(d, d)])


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
