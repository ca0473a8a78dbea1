"""Which checkpoint a folder holds when it is not a DCP folder, and why that one.

Order: a safetensors index, a torch.save (``.bin``) index, safetensors files, one
torch.save file; a leftover ``sharded/`` folder (per-rank files of a DCP Hugging Face
save, next to their consolidated output) is used only when nothing else is there.
Every choice is written into the source's ``notes``.
"""

from __future__ import annotations

from pathlib import Path

from inspector.errors import NotACheckpointError
from inspector.sources.base import Source
from inspector.sources.sharded import ShardedSource
from inspector.sources.sniff import open_file

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
        source = ShardedSource(root, [], index=root / index)
        return source, {index, *source.shard_names}
    single = _single(root, tensors[0], "safetensors file") if len(tensors) == 1 else None
    if tensors and (single is None or getattr(single, "offsets", None) is not None):
        return ShardedSource(root, tensors), set(tensors)  # several files, or DCP chunks
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
