"""A torch_checkpointing folder: which files are items of which rank, judged by their names
(``<item>_<rank>.<ext>``, the rank split off at the last underscore) and, where it exists,
``metadata.pkl``'s layouts; and whether a folder is one at all.

Every rank writes every item (``<item>_<rank>.pt`` by default); a layout path without a
rank is written by one rank. Saves are committed by renaming ``tmp_<name>/`` to ``<name>/``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from inspector.errors import InspectorError
from inspector.formats.torch_checkpointing.metadata import METADATA_PKL, TcMetadata
from inspector.storage.base import Storage

ITEM_FILE = re.compile(r"(?P<item>[A-Za-z0-9_-]+)_(?P<rank>[0-9]+)(?P<ext>\.[^/]*)?")
TMP_PREFIX = "tmp_"
_MAX_DEPTH = 8
_MAX_FILES = 1 << 20
_OTHER_CHECKPOINTS = (".metadata", ".index.json")
_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
_ITEM_SUFFIXES = (".pt", ".bin", ".json")  # torch.save, raw bytes, JSON items


@dataclass(frozen=True)
class ItemFile:
    """One file of an item: the item's key, the rank that wrote it (None: a layout path
    without a rank) and the file's path in the folder."""

    item: str
    rank: int | None
    name: str


@dataclass
class Folder:
    """The item files by item and rank, the ranks seen, and the files that were skipped."""

    items: dict[str, dict[int | None, ItemFile]] = field(default_factory=dict)
    ranks: set[int] = field(default_factory=set)
    skipped: list[str] = field(default_factory=list)
    clashes: list[str] = field(default_factory=list)


def looks_like_torch_checkpointing(storage: Storage) -> bool:
    """``metadata.pkl``, or ``<item>_<rank>`` files (torch.save ``.pt``, at least one; raw
    bytes ``.bin``; ``.json``) whose ranks run from 0 with no gap, every torch file among
    them, and no other checkpoint's index beside them."""
    try:
        names = [n for n, kind in storage.list() if kind == "file"]
    except InspectorError:
        return False
    if any(n.endswith(_OTHER_CHECKPOINTS) for n in names):
        return False
    if METADATA_PKL in names:
        return True
    torch_files = [n for n in names if n.endswith(_TORCH_SUFFIXES)]
    matches = [ITEM_FILE.fullmatch(n) for n in torch_files]
    if not all(m and m["ext"] in _ITEM_SUFFIXES for m in matches):
        return False
    found = [m for n in names if (m := ITEM_FILE.fullmatch(n)) and m["ext"] in _ITEM_SUFFIXES]
    if len(found) < 2 or not any(m["ext"] == ".pt" for m in found):
        return False
    ranks = {int(m["rank"]) for m in found}
    return ranks == set(range(len(ranks)))


def scan(storage: Storage, metadata: TcMetadata | None) -> Folder:
    """Every item file in the folder (subfolders too); ``metadata.pkl``'s layouts name the
    item of the files they list, file names the rest."""
    by_path = {
        layout.file_path: ItemFile(item, rank, layout.file_path)
        for item, meta in (metadata.items.items() if metadata else ())
        for rank, layout in meta.layouts.items()
        if layout is not None
    }
    folder = Folder()
    for name in _files(storage):
        if name == METADATA_PKL:
            continue
        found = by_path.get(name) or _by_name(name)
        if found is None:
            folder.skipped.append(name)
            continue
        ranks = folder.items.setdefault(found.item, {})
        if found.rank in ranks:
            folder.clashes.append(f"{name} and {ranks[found.rank].name}")
            continue
        ranks[found.rank] = found
        if found.rank is not None:
            folder.ranks.add(found.rank)
    return folder


def _by_name(name: str) -> ItemFile | None:
    base = name.rsplit("/", 1)[-1]
    if base == METADATA_PKL or base.startswith(".") or base.endswith(".tmp"):
        return None
    match = ITEM_FILE.fullmatch(base)
    if match:
        return ItemFile(match["item"], int(match["rank"]), name)
    stem = base.split(".", 1)[0]
    return ItemFile(stem, None, name) if re.fullmatch(r"[A-Za-z0-9_-]+", stem) else None


def _files(storage: Storage) -> list[str]:
    """Files below the folder, depth first; hidden entries and ``tmp_`` folders skipped."""
    found: list[str] = []
    stack = [("", 0)]
    while stack:
        folder, depth = stack.pop()
        listed = storage.list(folder)
        for name, kind in reversed(listed):
            path = f"{folder}/{name}" if folder else name
            if name.startswith("."):
                continue
            if kind == "dir" and depth < _MAX_DEPTH and not name.startswith(TMP_PREFIX):
                stack.append((path, depth + 1))
            elif kind == "file":
                found.append(path)
        if len(found) > _MAX_FILES:
            raise InspectorError(f"more than {_MAX_FILES} files", file=storage.location)
    return sorted(found)


def missing_file(files: dict[int | None, ItemFile], rank: int) -> str:
    """The name rank ``rank``'s file of an item would have (the others' names, re-ranked)."""
    sample = next(f for r, f in files.items() if r is not None)
    folder, _, base = sample.name.rpartition("/")
    match = ITEM_FILE.fullmatch(base)
    assert match is not None
    renamed = f"{match['item']}_{rank}{match['ext'] or ''}"
    return f"{folder}/{renamed}" if folder else renamed
