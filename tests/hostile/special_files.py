"""Class 4, special files where a checkpoint file is expected: a FIFO (opening it blocks until
a writer comes), a symlink to ``/dev/zero`` (endless) or ``/proc/self/mem`` (EIO), a
directory, a symlink loop. Each at every place a file is opened: the path handed to
``inspector.open``, ``.metadata``, a per-rank ``__R.metadata``, a ``.distcp`` shard and a
``weight_map`` target. Each must end in an InspectorError naming it, quickly; a damaged
shard marks only the keys stored in it."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from tests.fixtures.damage import dcp_metadata
from tests.hostile import plant
from tests.hostile.case import IsolatedGenerator, Sources
from tests.hostile.isolated import Spec

FORMS = ("fifo", "dev-zero", "proc-mem", "directory", "loop")
_SHARD = "__1_0.distcp"  # rank 1's file of the flat checkpoint
_INDEX = "model.safetensors.index.json"


def make(form: str, path: Path) -> None:
    """Put a special file of ``form`` at ``path`` (replacing what is there)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    if form == "fifo":
        os.mkfifo(path)
    elif form == "dev-zero":
        path.symlink_to("/dev/zero")
    elif form == "proc-mem":
        path.symlink_to("/proc/self/mem")
    elif form == "directory":
        path.mkdir()
    elif form == "loop":
        partner = path.with_name(path.name + ".loop")
        path.symlink_to(partner.name)
        partner.symlink_to(path.name)
    else:
        raise ValueError(form)


def split_by_rank(folder: Path, edit: Callable[[int, Any], None] | None = None) -> None:
    """Rewrite a two-rank DCP folder as a save without collectives writes it: each rank's
    ``__<r>.metadata`` listing only the items in its own ``__<r>_0.distcp``, no ``.metadata``
    (``edit(rank, metadata)`` changes a rank's before it is written)."""
    metadata = dcp_metadata(folder)
    for rank in (0, 1):
        mine = f"__{rank}_0.distcp"
        part = copy.copy(metadata)
        part.storage_data = {
            i: v for i, v in metadata.storage_data.items() if v.relative_path == mine
        }
        held = {(i.fqn, None if i.offset is None else tuple(i.offset)) for i in part.storage_data}
        part.state_dict_metadata = {}
        for key, md in metadata.state_dict_metadata.items():
            if hasattr(md, "chunks"):
                chunks = [c for c in md.chunks if (key, tuple(c.offsets)) in held]
                if chunks:
                    part.state_dict_metadata[key] = type(md)(md.properties, md.size, chunks)
            elif (key, None) in held:
                part.state_dict_metadata[key] = md
        part.planner_data = {
            k: v for k, v in metadata.planner_data.items() if k in part.state_dict_metadata
        }
        if edit is not None:
            edit(rank, part)
        plant.write_metadata(folder, part)
        (folder / ".metadata").rename(folder / f"__{rank}.metadata")


def _keys_in(folder: Path, file: str) -> frozenset[str]:
    metadata = dcp_metadata(folder)
    return frozenset(i.fqn for i, v in metadata.storage_data.items() if v.relative_path == file)


def _opened(form: str, sources: Sources, tmp: Path) -> Spec:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "model.pt"
    make(form, path)
    return Spec(path, path.name, refused=True)


def _metadata(form: str, sources: Sources, tmp: Path) -> Spec:
    folder = sources.copy("seed", tmp)
    make(form, folder / ".metadata")
    return Spec(folder, ".metadata", refused=True)


def _rank_metadata(form: str | None, sources: Sources, tmp: Path) -> Spec:
    folder = sources.copy("flat", tmp)
    split_by_rank(folder)
    if form is None:  # the genuine split: reads as the folder it came from
        return Spec(folder, reference=sources.flat)
    make(form, folder / "__1.metadata")
    # Not refused whole: rank 1's chunks are not listed, which marks only its keys.
    return Spec(folder, "__1.metadata", maybe_bad=rank1_keys(sources), reference=sources.flat)


def rank1_keys(sources: Sources) -> frozenset[str]:
    """The keys with a chunk in rank 1's data file of the genuine two-rank folder."""
    return _keys_in(sources.flat, "__1_0.distcp")


def _shard(form: str, sources: Sources, tmp: Path) -> Spec:
    folder = sources.copy("flat", tmp)
    bad = _keys_in(folder, _SHARD)
    make(form, folder / _SHARD)
    return Spec(folder, _SHARD, bad=bad, reference=sources.flat)


def _weight_map(form: str, sources: Sources, tmp: Path) -> Spec:
    folder = sources.copy("hub", tmp)
    weight_map = json.loads((folder / _INDEX).read_text())["weight_map"]
    shard = next(iter(weight_map.values()))
    make(form, folder / shard)
    bad = frozenset(k for k, v in weight_map.items() if v == shard)
    return Spec(folder, shard, bad=bad, reference=sources.hub)


_PLACES = {
    "opened": _opened,
    "metadata": _metadata,
    "rank-metadata": _rank_metadata,
    "shard": _shard,
    "weight-map": _weight_map,
}

CASES: dict[str, IsolatedGenerator] = {
    f"special:{form}@{place}": partial(build, form)
    for place, build in _PLACES.items()
    for form in FORMS
} | {"special:genuine@rank-metadata": partial(_rank_metadata, None)}
