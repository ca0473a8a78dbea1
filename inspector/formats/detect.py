"""Which format a path holds, judged by content (never by name alone), and its reader.

``open_source`` is the one entry point: a DCP folder (``.metadata``), a file (sniffed from
its first bytes: safetensors, torch.save zip or pre-1.6 pickle, a ``*.index.json``), or a
folder of files, chosen by the rules of ``open_folder``. Every choice is written into the
source's ``notes``. A folder an unfinished save left is named as such (``unfinished_save``,
also what the audit reports).
"""

from __future__ import annotations

from collections.abc import Sequence

from inspector.errors import (
    CorruptCheckpointError,
    InspectorError,
    NotACheckpointError,
    UnfinishedSaveError,
)
from inspector.formats import producers
from inspector.formats.base import Source
from inspector.formats.bundle import BundleSource, component_files
from inspector.formats.compressed_tensors import logical_weights as logical_weights
from inspector.formats.dcp import reader as dcp
from inspector.formats.deepspeed import DeepSpeedSource, looks_like_deepspeed
from inspector.formats.hf_sharded import ShardedSource
from inspector.formats.runs import open_run
from inspector.formats.safetensors import SafetensorsSource, looks_like_safetensors
from inspector.formats.torch_archive import is_legacy_torch, is_tar, is_zip
from inspector.formats.torch_checkpointing import (
    TorchCheckpointingSource,
    looks_like_torch_checkpointing,
)
from inspector.formats.torch_save import TorchSaveSource
from inspector.formats.unfinished import Sign as Sign  # re-exported: what the audit reports
from inspector.formats.unfinished import unfinished_save as unfinished_save
from inspector.storage.base import Listed, Storage


def open_source(storage: Storage, name: str = "") -> Source:
    """Pick the reader for ``name`` in ``storage`` (``""``: the folder itself) by content.

    A folder: DCP (``.metadata``), else what ``open_folder`` finds there. A file:
    safetensors, torch.save (zip or pre-1.6), a ``*.index.json`` of shards, or a DCP
    ``.metadata`` file (its folder is opened).
    """
    if not name:
        if dcp.is_dcp_dir(storage):
            return dcp.DcpSource(storage)
        bundle = open_bundle(storage)
        if bundle is not None:
            return bundle
        if looks_like_torch_checkpointing(storage):
            return TorchCheckpointingSource(storage)
        if looks_like_deepspeed(storage):
            return DeepSpeedSource(storage)
        return open_run(storage, open_source, open_folder, open_source) or open_folder(storage)
    if storage.kind(name) == "dir":
        return open_source(storage.child(name))
    if name.endswith(dcp.METADATA_FILE) and "/" not in name and dcp.metadata_files(storage):
        return dcp.DcpSource(storage)
    if file_kind(storage, name) == "json":
        return ShardedSource(
            storage, [], open_file, index=name, notes=(f"opened the index {name}",)
        )
    return open_file(storage, name)


# --- one file, by its first bytes ---------------------------------------------------------
_HEAD_BYTES = 512


def file_kind(storage: Storage, name: str) -> str | None:
    """``"safetensors"``, ``"torch-save"``, ``"json"`` (an index) or None (something else)."""
    head = storage.read(name, 0, min(_HEAD_BYTES, storage.size(name)))
    if looks_like_safetensors(head):
        return "safetensors"
    if is_zip(head) or is_tar(head) or is_legacy_torch(head):
        return "torch-save"
    if head.lstrip()[:1] == b"{":
        return "json"
    return None


def open_file(storage: Storage, name: str) -> SafetensorsSource | TorchSaveSource:
    """The reader for one checkpoint file, judged by its first bytes."""
    kind = file_kind(storage, name)
    if kind == "safetensors":
        return SafetensorsSource(storage, name)
    if kind == "torch-save":
        return TorchSaveSource(storage, name)
    if storage.size(name) == 0:
        raise CorruptCheckpointError("the file is empty (0 bytes)", file=storage.describe(name))
    if name.endswith(".safetensors"):
        return SafetensorsSource(storage, name)  # named so: its header check says what is wrong
    raise NotACheckpointError(
        "neither a safetensors file nor a torch.save archive (judged by its content)",
        file=storage.describe(name),
    )


# --- a folder saved one file per component (HF Trainer, accelerate) ----------------------
def open_bundle(storage: Storage) -> Source | None:
    """The folder as one checkpoint of several component files, when a producer that saves
    so is named by the folder's files (its profile's ``component_files``); else None."""
    try:
        names = [n + "/" * (kind == "dir") for n, kind in storage.list()]
    except InspectorError:
        return None
    found, evidence = producers.identify(names, ())
    parts = component_files(found, names)
    if not parts:
        return None
    try:
        model: Source | None = open_folder(storage, skip=frozenset(parts))
    except NotACheckpointError:
        model = None
    return BundleSource(storage, found, evidence, model, parts, open_part)


def open_part(storage: Storage, name: str) -> Source:
    """One part of a bundle by its content: a DCP folder (``name`` empty) or a file."""
    return dcp.DcpSource(storage) if not name else open_file(storage, name)


