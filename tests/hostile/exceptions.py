"""Class 6, exception types the readers do not expect: broken deflate and LZMA records
(``zlib.error``, ``LZMAError``), an encrypted zip flag (``RuntimeError``), per-rank metadata
whose ``state_dict_metadata`` is None (``AttributeError``), 5000-digit ints where text is
made of them (``ValueError``: Python refuses to print them), 100,000-level nesting
(``RecursionError``), list indices in planner paths that a nested export follows
(``IndexError``, a list of 10^9 entries) and an FP8 wrapper whose inner tensor is smaller
than its outer shape. Each must become an InspectorError naming the file and the key."""

from __future__ import annotations

import json
import zipfile
from functools import partial
from pathlib import Path
from typing import Any

from tests.fixtures.damage import dcp_metadata, header_of, write_header
from tests.hostile import opcodes, plant
from tests.hostile.case import IsolatedGenerator, Sources
from tests.hostile.isolated import Spec
from tests.hostile.memo import FP8_KEY
from tests.hostile.opcodes import MARKER
from tests.hostile.special_files import rank1_keys, split_by_rank

BIG = 10**5000
DEPTH = 100_000
_COMPRESSIONS = {"zlib": zipfile.ZIP_DEFLATED, "lzma": zipfile.ZIP_LZMA}


# --- zip records ------------------------------------------------------------------------------


def _broken(kind: str) -> Any:
    if kind == "encrypted":
        return partial(opcodes.flag_encrypted, suffix="/data.pkl")
    return partial(opcodes.corrupt_compressed, suffix="/data.pkl", kind=_COMPRESSIONS[kind])


def _record_pt(kind: str, sources: Sources, tmp: Path) -> Spec:
    data = _broken(kind)(sources.model_bin.read_bytes())
    path = opcodes.write(tmp / "pytorch_model.bin", data)
    return Spec(path, path.name, refused=True)


def _record_chunk(kind: str, sources: Sources, tmp: Path) -> Spec:
    folder = sources.copy("seed", tmp)
    plant.rewrite_item(folder, plant.TENSOR, _broken(kind))
    return Spec(folder, "__0_0.distcp", bad=frozenset({plant.TENSOR}), reference=sources.seed)


# --- .metadata fields -----------------------------------------------------------------------


def _rank_state_none(sources: Sources, tmp: Path) -> Spec:
    def edit(rank: int, metadata: Any) -> None:
        if rank == 1:
            metadata.state_dict_metadata = None

    folder = sources.copy("flat", tmp)
    split_by_rank(folder, edit)
    rank1 = rank1_keys(sources)
    return Spec(folder, "__1.metadata", maybe_bad=rank1, reference=sources.flat)


def _metadata_field(edit: str, sources: Sources, tmp: Path) -> Spec:
    """``.metadata`` with one field made of what Python cannot print or walk."""
    folder = sources.copy("seed", tmp)
    metadata = dcp_metadata(folder)
    snippet = None
    bad: frozenset[str] = frozenset()
    maybe_bad: frozenset[str] = frozenset()
    if edit == "bigint@version":
        metadata.version = BIG
    elif edit == "bigint@checkpoint_id":
        metadata.storage_meta.checkpoint_id = BIG
    elif edit == "deep@checkpoint_id":
        metadata.storage_meta.checkpoint_id, snippet = MARKER, opcodes.deep_list(DEPTH)
    elif edit == "bigint@planner":
        metadata.planner_data[plant.TENSOR] = ("norm", BIG)
        maybe_bad = frozenset({plant.TENSOR})
    elif edit == "bigint@chunk-offset":
        md = metadata.state_dict_metadata[plant.TENSOR]
        md.chunks[0].offsets = (BIG,)
        bad = frozenset({plant.TENSOR})
    plant.write_metadata(folder, metadata, snippet)
    return Spec(
        folder, ".metadata", refused=None, bad=bad, maybe_bad=maybe_bad, reference=sources.seed
    )


# --- .pt values and keys, DCP objects -------------------------------------------------------


def _pt_value(snippet: bytes, sources: Sources, tmp: Path) -> Spec:
    path = plant.pt_with(sources, tmp, snippet)
    return Spec(
        path,
        path.name,
        refused=None,
        maybe_bad=frozenset({plant.PT_KEY}),
        unknown_may_fail=True,
        reference=sources.model_bin,
    )


