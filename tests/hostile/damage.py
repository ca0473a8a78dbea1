"""Damage: truncation, lying offsets, lengths, shapes and dtypes, overlapping items, empty and
missing files, zip records and safetensors headers that claim what is not there."""

from __future__ import annotations

import json
import pickle
import pickletools
import struct
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from inspector.errors import CorruptCheckpointError
from tests.fixtures.damage import (
    dcp_metadata,
    edit_header,
    header_of,
    repoint,
    storage_indexes,
    truncate,
    write_dcp_metadata,
)
from tests.hostile.case import Case, Generator, Genuine

_KEY = "norm.weight"
_SHARDED = "tok_embeddings.weight"  # two chunks, one per rank file, in flat/
_INDEX = "model.safetensors.index.json"


def _keys_in(metadata: Any, test: Callable[[Any], bool]) -> frozenset[str]:
    """Keys with an item whose ``_StorageInfo`` passes ``test``."""
    return frozenset(i.fqn for i, info in metadata.storage_data.items() if test(info))


# --- DCP: .distcp files and the _StorageInfo records that point into them -----------------


def _distcp_size(size: Callable[[int], int], genuine: Genuine, tmp: Path) -> Case:
    folder = genuine.copy("seed", tmp)
    shard = folder / "__0_0.distcp"
    cut = size(shard.stat().st_size)
    truncate(shard, cut)
    bad = _keys_in(dcp_metadata(folder), lambda info: info.offset + info.length > cut)
    return Case(folder, "__0_0.distcp", says="truncated", bad=bad, reference=genuine.seed)


def _missing_distcp(genuine: Genuine, tmp: Path) -> Case:
    folder = genuine.copy("flat", tmp)
    (folder / "__1_0.distcp").unlink()
    bad = _keys_in(dcp_metadata(folder), lambda info: info.relative_path == "__1_0.distcp")
    return Case(folder, "__1_0.distcp", says="missing", bad=bad, reference=genuine.flat)


def _storage_info(edit: str, genuine: Genuine, tmp: Path) -> Case:
    """One _StorageInfo made to lie; ``bad`` also holds the key whose bytes it now shares."""
    folder = genuine.copy("seed", tmp)
    metadata = dcp_metadata(folder)
    size = (folder / "__0_0.distcp").stat().st_size
    neighbour = metadata.storage_data[storage_indexes(metadata, "layers.1.ffn_norm.weight")[0]]
    changes, says, shared = {
        "offset-past-eof": ({"offset": size + 100}, "truncated", ()),
        "length-past-eof": ({"length": size}, "truncated", ()),
        "negative-offset": ({"offset": -5}, "bad byte range", ()),
        "overlap": (
            {"offset": neighbour.offset + 100},
            "overlap",
            ("layers.1.ffn_norm.weight",),
        ),
        "same-bytes": (
            {"offset": neighbour.offset, "length": neighbour.length},
            "overlap",
            ("layers.1.ffn_norm.weight",),
        ),
    }[edit]
    repoint(metadata, _KEY, **changes)
    write_dcp_metadata(folder, metadata)
    bad = frozenset({_KEY, *shared})
    return Case(folder, "__0_0.distcp", says=says, bad=bad, reference=genuine.seed)


def _no_storage_record(genuine: Genuine, tmp: Path) -> Case:
    folder = genuine.copy("seed", tmp)
    metadata = dcp_metadata(folder)
    del metadata.storage_data[storage_indexes(metadata, _KEY)[0]]
    write_dcp_metadata(folder, metadata)
    return Case(
        folder, ".metadata", says="no storage record", bad=frozenset({_KEY}), reference=genuine.seed
    )


# --- DCP: .metadata claims about shapes, dtypes and chunk layouts --------------------------


def _shape(shape: tuple[int, ...], says: str, genuine: Genuine, tmp: Path) -> Case:
    """``norm.weight`` claims ``shape`` (its one chunk too) while its item holds 64 floats."""
    folder = genuine.copy("seed", tmp)
    metadata = dcp_metadata(folder)
    md = metadata.state_dict_metadata[_KEY]
    md.size = torch.Size(shape)
    md.chunks[0].sizes = torch.Size(shape)
    write_dcp_metadata(folder, metadata)
    return Case(folder, ".metadata", says=says, bad=frozenset({_KEY}), reference=genuine.seed)


