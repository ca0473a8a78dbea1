"""Class 8, containment in a Hugging Face cache: a snapshot's files are links into the same
repository's ``blobs/`` (``models--org--name/snapshots/<rev>/x -> ../../blobs/<sha>``), the
one kind of outside link followed. It is genuine only if ``blobs/`` is the repository's own
folder; a ``blobs`` that is itself a symlink, links into another repository's blobs and a
blob that is a link elsewhere lead outside, and the keys stored there must be refused."""

from __future__ import annotations

import hashlib
import os
from functools import partial
from pathlib import Path

from tests.fixtures.damage import dcp_metadata
from tests.hostile.case import IsolatedGenerator, Sources
from tests.hostile.isolated import Spec

_OUTSIDE = "outside the checkpoint folder"


def cache_snapshot(source: Path, cache: Path, repo: str, blobs: Path | None = None) -> Path:
    """``source``'s files laid out as huggingface_hub caches them: content-named blobs (in
    ``blobs`` when given, else the repository's own ``blobs/``), linked from the snapshot."""
    root = cache / f"models--org--{repo}"
    snapshot = root / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    store = blobs or root / "blobs"
    store.mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in source.iterdir() if p.is_file()):
        data = file.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        (store / sha).write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(store / sha, snapshot))
    return snapshot


def _blobs_linked_away(source: str, sources: Sources, tmp: Path) -> Spec:
    """``blobs`` is a symlink to a folder outside the repository holding the genuine blobs."""
    elsewhere = tmp / "elsewhere" / "blobs"
    snapshot = cache_snapshot(getattr(sources, source), tmp / "cache", "tiny", blobs=elsewhere)
    (snapshot.parents[1] / "blobs").symlink_to(elsewhere)
    for link in snapshot.iterdir():  # point through the repository's blobs/ link
        target = os.readlink(link)
        link.unlink()
        link.symlink_to(os.path.join("..", "..", "blobs", os.path.basename(target)))
    return _expect_refused(source, sources, snapshot)


def _expect_refused(source: str, sources: Sources, snapshot: Path) -> Spec:
    genuine = getattr(sources, source)
    if source == "hub":
        return Spec(
            snapshot, "model-0000", says=_OUTSIDE, bad=_hub_keys(genuine), reference=genuine
        )
    keys = frozenset(dcp_metadata(genuine).state_dict_metadata)
    return Spec(snapshot, "__0_0.distcp", says=_OUTSIDE, bad=keys, reference=genuine)


def _hub_keys(folder: Path) -> frozenset[str]:
    import json

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return frozenset(index["weight_map"])


def _genuine(sources: Sources, tmp: Path) -> Spec:
    snapshot = cache_snapshot(sources.hub, tmp / "cache", "tiny")
    return Spec(snapshot, reference=sources.hub)


def _other_repository(sources: Sources, tmp: Path) -> Spec:
    """Links into another cached repository's (real) blobs folder."""
    other = tmp / "cache" / "models--org--other" / "blobs"
    snapshot = cache_snapshot(sources.hub, tmp / "cache", "tiny", blobs=other)
    (snapshot.parents[1] / "blobs").mkdir()
    return _expect_refused("hub", sources, snapshot)


def _blob_is_a_link(sources: Sources, tmp: Path) -> Spec:
    """The repository's blobs/ is real, but each blob is a link to a file outside it."""
    snapshot = cache_snapshot(sources.hub, tmp / "cache", "tiny")
    outside = tmp / "outside"
    outside.mkdir()
    for blob in (snapshot.parents[1] / "blobs").iterdir():
        moved = outside / blob.name
        blob.rename(moved)
        blob.symlink_to(moved)
    return _expect_refused("hub", sources, snapshot)


CASES: dict[str, IsolatedGenerator] = {
    "contain:genuine@hub-cache": _genuine,
    "contain:blobs-symlink@hub-cache": partial(_blobs_linked_away, "hub"),
    "contain:blobs-symlink@dcp-cache": partial(_blobs_linked_away, "seed"),
    "contain:other-repository@hub-cache": _other_repository,
    "contain:blob-is-a-link@hub-cache": _blob_is_a_link,
}