def _pt_big_key(sources: Sources, tmp: Path) -> Spec:
    """A genuine torch.save whose dict has an int key of 5000 digits."""
    import torch

    state = torch.load(sources.model_bin, weights_only=True)
    path = plant.pt_of(tmp, {**state, BIG: torch.ones(2)}, name="pytorch_model.bin")
    return Spec(path, path.name, refused=None, unknown_may_fail=True, reference=sources.model_bin)


def _deep_object(sources: Sources, tmp: Path) -> Spec:
    folder = plant.object_with(sources, tmp, opcodes.deep_list(DEPTH))
    file = plant.item_file(folder, plant.OBJECT)
    return Spec(folder, file, maybe_bad=frozenset({plant.OBJECT}), reference=sources.flat)


def _deep_sharding_info(sources: Sources, tmp: Path) -> Spec:
    """DCP's HF writer: ``DCP_SHARDING_INFO`` in the safetensors header nested 100,000 deep."""
    folder = sources.copy("dcp_hf", tmp)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = next(iter(index["weight_map"].values()))
    header, data = header_of(folder / shard)
    header["__metadata__"]["DCP_SHARDING_INFO"] = "[" * DEPTH + "]" * DEPTH
    write_header(folder / shard, header, data)
    keys = frozenset(k for k in header if k != "__metadata__")
    return Spec(folder, shard, refused=None, maybe_bad=keys, reference=sources.dcp_hf)


# --- planner paths a nested export follows ----------------------------------------------------


def _planner_index(index: int, sources: Sources, tmp: Path) -> Spec:
    key = plant.OBJECT
    folder = sources.copy("flat", tmp)
    metadata = dcp_metadata(folder)
    metadata.planner_data[key] = ("schedulers", index, "last_epoch")  # a list step
    plant.write_metadata(folder, metadata)
    return Spec(
        folder,
        ".metadata",
        maybe_bad=frozenset({key}),
        reference=sources.flat,
        exports=("pt-nested",),
    )


# --- FP8 wrappers ---------------------------------------------------------------------------


def smaller_inner(item: bytes) -> bytes:
    """The wrapper chunk with its inner ``_tensor`` cut to 2 of its 32 rows (the outer
    shape still says 32): the second ``(32, 64)`` the pickle spells."""
    pkl = opcodes.data_pkl(item)
    shape = b"K\x20K\x40\x86"
    first = pkl.index(shape)
    second = pkl.index(shape, first + 1)
    pkl = pkl[:second] + b"K\x02K\x40\x86" + pkl[second + len(shape) :]
    return opcodes.with_data_pkl(item, pkl)


def _fp8_inner_dcp(sources: Sources, tmp: Path) -> Spec:
    folder = sources.copy("fp8", tmp)
    plant.rewrite_item(folder, FP8_KEY, smaller_inner)
    file = plant.item_file(folder, FP8_KEY)
    return Spec(folder, file, bad=frozenset({FP8_KEY}), reference=sources.fp8)


def _fp8_inner_pt(sources: Sources, tmp: Path) -> Spec:
    item = plant.item_bytes(sources.fp8, FP8_KEY)
    path = opcodes.write(tmp / "wrapper.pt", smaller_inner(item))
    return Spec(path, path.name, refused=None, bad=frozenset({"wrapper"}))


CASES: dict[str, IsolatedGenerator] = {
    **{f"exc:{kind}@pt": partial(_record_pt, kind) for kind in ("zlib", "lzma", "encrypted")},
    **{f"exc:{kind}@chunk": partial(_record_chunk, kind) for kind in ("zlib", "lzma", "encrypted")},
    "exc:state_dict_metadata-None@rank-metadata": _rank_state_none,
    **{
        f"exc:{edit}@metadata": partial(_metadata_field, edit)
        for edit in (
            "bigint@version",
            "bigint@checkpoint_id",
            "deep@checkpoint_id",
            "bigint@planner",
            "bigint@chunk-offset",
        )
    },
    "exc:bigint@pt-key": _pt_big_key,
    "exc:deep-list@pt-value": partial(_pt_value, opcodes.deep_list(DEPTH)),
    "exc:deep-tuple@pt-value": partial(_pt_value, opcodes.deep_tuple(DEPTH)),
    "exc:deep-dict@pt-value": partial(_pt_value, opcodes.deep_dict(DEPTH)),
    "exc:deep-list@object": _deep_object,
    "exc:deep@DCP_SHARDING_INFO": _deep_sharding_info,
    "exc:negative-index@planner-export": partial(_planner_index, -5),
    "exc:huge-index@planner-export": partial(_planner_index, 10**9),
    "exc:fp8-inner-smaller@dcp": _fp8_inner_dcp,
    "exc:fp8-inner-smaller@pt": _fp8_inner_pt,
}
