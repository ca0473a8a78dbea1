"""Content fingerprints: are these the same weights as those, whatever the format, sharding,
rank count, key prefix or file layout?

A tensor's digest hashes its dtype name, its shape and its logical values' bytes in
row-major, little-endian order - exactly what ``ck.read(key)`` returns, so it does not
depend on how the values were stored. A checkpoint's digest hashes the sorted (canonical
name, tensor digest) pairs, canonical names being model FQNs without ``model.`` or
wrapper prefixes (:func:`inspector.keys.spellings.canonical_name`). A 2-rank DCP save, its
1-rank re-save, its ``model.``-prefixed twin and its safetensors or ``.pt`` export give the
same digest; another dtype, shape or value gives another.

The hash is BLAKE3 (the ``blake3`` package: the Rust reference implementation, SIMD on
every common CPU; 128-bit digests). It is a cryptographic hash, so a checkpoint made to
collide with another's fingerprint cannot be built, as it can for xxHash; and on this
project's machines it hashes several GB/s, faster than zlib's CRC-32, so a fingerprint
costs about what reading the bytes costs (``benchmarks/audit.py``).

Plain tensors whose chunks tile them along dim 0 are hashed from their stored bytes as
they are read (``ck.byte_ranges``), in blocks, without building the tensor. Others (tensor
subclasses, chunks split along other dims) are assembled band by band along dim 0: only
the chunks a band overlaps are in memory at once.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from inspector import dtypes
from inspector.checkpoint import Checkpoint, as_checkpoint
from inspector.entry import Entry, layout_problem
from inspector.errors import CorruptCheckpointError
from inspector.formats.base import bytes_view
from inspector.keys.spellings import canonical_name
from inspector.reprs import utf8
from inspector.storage.blocks import BLOCK, BlockReader

if TYPE_CHECKING:
    import torch

ALGORITHM = "blake3-128/1"  # changes whenever the bytes hashed or the hash change
DIGEST_BYTES = 16


@dataclass(frozen=True, slots=True)
class TensorPrint:
    """One tensor's fingerprint: its canonical name, the stored key it was read from, its
    dtype name and shape, and the hex digest of all three with its values."""

    name: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    digest: str


@dataclass(frozen=True)
class Fingerprint:
    """The checkpoint's fingerprint: ``digest`` over every selected tensor (the model's by
    default), ``tensors`` the digest per canonical name. ``duplicates``: canonical names
    stored under several keys (the first key in stored order is used)."""

    checkpoint: str
    digest: str
    prints: tuple[TensorPrint, ...]
    duplicates: tuple[str, ...] = ()
    algorithm: str = ALGORITHM

    @property
    def tensors(self) -> Mapping[str, str]:
        """Canonical name -> hex digest, in sorted name order."""
        return {p.name: p.digest for p in self.prints}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"checkpoint", "algorithm", "digest", "duplicates", "tensors":
        {name: {"key", "dtype", "shape", "digest"}}}``."""
        return {
            "checkpoint": self.checkpoint,
            "algorithm": self.algorithm,
            "digest": self.digest,
            "duplicates": list(self.duplicates),
            "tensors": {
                p.name: {"key": p.key, "dtype": p.dtype, "shape": list(p.shape), "digest": p.digest}
                for p in self.prints
            },
        }

    def __str__(self) -> str:
        return f"{self.digest}  {len(self.prints)} tensors  {self.checkpoint}"


