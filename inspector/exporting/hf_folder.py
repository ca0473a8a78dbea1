"""``export(..., format="hf")``: a Hugging Face model folder from a torchtitan checkpoint.

The architecture adapter (:mod:`.hf`) plans every HF tensor from one source weight; each is
read (FP8 handling first), transformed, optionally cast and written into sharded
safetensors one at a time, next to ``config.json`` (checked against the weights) and the
asset files of ``hf_assets`` copied byte for byte. Everything appears under its final name
only when all of it was written, then the shards are re-read and compared.

A tied head (torchtitan saves both ``lm_head`` and the embedding) is left out only after
it was compared with the embedding: one that differs is refused (the config says tied,
the weights say otherwise), with the advice to pass ``tie_word_embeddings=False``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from inspector import dtypes
from inspector.exporting import plan as planning
from inspector.exporting import verify as checking
from inspector.exporting.base import ExportResult, Meter, refuse_inside_source
from inspector.exporting.model_weights import (
    CONFIG_NAME,
    HF_FP8_MODES,
    ModelWeights,
    asset_files,
    compare_tied,
    copy_asset,
    load_config,
    refuse_overlap,
)
from inspector.exporting.plan import INDEX_NAME, Planned
from inspector.formats.safetensors import index_text, safetensors_dtype, write_safetensors
from inspector.formats.writing import Item
from inspector.storage.local import AtomicFiles, atomic_files, new_folder
from inspector.version import __version__

if TYPE_CHECKING:
    from inspector.checkpoint import Checkpoint
    from inspector.exporting.request import ExportRequest


def export_hf(request: ExportRequest) -> ExportResult:
    """Write the request's model as an HF folder (see :func:`inspector.export`)."""
    from inspector.exporting import hf

    started = time.perf_counter()
    ck, out = request.open(), request.out
    refuse_inside_source(ck, out)
    refuse_overlap(out, {"hf_assets": request.hf_assets})
    weights = ModelWeights(ck, request.fp8, request.dtype, HF_FP8_MODES)
    config = load_config(request.hf_config, request.hf_assets, ck)
    found = hf.to_hf(weights.metas(), config, request.arch or "auto", ck.run_args)
    compare_tied(weights, found.must_equal)
    assets = asset_files(request.hf_assets)
    planned = [
        Planned(weights.item(o), weights.stored(o.source), (o.name,), weights.conversion(o))
        for o in found.outputs
    ]
    names = _names(planned)
    config = with_dtype(found.config, [p.item for p in planned])
    if request.fp8 == "quantize":
        planned, quantization = _quantized(planned, request.fp8_scheme)
        config = config | {"quantization_config": quantization}
    items = [p.item for p in planned]
    for item in items:
        safetensors_dtype(item.dtype, item.name)
    meter = request.meter(sum(i.nbytes for i in items))
    before = checking.SourceState(ck)
    try:
        with new_folder(out), atomic_files(out, request.overwrite) as files:
            metadata = _metadata(ck, found.arch)
            index, crcs = _write_shards(
                files, out, items, request.shard_limit, metadata, meter, request.verify
            )
            files.temp_for(out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
            for asset in assets:
                copy_asset(asset, files.temp_for(out / asset.name))
            written = files.commit()
    finally:
        meter.close()
        weights.release()
    verification = None
    if request.verify:
        checker = request.meter(sum(i.nbytes for i in items), "verify")
        try:
            target = index or out / planning.shard_names(1)[0]
            verification = checking.verify(target, planned, False, checker, crcs, before)
        finally:
            checker.close()
            weights.release()
    skipped = {weights.stored(k): why for k, why in found.left_out.items()} | weights.skipped
    return ExportResult(
        format="hf",
        files=[p for p in written if p != index],
        index=index,
        tensors=len(items),
        objects=0,
        bytes=sum(i.nbytes for i in items),
        skipped=skipped,
        conversions={p.item.name: p.conversion for p in planned if p.conversion},
        names=names,
        seconds=time.perf_counter() - started,
        verification=verification,
        arch=found.arch,
        reason=found.reason,
        notes=found.notes,
    )


def with_dtype(config: dict, items: list[Item]) -> dict:
    """The config with its dtype (``torch_dtype``, and ``dtype`` as transformers 5 spells it,
    where present) set to the dtype most of the written bytes have."""
    by_bytes: Counter[str] = Counter()
    for item in items:
        if dtypes.is_floating(item.dtype):
            by_bytes[item.dtype] += item.nbytes
    if not by_bytes:
        return config
    dtype = by_bytes.most_common(1)[0][0]
    keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]
    return config | dict.fromkeys(keys, dtype)


def _quantized(planned: list[Planned], scheme: str) -> tuple[list[Planned], dict]:
    """The plan with its linear weights as FP8 + scale under ``scheme``, and the config
    entry."""
    from inspector.exporting.quantize import split_items

    split, entry = split_items([p.item for p in planned], scheme)
    quantized = [
        Planned(item, p.entry_key, (item.name,), _fp8_conversion(p, item, len(s), scheme))
        for p, s in zip(planned, split, strict=True)
        for item in s
    ]
    return quantized, entry


def _fp8_conversion(planned: Planned, item: Item, parts: int, scheme: str) -> str | None:
    from inspector.exporting.quantize import describe

    if parts == 1:
        return planned.conversion
    what = "to float8_e4m3fn" if item.dtype == "float8_e4m3fn" else describe(scheme)
    return f"{planned.conversion or planned.entry_key}; {what}"


def _write_shards(
    files: AtomicFiles,
    out: Path,
    items: list[Item],
    limit: int,
    metadata: dict[str, str],
    meter: Meter,
    checksums: bool,
) -> tuple[Path | None, dict[str, int]]:
    """``model.safetensors``, or shards plus the index (returned) when past ``limit``; each
    item's CRC-32 by name with ``checksums``."""
    shards = planning.plan_shards(items, limit)
    names = planning.shard_names(len(shards))
    crcs: dict[str, int] = {}
    for name, shard in zip(names, shards, strict=True):
        temp = files.temp_for(out / name)
        crcs.update(write_safetensors(temp, shard, metadata, meter, checksums=checksums))
    if len(shards) == 1:
        return None, crcs
    index = out / INDEX_NAME
    weight_map = {i.name: name for name, shard in zip(names, shards, strict=True) for i in shard}
    files.temp_for(index).write_text(index_text(weight_map, sum(i.nbytes for i in items)))
    return index, crcs


def _metadata(ck: Checkpoint, arch: str) -> dict[str, str]:
    return {
        "format": "pt",  # what transformers requires of a PyTorch safetensors file
        "source": ck.location,
        "source_format": ck.format,
        "arch": arch,
        "exported_by": f"checkpoint-inspector {__version__}",
    }


def _names(planned: list[Planned]) -> dict[str, str]:
    """Stored key -> HF name, for the sources written under one name (not expert stacks)."""
    by_key: dict[str, list[str]] = {}
    for p in planned:
        by_key.setdefault(p.entry_key, []).append(p.item.name)
    return {key: names[0] for key, names in by_key.items() if len(names) == 1 and key != names[0]}