# --- a folder of files ---------------------------------------------------------------------
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
SHARDED_DIR = "sharded"


def open_folder(storage: Storage, skip: frozenset[str] = frozenset()) -> Source:
    """The checkpoint in the folder, with notes saying which files were picked and why
    (``skip``: names a bundle holds as other components)."""
    listed = [(n, kind) for n, kind in storage.list() if n not in skip]
    names = [n for n, kind in listed if kind == "file"]
    st_index = _preferred(
        [n for n in names if n.endswith(".safetensors.index.json")], SAFETENSORS_INDEX
    )
    pt_index = _preferred(
        [n for n in names if n.endswith(tuple(s + ".index.json" for s in TORCH_SUFFIXES))],
        TORCH_INDEX,
    )
    tensors = [n for n in names if n.endswith(".safetensors")]
    pickles = [n for n in names if n.endswith(TORCH_SUFFIXES)]
    leftover = _leftover_shards(storage, listed)
    if st_index or pt_index or tensors or pickles:
        candidates = [*st_index, *pt_index, *tensors, *pickles]
        notes = []
        if leftover:
            notes.append(
                f"ignored leftover {SHARDED_DIR}/ folder ({len(leftover)} per-rank files "
                "of the distributed save; the consolidated files above are used)"
            )
        return _pick(storage, st_index, pt_index, tensors, pickles, candidates, notes)
    if leftover:
        note = f"no checkpoint files at top level: using the per-rank files in {SHARDED_DIR}/"
        return _with_notes(open_folder(storage.child(SHARDED_DIR)), (note,), first=True)
    signs = [s for s in unfinished_save(storage) if s.blocking]
    if signs:
        raise UnfinishedSaveError(
            "; ".join(s.message for s in signs),
            file=storage.location,
            found=tuple(f for s in signs for f in s.files),
        )
    below = _checkpoints_below(storage, listed)
    raise NotACheckpointError(
        "not a checkpoint: no DCP .metadata, torch.save archive or safetensors file found"
        + (f"; the folder below holds one: open {below[0]}" if len(below) == 1 else "")
        + (f"; folders below hold checkpoints: {', '.join(below)}" if len(below) > 1 else ""),
        file=storage.location,
    )


# Sub-folders looked into when a folder holds no checkpoint itself (one listing each).
_LOOK_BELOW = 64


def _checkpoints_below(storage: Storage, listed: Sequence[tuple[str, str]]) -> list[str]:
    """The paths of the sub-folders (the first ``_LOOK_BELOW``) that hold checkpoint files."""
    found = []
    for name in sorted(n for n, kind in listed if kind == "dir")[:_LOOK_BELOW]:
        child = storage.child(name)
        try:
            files = [n for n, kind in child.list() if kind == "file"]
        except InspectorError:
            continue
        marks = (".safetensors", *TORCH_SUFFIXES)
        if any(n == dcp.METADATA_FILE or n.endswith(marks) for n in files):
            found.append(child.location)
    return found


def _preferred(candidates: list[str], name: str) -> list[str]:
    """``candidates`` with ``name`` first when it is among them."""
    return sorted(candidates, key=lambda n: n != name)


def _pick(
    storage: Storage,
    st_index: list[str],
    pt_index: list[str],
    tensors: list[str],
    pickles: list[str],
    candidates: list[str],
    notes: list[str],
) -> Source:
    """The source to open, noting the candidates it leaves out."""

    def ignoring(used: set[str]) -> tuple[str, ...]:
        return (*(f"also found {n} (ignored)" for n in candidates if n not in used), *notes)

    if st_index or pt_index:
        index = (st_index or pt_index)[0]
        source = ShardedSource(storage, [], open_file, index=index)
        return _with_notes(source, ignoring({index, *source.shard_names}))
    single = _single(storage, tensors[0], "safetensors file") if len(tensors) == 1 else None
    if tensors and (single is None or getattr(single, "offsets", None) is not None):
        # several files, or DCP chunks
        return ShardedSource(storage, tensors, open_file, notes=ignoring(set(tensors)))
    if single is not None:
        return _with_notes(single, ignoring({tensors[0]}))
    if len(pickles) > 1 and "pytorch_model.bin" not in pickles:
        raise NotACheckpointError(
            f"several torch.save files and no index; open one of: {', '.join(pickles)}",
            file=storage.location,
        )
    name = "pytorch_model.bin" if "pytorch_model.bin" in pickles else pickles[0]
    return _with_notes(_single(storage, name, "torch.save file"), ignoring({name}))


def _single(storage: Storage, name: str, what: str) -> Source:
    return _with_notes(open_file(storage, name), (f"the folder's {what}: {name}",), first=True)


def _with_notes(source: Source, notes: tuple[str, ...], *, first: bool = False) -> Source:
    """The source, its notes extended by how it was chosen (set once, while detecting)."""
    source.notes = (*notes, *source.notes) if first else (*source.notes, *notes)
    return source


def _leftover_shards(storage: Storage, listed: list[tuple[str, Listed]]) -> list[str]:
    if (SHARDED_DIR, "dir") not in listed:
        return []
    return [n for n, kind in storage.child(SHARDED_DIR).list() if n.endswith(".safetensors")]
