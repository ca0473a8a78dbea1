"""File names that lead out of the checkpoint folder: ``_StorageInfo.relative_path`` and
``*.index.json`` weight_map entries with ``..``, absolute paths, backslashes or NUL, and
files that are symlinks to outside. The file outside is always a genuine copy, so
following the name would "work": only the refusal keeps it out."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from tests.fixtures.damage import dcp_metadata, repoint, write_dcp_metadata
from tests.hostile.case import Case, Generator, Genuine

_OUTSIDE = "outside the checkpoint folder"
_KEY = "norm.weight"


def _outside(genuine: Genuine, tmp: Path, name: str, file: str) -> Path:
    """A genuine copy of ``file`` of checkpoint ``name`` in ``tmp/outside/``."""
    target = tmp / "outside" / file
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes((getattr(genuine, name) / file).read_bytes())
    return target


def _dcp_name(kind: str, genuine: Genuine, tmp: Path) -> Case:
    folder = genuine.copy("seed", tmp / "checkpoint")
    outside = _outside(genuine, tmp, "seed", "__0_0.distcp")
    name = {
        "parent": "../outside/__0_0.distcp",
        "absolute": str(outside),
        "backslash": "..\\outside\\__0_0.distcp",
        "nul": "__0_0.distcp\x00/../../outside/__0_0.distcp",
    }[kind]
    metadata = dcp_metadata(folder)
    repoint(metadata, _KEY, relative_path=name)
    write_dcp_metadata(folder, metadata)
    says = "bad file name" if kind == "nul" else _OUTSIDE
    return Case(folder, "__0_0.distcp", says=says, bad=frozenset({_KEY}), reference=genuine.seed)


def _dcp_symlink(genuine: Genuine, tmp: Path) -> Case:
    folder = genuine.copy("seed", tmp / "checkpoint")
    outside = _outside(genuine, tmp, "seed", "__0_0.distcp")
    (folder / "__0_0.distcp").unlink()
    (folder / "__0_0.distcp").symlink_to(outside)
    keys = frozenset(dcp_metadata(folder).state_dict_metadata)
    return Case(folder, "__0_0.distcp", says=_OUTSIDE, bad=keys, reference=genuine.seed)


def _index(genuine: Genuine, tmp: Path) -> tuple[Path, dict, str, str]:
    """A hub folder copy, its index, and its first key and that key's shard."""
    folder = genuine.copy("hub", tmp / "checkpoint")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    key, shard = next(iter(index["weight_map"].items()))
    return folder, index, key, shard


def _index_name(kind: str, genuine: Genuine, tmp: Path) -> Case:
    folder, index, key, shard = _index(genuine, tmp)
    outside = _outside(genuine, tmp, "hub", shard)
    name = {"parent": f"../outside/{shard}", "absolute": str(outside)}[kind]
    index["weight_map"][key] = name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return Case(folder, shard, says=_OUTSIDE, bad=frozenset({key}), reference=genuine.hub)


def _index_symlink(genuine: Genuine, tmp: Path) -> Case:
    folder, index, _, shard = _index(genuine, tmp)
    outside = _outside(genuine, tmp, "hub", shard)
    (folder / shard).unlink()
    (folder / shard).symlink_to(outside)
    keys = frozenset(k for k, v in index["weight_map"].items() if v == shard)
    return Case(folder, shard, says=_OUTSIDE, bad=keys, reference=genuine.hub)


CASES: dict[str, Generator] = {
    **{
        f"path:{kind}@relative_path": partial(_dcp_name, kind)
        for kind in ("parent", "absolute", "backslash", "nul")
    },
    "path:symlink@distcp": _dcp_symlink,
    **{f"path:{kind}@weight_map": partial(_index_name, kind) for kind in ("parent", "absolute")},
    "path:symlink@shard": _index_symlink,
}
