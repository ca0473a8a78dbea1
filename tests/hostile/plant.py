"""Where hostile pickle opcodes go: a ``.pt`` file's ``data.pkl``, a DCP object item, a DCP
tensor chunk, a DCP ``.metadata``. Each starts from a genuine checkpoint, keeps everything
else as the producer wrote it, and puts the opcodes where the producer pickled a marker."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.fixtures.damage import append_item, dcp_metadata, storage_indexes
from tests.hostile import opcodes
from tests.hostile.case import Sources
from tests.hostile.opcodes import MARKER, Reduce

Snippet = bytes | Reduce
PT_KEY = "hostile"  # the key a .pt case adds next to the genuine ones
OBJECT = "lr_scheduler.last_epoch"  # a non-tensor item of the flat DCP checkpoint
TENSOR = "norm.weight"  # a one-chunk tensor of the seed DCP checkpoint


def pt_with(sources: Sources, tmp: Path, snippet: Snippet, value: Any = MARKER) -> Path:
    """The genuine ``pytorch_model.bin`` state plus key ``PT_KEY`` holding ``value`` (where
    the marker in it becomes ``snippet``), saved by torch.save."""
    state = torch.load(sources.model_bin, weights_only=True)
    data = opcodes.spliced_save({**state, PT_KEY: value}, snippet)
    return opcodes.write(tmp / "pytorch_model.bin", data)


def pt_of(tmp: Path, value: Any, snippet: Snippet | None = None, name: str = "model.pt") -> Path:
    """torch.save of ``value`` alone (its marker, if any, becoming ``snippet``)."""
    data = opcodes.torch_saved(value) if snippet is None else opcodes.spliced_save(value, snippet)
    return opcodes.write(tmp / name, data)


def object_with(
    sources: Sources, tmp: Path, snippet: Snippet | None, key: str = OBJECT, value: Any = MARKER
) -> Path:
    """The flat DCP checkpoint with object item ``key`` replaced by ``value`` (its marker
    becoming ``snippet``, if given): appended to its rank file, ``.metadata`` pointed at it."""
    folder = sources.copy("flat", tmp)
    metadata = dcp_metadata(folder)
    data = opcodes.torch_saved(value) if snippet is None else opcodes.spliced_save(value, snippet)
    append_item(folder, metadata, key, data)
    write_metadata(folder, metadata)
    return folder


def item_bytes(folder: Path, key: str, chunk: int = 0) -> bytes:
    """The stored bytes of one item of ``key`` (a torch.save archive, for a chunk)."""
    metadata = dcp_metadata(folder)
    info = metadata.storage_data[storage_indexes(metadata, key)[chunk]]
    with open(folder / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def rewrite_item(folder: Path, key: str, change: Callable[[bytes], bytes], chunk: int = 0) -> None:
    """Replace one item of ``key`` by ``change(its bytes)``, appended and pointed at."""
    data = change(item_bytes(folder, key, chunk))
    metadata = dcp_metadata(folder)
    append_item(folder, metadata, key, data, chunk)
    write_metadata(folder, metadata)


def item_file(folder: Path, key: str) -> str:
    """The file holding ``key``'s (first) item, as ``.metadata`` names it."""
    metadata = dcp_metadata(folder)
    return next(v.relative_path for i, v in metadata.storage_data.items() if i.fqn == key)


def chunk_with(sources: Sources, tmp: Path, snippet: Snippet, key: str = TENSOR) -> Path:
    """The seed DCP checkpoint with ``key``'s chunk re-saved with an attribute holding the
    snippet (torch.save pickles a tensor's ``__dict__``)."""
    folder = sources.copy("seed", tmp)
    metadata = dcp_metadata(folder)
    tensor = torch.zeros(tuple(metadata.state_dict_metadata[key].size))
    tensor.config = MARKER
    append_item(folder, metadata, key, opcodes.spliced_save(tensor, snippet))
    write_metadata(folder, metadata)
    return folder


def write_metadata(folder: Path, metadata: Any, snippet: Snippet | None = None) -> None:
    """``.metadata`` pickled with protocol 2 (no frames), its marker becoming ``snippet``."""
    raw = pickle.dumps(metadata, protocol=2)
    (folder / ".metadata").write_bytes(raw if snippet is None else opcodes.place(raw, snippet))


def metadata_with(
    sources: Sources, tmp: Path, snippet: Snippet, edit: Callable[[Any], None], name: str = "seed"
) -> Path:
    """A DCP checkpoint whose ``.metadata`` got ``edit`` (which places the marker)."""
    folder = sources.copy(name, tmp)
    metadata = dcp_metadata(folder)
    edit(metadata)
    write_metadata(folder, metadata, snippet)
    return folder


def planner_entry(key: str) -> Callable[[Any], None]:
    """An edit putting the marker as ``key``'s planner path."""

    def edit(metadata: Any) -> None:
        metadata.planner_data[key] = MARKER

    return edit