def _unknown_dtype(genuine: Genuine, tmp: Path) -> Case:
    """A dtype this torch does not have (``torch.complex99``), spelled into the pickle."""
    folder = genuine.copy("seed", tmp)
    metadata = dcp_metadata(folder)
    metadata.state_dict_metadata[_KEY].properties.dtype = torch.complex32
    raw = pickle.dumps(metadata)
    assert raw.count(b"complex32") == 1
    (folder / ".metadata").write_bytes(raw.replace(b"complex32", b"complex99"))
    return Case(
        folder, ".metadata", says="complex99", bad=frozenset({_KEY}), reference=genuine.seed
    )


def _layout(edit: str, genuine: Genuine, tmp: Path) -> Case:
    """The second chunk of a two-rank tensor moved or dropped in ``.metadata``."""
    folder = genuine.copy("flat", tmp)
    metadata = dcp_metadata(folder)
    chunks = metadata.state_dict_metadata[_SHARDED].chunks
    index = storage_indexes(metadata, _SHARDED)[1]
    info = metadata.storage_data.pop(index)
    rows = chunks[1].sizes[0]
    offsets = {"overlap": (rows // 2, 0), "outside": (rows * 3, 0), "dropped": None}[edit]
    if offsets is None:
        del chunks[1]
    else:
        chunks[1].offsets = torch.Size(offsets)
        metadata.storage_data[type(index)(_SHARDED, offsets)] = info
    write_dcp_metadata(folder, metadata)
    says = {"overlap": "overlap", "outside": "outside shape", "dropped": "elements"}[edit]
    return Case(folder, ".metadata", says=says, bad=frozenset({_SHARDED}), reference=genuine.flat)


# --- zip records (a DCP item, a .pt file) that claim more than they hold -------------------


def _zip_record_sizes(data: bytearray, start: int, suffix: bytes, size: int) -> None:
    """Set the sizes of the record ending in ``suffix`` in the central directory found after
    ``start`` (the zip's local headers keep the truth)."""
    at = data.index(b"PK\x01\x02", start)
    while True:
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, at + 28)
        name = bytes(data[at + 46 : at + 46 + name_len])
        if name.endswith(suffix):
            struct.pack_into("<II", data, at + 20, size, size)
            return
        at = data.index(b"PK\x01\x02", at + 46 + name_len + extra_len + comment_len)


def _item_record(genuine: Genuine, tmp: Path) -> Case:
    """A DCP item's ``data.pkl`` record claims about 1 GB."""
    folder = genuine.copy("seed", tmp)
    info = dcp_metadata(folder).storage_data[storage_indexes(dcp_metadata(folder), _KEY)[0]]
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    _zip_record_sizes(data, info.offset, b"data.pkl", (1 << 30) - 1)
    shard.write_bytes(data)
    return Case(folder, "__0_0.distcp", bad=frozenset({_KEY}), reference=genuine.seed)


def _pt_record(genuine: Genuine, tmp: Path) -> Case:
    """A .pt storage record claims 4 GB: the tensors stored in it are unreadable."""
    path = genuine.copy("model_bin", tmp)
    data = bytearray(path.read_bytes())
    _zip_record_sizes(data, 0, b"/data/0", 0xFFFFFFF0)
    path.write_bytes(data)
    state = torch.load(genuine.model_bin, weights_only=True, mmap=True)
    first = next(iter(state.values())).untyped_storage().data_ptr()
    bad = frozenset(k for k, v in state.items() if v.untyped_storage().data_ptr() == first)
    return Case(path, path.name, bad=bad, reference=genuine.model_bin)


def _pt_directory(genuine: Genuine, tmp: Path) -> Case:
    """The end-of-central-directory record claims a 4 GB central directory."""
    path = genuine.copy("pt", tmp)
    data = bytearray(path.read_bytes())
    if b"PK\x06\x06" in data:  # torch writes zip64 end records: zipfile reads those
        struct.pack_into("<Q", data, data.rindex(b"PK\x06\x06") + 40, 1 << 62)
    else:
        struct.pack_into("<I", data, data.rindex(b"PK\x05\x06") + 12, 0xFFFFFF00)
    path.write_bytes(data)
    return Case(path, path.name, refused=True, error=CorruptCheckpointError)


def _file_cut(name: str, size: Callable[[int], int], genuine: Genuine, tmp: Path) -> Case:
    """A whole-file format cut short: refused as a whole, naming the file."""
    path = genuine.copy(name, tmp)
    truncate(path, size(path.stat().st_size))
    return Case(path, path.name, refused=True, error=CorruptCheckpointError)


def _metadata_pickle(edit: str, genuine: Genuine, tmp: Path) -> Case:
    """``.metadata`` whose pickle opcodes claim what no pickle of its size needs: a memo
    index of 2^31 (the C unpickler would size its memo table, 16 GiB, to fit it) or a
    frame starting inside another (which the C unpickler can answer with MemoryError)."""
    folder = genuine.copy("seed", tmp)
    path = folder / ".metadata"
    if edit == "memo-index":
        raw = bytearray(pickle.dumps(dcp_metadata(folder), protocol=2))
        at = next(p for op, _, p in pickletools.genops(bytes(raw)) if op.name == "LONG_BINPUT")
        struct.pack_into("<I", raw, at + 1, 1 << 31)
        path.write_bytes(raw)
    else:
        raw = path.read_bytes()
        path.write_bytes(raw[:51] + raw[2:])  # after the first MEMOIZE: a frame opens
    return Case(folder, ".metadata", refused=True, error=CorruptCheckpointError)


def _empty_metadata(genuine: Genuine, tmp: Path) -> Case:
    folder = genuine.copy("seed", tmp)
    truncate(folder / ".metadata", 0)
    return Case(folder, ".metadata", refused=True, error=CorruptCheckpointError)


def _legacy_storage_length(genuine: Genuine, tmp: Path) -> Case:
    """A pre-1.6 file whose first storage claims 2^62 elements (the rest cannot be found)."""
    path = genuine.copy("legacy", tmp)
    with open(path, "rb") as f:
        # magic number, protocol, system info, the object (a dict), the storage keys
        keys = frozenset([_SkipStorages(f).load() for _ in range(5)][3])
        where = f.tell()
    data = bytearray(path.read_bytes())
    struct.pack_into("<q", data, where, 1 << 62)
    path.write_bytes(data)
    return Case(path, path.name, says="storage", bad=keys, reference=genuine.legacy)


class _SkipStorages(pickle.Unpickler):
    """Reads a genuine legacy file's pickles only to find where its storages start."""

    def persistent_load(self, pid: Any) -> Any:
        return None

    def find_class(self, module: str, name: str) -> Any:
        return lambda *args, **kwargs: None


# --- safetensors headers --------------------------------------------------------------------


def _header_length(value: int, name: str, genuine: Genuine, tmp: Path) -> Case:
    path = genuine.copy(name, tmp)
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q", data, 0, value)
    path.write_bytes(data)
    return Case(path, path.name, refused=True, error=CorruptCheckpointError)


def _header_bytes(raw: bytes, genuine: Genuine, tmp: Path) -> Case:
    path = genuine.copy("safetensors", tmp)
    (size,) = struct.unpack("<Q", path.read_bytes()[:8])
    data = path.read_bytes()
    path.write_bytes(data[:8] + raw.ljust(size)[:size] + data[8 + size :])
    return Case(path, path.name, refused=True, error=CorruptCheckpointError)


def _header_entry(field: str, value: Any, says: str, genuine: Genuine, tmp: Path) -> Case:
    path = genuine.copy("safetensors", tmp)
    header, _ = header_of(path)
    key = next(k for k in header if k != "__metadata__")
    edit_header(path, lambda h: h[key].__setitem__(field, value(h[key][field])))
    return Case(path, path.name, says=says, bad=frozenset({key}), reference=genuine.safetensors)


def _past_end(offsets: list[int]) -> list[int]:
    return [offsets[0] + (1 << 40), offsets[1] + (1 << 40)]


def _safetensors_cut(genuine: Genuine, tmp: Path) -> Case:
    path = genuine.copy("safetensors", tmp)
    header, data = header_of(path)
    cut = path.stat().st_size - len(data) + len(data) // 2
    truncate(path, cut)
    ends = {k: v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"}
    bad = frozenset(k for k, end in ends.items() if end > len(data) // 2)
    return Case(path, path.name, says="truncated", bad=bad, reference=genuine.safetensors)


# --- Hugging Face shards and their index ----------------------------------------------------


def _shard(edit: str, genuine: Genuine, tmp: Path) -> Case:
    folder = genuine.copy("hub", tmp)
    weight_map = json.loads((folder / _INDEX).read_text())["weight_map"]
    shard = folder / next(iter(weight_map.values()))
    if edit == "missing":
        shard.unlink()
    elif edit == "empty":
        truncate(shard, 0)
    else:
        data = bytearray(shard.read_bytes())
        struct.pack_into("<Q", data, 0, 1 << 60)
        shard.write_bytes(data)
    bad = frozenset(k for k, v in weight_map.items() if v == shard.name)
    return Case(folder, shard.name, bad=bad, reference=genuine.hub)


def _index(edit: str, genuine: Genuine, tmp: Path) -> Case:
    folder = genuine.copy("hub", tmp)
    index = folder / _INDEX
    body = json.loads(index.read_text())
    key = next(iter(body["weight_map"]))
    if edit == "non-string":
        body["weight_map"][key] = 42
        index.write_text(json.dumps(body))
        return Case(folder, _INDEX, says="42", bad=frozenset({key}), reference=genuine.hub)
    index.write_bytes(b"" if edit == "empty" else index.read_bytes()[:-40])
    return Case(folder, _INDEX, refused=True, error=CorruptCheckpointError)


# --- DCP saved as safetensors ---------------------------------------------------------------


def _distcp_safetensors_header(genuine: Genuine, tmp: Path) -> Case:
    """The safetensors header inside a SAFETENSORS-format .distcp claims 2^60 bytes."""
    folder = genuine.copy("distcp_safetensors", tmp)
    metadata = dcp_metadata(folder)
    tensors = {k for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")}
    (start,) = {info.offset for i, info in metadata.storage_data.items() if i.fqn in tensors}
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    struct.pack_into("<Q", data, start, 1 << 60)
    shard.write_bytes(data)
    return Case(
        folder, "__0_0.distcp", bad=frozenset(tensors), reference=genuine.distcp_safetensors
    )


def _half(n: int) -> int:
    return n // 2


def _zero(n: int) -> int:
    return 0


CASES: dict[str, Generator] = {
    "damage:truncated@distcp": partial(_distcp_size, _half),
    "damage:empty@distcp": partial(_distcp_size, _zero),
    "damage:missing@distcp": _missing_distcp,
    **{
        f"damage:{edit}@storage_info": partial(_storage_info, edit)
        for edit in ("offset-past-eof", "length-past-eof", "negative-offset")
    },
    **{
        f"damage:{edit}@storage_info": partial(_storage_info, edit)
        for edit in ("overlap", "same-bytes")
    },
    "damage:no-record@storage_info": _no_storage_record,
    "damage:empty@metadata": _empty_metadata,
    "damage:memo-index@metadata": partial(_metadata_pickle, "memo-index"),
    "damage:nested-frame@metadata": partial(_metadata_pickle, "nested-frame"),
    "damage:numel-overflow@metadata": partial(_shape, (1 << 63,), "invalid"),
    "damage:huge-shape@metadata": partial(_shape, (1 << 40,), "elements but its item"),
    "damage:negative-shape@metadata": partial(_shape, (-64,), "invalid"),
    "damage:unknown-dtype@metadata": _unknown_dtype,
    **{
        f"damage:chunk-{edit}@metadata": partial(_layout, edit)
        for edit in ("overlap", "outside", "dropped")
    },
    "damage:record-size@distcp-item": _item_record,
    "damage:record-size@pt": _pt_record,
    "damage:directory-size@pt": _pt_directory,
    "damage:truncated@pt": partial(_file_cut, "pt", _half),
    "damage:empty@pt": partial(_file_cut, "pt", _zero),
    "damage:storage-length@legacy": _legacy_storage_length,
    "damage:header-length-2^60@safetensors": partial(_header_length, 1 << 60, "safetensors"),
    "damage:header-length-2^64-1@safetensors": partial(
        _header_length, (1 << 64) - 1, "safetensors"
    ),
    "damage:header-json@safetensors": partial(_header_bytes, b'{"a": {"dtype": "F32", "sha'),
    "damage:header-utf8@safetensors": partial(_header_bytes, b'{"\xff\xfe": 1}'),
    "damage:data-offsets@safetensors": partial(_header_entry, "data_offsets", _past_end, "past"),
    "damage:negative-shape@safetensors": partial(
        _header_entry, "shape", lambda s: [-1, *s], "bad shape"
    ),
    "damage:huge-shape@safetensors": partial(
        _header_entry, "shape", lambda s: [1 << 40, 1 << 40], "bytes"
    ),
    "damage:unknown-dtype@safetensors": partial(_header_entry, "dtype", lambda d: "F17", "F17"),
    "damage:truncated@safetensors": _safetensors_cut,
    "damage:empty@safetensors": partial(_file_cut, "safetensors", _zero),
    **{f"damage:{edit}@shard": partial(_shard, edit) for edit in ("missing", "empty", "2^60")},
    **{f"damage:{edit}@index": partial(_index, edit) for edit in ("empty", "cut", "non-string")},
    "damage:header-length-2^60@distcp-safetensors": _distcp_safetensors_header,
}