def fingerprint(
    ck_or_path: Checkpoint | str | os.PathLike,
    keys: str | Iterable[str] | None = None,
    *,
    progress: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> Fingerprint:
    """The fingerprint of the model's tensors, or of the tensors whose stored key or canonical
    name matches one of the ``keys`` globs (any component); ``storage_options`` for a URL."""
    from tqdm.auto import tqdm

    ck = as_checkpoint(ck_or_path, storage_options)
    chosen, duplicates = _select(_logical_view(ck), keys)
    hasher = _Hasher()
    prints = []
    for name, entry in tqdm(
        sorted(chosen.items()), desc="fingerprint", unit="tensor", disable=not progress
    ):
        dtype, digest = hasher.tensor(ck, entry)
        prints.append(TensorPrint(name, entry.key, dtype, entry.shape or (), digest))
    whole = _whole((p.name, p.digest) for p in prints)
    return Fingerprint(ck.location, whole, tuple(prints), duplicates)


def model_digest(ck: Checkpoint, digests: Mapping[str, str]) -> str:
    """``fingerprint(ck).digest`` from tensor digests already computed (stored key -> hex
    digest, e.g. a diff's with ``fingerprints=True``); model tensors missing from
    ``digests`` are hashed now."""
    chosen, _ = _select(_logical_view(ck), None)
    hasher = _Hasher()
    pairs = []
    for name, entry in sorted(chosen.items()):
        digest = digests.get(entry.key)
        pairs.append((name, digest if digest is not None else hasher.tensor(ck, entry)[1]))
    return _whole(pairs)


def _whole(pairs: Iterable[tuple[str, str]]) -> str:
    """The checkpoint digest over (canonical name, tensor digest) pairs in name order."""
    whole = _new()
    for name, digest in pairs:
        whole.update(utf8(name) + b"\0" + bytes.fromhex(digest))
    return whole.hexdigest(DIGEST_BYTES)


def tensor_digest(ck: Checkpoint, key: str) -> str:
    """The hex digest of one tensor (as in ``fingerprint(ck).tensors``)."""
    return _Hasher().tensor(ck, ck.entry(key))[1]


def _logical_view(ck: Checkpoint) -> list[Entry]:
    """The entries a fingerprint covers: a weight stored as parts counts once, by its value."""
    return [e for e in ck.entries() if ck.part_of(e.key) is None]


def _select(
    entries: list[Entry], keys: str | Iterable[str] | None
) -> tuple[dict[str, Entry], tuple[str, ...]]:
    patterns = [keys] if isinstance(keys, str) else None if keys is None else list(keys)
    chosen: dict[str, Entry] = {}
    duplicates: list[str] = []
    for entry in entries:
        if entry.kind != "tensor":
            continue
        name = canonical_name(entry)
        if patterns is None:
            wanted = entry.component == "model"
        else:
            wanted = any(fnmatchcase(entry.key, p) or fnmatchcase(name, p) for p in patterns)
        if not wanted:
            continue
        if name in chosen:
            duplicates.append(name)
        else:
            chosen[name] = entry
    return chosen, tuple(dict.fromkeys(duplicates))


def _new() -> Any:
    import blake3

    return blake3.blake3()


class _Hasher:
    """Hashes tensors one at a time, reading stored bytes through one block per storage."""

    def __init__(self) -> None:
        self._readers: dict[int, BlockReader] = {}

    def tensor(self, ck: Checkpoint, entry: Entry) -> tuple[str, str]:
        """(dtype name, hex digest) of the entry's logical values."""
        ranges = ck.byte_ranges(entry.key)
        if ranges is not None and entry.dtype is not None:
            h = _new()
            h.update(_header(entry.dtype, entry.shape or ()))
            for r in ranges:
                reader = self._readers.setdefault(id(r.storage), BlockReader(r.storage))
                for piece in reader.pieces(r.name, r.offset, r.length):
                    h.update(piece)
            return entry.dtype, h.hexdigest(DIGEST_BYTES)
        dtype, pieces = _assembled(ck, entry)
        h = _new()
        h.update(_header(dtype, entry.shape or ()))
        for piece in pieces:
            h.update(piece)
        return dtype, h.hexdigest(DIGEST_BYTES)


def _header(dtype: str, shape: tuple[int, ...]) -> bytes:
    """What precedes the values: dtype and shape are part of a tensor's identity."""
    return f"{dtype}:{','.join(map(str, shape))}\n".encode()


def _assembled(ck: Checkpoint, entry: Entry) -> tuple[str, Iterator[memoryview]]:
    """The tensor's row-major bytes built band by band along dim 0, and the dtype they come in
    (the first band is read now to learn it)."""
    shape = entry.shape or ()
    if not entry.numel:
        return entry.dtype or "", iter(())
    problem = layout_problem(shape, entry.chunks)
    if problem is not None:
        raise CorruptCheckpointError(problem, file=ck.location, key=entry.key)
    if not shape or len(entry.chunks) == 1:
        tensor = ck.read(entry.key)
        return _dtype_name(tensor), iter([_bytes(tensor)])
    bands = _bands(ck, entry)
    first = next(bands)
    return _dtype_name(first), _chain(first, bands)


def _chain(first: torch.Tensor, rest: Iterator[torch.Tensor]) -> Iterator[memoryview]:
    yield _bytes(first)
    for block in rest:
        yield _bytes(block)


def _bands(ck: Checkpoint, entry: Entry) -> Iterator[torch.Tensor]:
    """Row blocks of the whole tensor in order; a chunk is read once and kept only while the
    band being built overlaps it."""
    import torch

    shape = entry.shape or ()
    rows = [(c.offsets[0], c.offsets[0] + c.sizes[0], i) for i, c in enumerate(entry.chunks)]
    cuts = sorted({0, shape[0], *(a for a, _, _ in rows), *(b for _, b, _ in rows)})
    live: dict[int, torch.Tensor] = {}
    row_bytes = max(1, entry.numel // max(shape[0], 1)) * _itemsize(entry)
    step = max(1, BLOCK // row_bytes)
    for lo, hi in itertools.pairwise(cuts):
        covering = [i for a, b, i in rows if a < hi and b > lo and entry.chunks[i].numel]
        for i in [i for i in live if i not in covering]:
            del live[i]
        for i in covering:
            if i not in live:
                live[i] = ck.read_chunk(entry.key, i)
        dtype = next(iter(live.values())).dtype
        for start in range(lo, hi, step):
            stop = min(hi, start + step)
            block = torch.empty((stop - start, *shape[1:]), dtype=dtype)
            for i in covering:
                chunk = entry.chunks[i]
                inner = [
                    slice(o, o + n) for o, n in zip(chunk.offsets[1:], chunk.sizes[1:], strict=True)
                ]
                rows_of = live[i][start - chunk.offsets[0] : stop - chunk.offsets[0]]
                block[tuple([slice(None), *inner])].copy_(rows_of)
            yield block


def _itemsize(entry: Entry) -> int:
    return dtypes.itemsize(entry.dtype) if entry.dtype else 1


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _bytes(tensor: torch.Tensor) -> memoryview:
    return bytes_view(tensor.contiguous()) if tensor.numel() else memoryview(b"")
