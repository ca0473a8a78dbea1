"""Which format a path holds, judged by content (never by name alone), and its reader.

``open_source`` is the one entry point: a DCP folder (``.metadata``), a file (sniffed from
its first bytes: safetensors, torch.save zip or pre-1.6 pickle, a ``*.index.json``), or a
folder of files, chosen by the rules of ``open_folder``. Every choice is written into the
source's ``notes``.
"""

from __future__ import annotations

import os
from pathlib import Path

from inspector.errors import CorruptCheckpointError, NotACheckpointError
from inspector.formats.base import Source
from inspector.formats.dcp import reader as dcp
from inspector.formats.hf_sharded import ShardedSource
from inspector.formats.safetensors import SafetensorsSource, looks_like_safetensors
from inspector.formats.torch_archive import is_legacy_torch, is_tar, is_zip
from inspector.formats.torch_save import TorchSaveSource


def open_source(path: str | os.PathLike) -> Source:
    """Pick the reader for ``path`` by its content (not by its name alone).

    A folder: DCP (``.metadata``), else what ``open_folder`` finds there. A file:
    safetensors, torch.save (zip or pre-1.6), a ``*.index.json`` of shards, or a DCP
    ``.metadata`` file (its folder is opened).
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise NotACheckpointError("no such file or folder", file=root)
    if dcp.is_dcp_dir(root):
        return dcp.DcpSource(root)
    if root.is_dir():
        return open_folder(root)
    if root.name.endswith(dcp.METADATA_FILE) and dcp.is_dcp_dir(root.parent):
        return dcp.DcpSource(root.parent)
    return _open_file(root)


def _open_file(path: Path) -> Source:
    if file_kind(path) == "json":
        source = ShardedSource(path.parent, [], open_file, index=path)
        source.notes = (f"opened the index {path.name}", *source.notes)
        return source
    return open_file(path)


# --- one file, by its first bytes ---------------------------------------------------------
_HEAD_BYTES = 512


def file_kind(path: Path) -> str | None:
    """``"safetensors"``, ``"torch-save"``, ``"json"`` (an index) or None (something else)."""
    with open(path, "rb") as f:
        head = f.read(_HEAD_BYTES)
    if looks_like_safetensors(head):
        return "safetensors"
    if is_zip(head) or is_tar(head) or is_legacy_torch(head):
        return "torch-save"
    if head.lstrip()[:1] == b"{":
        return "json"
    return None


def open_file(path: Path, name: str | None = None) -> SafetensorsSource | TorchSaveSource:
    """The reader for one checkpoint file (``name``: how to show it, relative to its folder)."""
    kind = file_kind(path)
    if kind == "safetensors":
        return SafetensorsSource(path, name)
    if kind == "torch-save":
        return TorchSaveSource(path, name)
    if path.stat().st_size == 0:
        raise CorruptCheckpointError("the file is empty (0 bytes)", file=path)
    if path.name.endswith(".safetensors"):
        return SafetensorsSource(path, name)  # named so: its header check says what is wrong
    raise NotACheckpointError(
        "neither a safetensors file nor a torch.save archive (judged by its content)", file=path
    )


# --- a folder of files ---------------------------------------------------------------------
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
SHARDED_DIR = "sharded"


def open_folder(root: Path) -> Source:
    """The checkpoint in ``root``, with notes saying which files were picked and why."""
    names = sorted(p.name for p in root.iterdir() if p.is_file())
    st_index = _preferred(
        [n for n in names if n.endswith(".safetensors.index.json")], SAFETENSORS_INDEX
    )
    pt_index = _preferred(
        [n for n in names if n.endswith(tuple(s + ".index.json" for s in TORCH_SUFFIXES))],
        TORCH_INDEX,
    )
    tensors = [n for n in names if n.endswith(".safetensors")]
    pickles = [n for n in names if n.endswith(TORCH_SUFFIXES)]
    leftover = _leftover_shards(root)
    if st_index or pt_index or tensors or pickles:
        source, used = _pick(root, st_index, pt_index, tensors, pickles)
        ignored = [n for n in [*st_index, *pt_index, *tensors, *pickles] if n not in used]
        notes = [f"also found {n} (ignored)" for n in ignored]
        if leftover:
            notes.append(
                f"ignored leftover {SHARDED_DIR}/ folder ({len(leftover)} per-rank files "
                "of the distributed save; the consolidated files above are used)"
            )
        source.notes = (*source.notes, *notes)
        return source
    if leftover:
        source = open_folder(root / SHARDED_DIR)
        source.notes = (
            f"no checkpoint files at top level: using the per-rank files in {SHARDED_DIR}/",
            *source.notes,
        )
        return source
    if any(n.endswith(".distcp") for n in names):
        raise NotACheckpointError("DCP .distcp files but no .metadata file", file=root)
    raise NotACheckpointError(
        "not a checkpoint: no DCP .metadata, torch.save archive or safetensors file found",
        file=root,
    )


def _preferred(candidates: list[str], name: str) -> list[str]:
    """``candidates`` with ``name`` first when it is among them."""
    return sorted(candidates, key=lambda n: n != name)


def _pick(
    root: Path, st_index: list[str], pt_index: list[str], tensors: list[str], pickles: list[str]
) -> tuple[Source, set[str]]:
    """The source to open and the files it accounts for."""
    if st_index or pt_index:
        index = (st_index or pt_index)[0]
        source = ShardedSource(root, [], open_file, index=root / index)
        return source, {index, *source.shard_names}
    single = _single(root, tensors[0], "safetensors file") if len(tensors) == 1 else None
    if tensors and (single is None or getattr(single, "offsets", None) is not None):
        return ShardedSource(root, tensors, open_file), set(tensors)  # several files, or DCP chunks
    if single is not None:
        return single, {tensors[0]}
    if len(pickles) > 1 and "pytorch_model.bin" not in pickles:
        raise NotACheckpointError(
            f"several torch.save files and no index; open one of: {', '.join(pickles)}", file=root
        )
    name = "pytorch_model.bin" if "pytorch_model.bin" in pickles else pickles[0]
    return _single(root, name, "torch.save file"), {name}


def _single(root: Path, name: str, what: str) -> Source:
    source = open_file(root / name, name)
    source.notes = (f"the folder's {what}: {name}", *source.notes)
    return source


def _leftover_shards(root: Path) -> list[Path]:
    folder = root / SHARDED_DIR
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
