"""``export(..., format="dcp")``: a torchtitan DCP folder from Hugging Face weights.

The reverse of :mod:`.hf_folder`: the adapter plans torchtitan names (of the chosen naming
generation, flat model keys as torchtitan saves them since July 2025) with the inverse
transforms; each HF expert becomes one chunk of torchtitan's stacked tensor, so no stack is
ever assembled in memory. torch's DCP loader and torchtitan's ``initial_load_path`` read
the result; it is re-read and compared chunk by chunk before the export returns.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from inspector.exporting.base import ExportResult, Meter, refuse_inside_source
from inspector.exporting.model_weights import ModelWeights, load_config, refuse_overlap
from inspector.exporting.verify import Verification
from inspector.formats.base import bytes_view
from inspector.formats.dcp.writer import Chunk, write_dcp

if TYPE_CHECKING:
    from collections.abc import Callable

    from inspector.checkpoint import Checkpoint
    from inspector.exporting.request import ExportRequest


def export_dcp(request: ExportRequest) -> ExportResult:
    """Write the request's HF-named weights as a torchtitan DCP folder."""
    from inspector.exporting import hf

    started = time.perf_counter()
    ck, out, naming = request.open(), request.out, request.naming or "torchtitan"
    refuse_inside_source(ck, out)
    refuse_overlap(out, {"hf_assets": request.hf_assets})
    weights = ModelWeights(ck, request.fp8, request.dtype)
    config = load_config(request.hf_config, request.hf_assets, ck)
    found = hf.from_hf(weights.metas(), config, request.arch or "auto", naming)
    chunks = [
        Chunk(o.name, weights.item(o), o.offsets or (0,) * len(o.shape), o.full_shape or o.shape)
        for o in found.outputs
    ]
    files, verification = write_and_verify(
        request, weights, chunks, lambda meter: write_dcp(out, chunks, meter, request.overwrite)
    )
    skipped = {weights.stored(k): why for k, why in found.left_out.items()} | weights.skipped
    conversions: dict[str, str] = {}
    names: dict[str, str] = {}
    for output, chunk in zip(found.outputs, chunks, strict=True):
        names.setdefault(weights.stored(output.source), output.name)  # not a fill made from it
        text = weights.conversion(output)
        if text:
            at = f" at {list(chunk.offsets)}" if chunk.item.shape != chunk.shape else ""
            conversions[f"{output.name}{at}"] = text
    return ExportResult(
        format="dcp",
        files=files,
        index=None,
        tensors=len({c.fqn for c in chunks}),
        objects=0,
        bytes=sum(c.item.nbytes for c in chunks),
        skipped=skipped,
        conversions=conversions,
        names=names,
        seconds=time.perf_counter() - started,
        verification=verification,
        arch=found.arch,
        reason=f"{found.reason}; written in {hf.NAMINGS[naming]}",
        notes=found.notes,
    )


def write_and_verify(
    request: ExportRequest,
    weights: ModelWeights,
    chunks: list[Chunk],
    write: Callable[[Meter], list[Path]],
) -> tuple[list[Path], Verification | None]:
    """Write the chunks with ``write`` (its progress metered), then, when the request asks,
    re-open the folder and compare every chunk; the weights' buffers released after each."""
    total = sum(c.item.nbytes for c in chunks)
    meter = request.meter(total)
    try:
        files = write(meter)
    finally:
        meter.close()
        weights.release()
    if not request.verify:
        return files, None
    checker = request.meter(total, "verify")
    try:
        return files, verify_chunks(request.out, chunks, checker)
    finally:
        checker.close()
        weights.release()


def verify_chunks(out: Path, chunks: list[Chunk], progress: Meter) -> Verification:
    """Re-open ``out`` and compare every stored chunk's bytes with a fresh production."""
    from inspector.checkpoint import open as open_checkpoint

    started = time.perf_counter()
    written = open_checkpoint(out)
    by_fqn: dict[str, dict[tuple[int, ...], Chunk]] = {}
    for chunk in chunks:
        by_fqn.setdefault(chunk.fqn, {})[chunk.offsets] = chunk
    mismatched = []
    for fqn, ours in by_fqn.items():
        if not _same_tensor(written, fqn, ours, progress):
            mismatched.append(fqn)
    return Verification(len(by_fqn), tuple(mismatched), time.perf_counter() - started)


def _same_tensor(written: Checkpoint, fqn: str, ours: dict, progress: Meter) -> bool:
    some = next(iter(ours.values()))
    if fqn not in written:
        return False
    entry = written.entry(fqn)
    if (entry.dtype, entry.shape, len(entry.chunks)) != (some.item.dtype, some.shape, len(ours)):
        return False
    for info, stored in written.iter_chunks(fqn):
        chunk = ours.get(tuple(info.offsets))
        if chunk is None or tuple(info.sizes) != chunk.item.shape:
            return False
        fresh = chunk.item.produce().contiguous()
        if bytes_view(stored.contiguous()) != bytes_view(fresh):
            return False
        progress(chunk.item)
    return True
