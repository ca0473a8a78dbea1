"""Class 7, cross-checkpoint poisoning: pickle's ``BUILD`` applied to a stand-in the
unpickler hands out from module-level tables (the ``torch.FloatStorage`` stand-in, the
DCP record classes, ``torch.nn.Parameter``, a rebuild function) rewrites state every later
checkpoint in the process shares. The child opens the hostile file, then a genuine one,
which must read exactly as torch's own reader reads it; any change to the stand-ins'
state fails the case too."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from tests.hostile import opcodes, plant
from tests.hostile.case import IsolatedGenerator, Sources
from tests.hostile.isolated import Spec
from tests.hostile.opcodes import MARKER, glob


def build(target: bytes, **fields: bytes) -> bytes:
    """``target`` BUILT with a state dict (``__dict__`` update): what an instance gets."""
    return target + opcodes.dictionary(fields) + opcodes.BUILD


def build_slots(target: bytes, **fields: bytes) -> bytes:
    """``target`` BUILT with ``(None, slots)``: ``setattr`` for each field, classes too."""
    state = opcodes.NONE + opcodes.dictionary(fields) + opcodes.TUPLE2
    return target + state + opcodes.BUILD


FLOAT_AS_INT = build(glob("torch", "FloatStorage"), dtype=glob("torch", "int32"))
UNTYPED_AS_HALF = build(glob("torch", "UntypedStorage"), dtype=glob("torch", "float16"))


def _pt(snippet: bytes, then: str, sources: Sources, tmp: Path) -> Spec:
    path = plant.pt_with(sources, tmp, snippet)
    return Spec(
        path,
        path.name,
        refused=None,
        maybe_bad=frozenset({plant.PT_KEY}),
        reference=sources.model_bin,
        then=getattr(sources, then),
    )


def _untyped(sources: Sources, tmp: Path) -> Spec:
    """The later genuine file stores float8 and uint16 tensors: untyped storages."""
    genuine = plant.pt_of(
        tmp / "genuine",
        {
            "f8": torch.linspace(-2, 2, 24).reshape(4, 6).to(torch.float8_e4m3fn),
            "u16": torch.arange(10).to(torch.uint16),
        },
    )
    path = plant.pt_with(sources, tmp / "hostile", UNTYPED_AS_HALF)
    return Spec(
        path,
        path.name,
        refused=None,
        maybe_bad=frozenset({plant.PT_KEY}),
        reference=sources.model_bin,
        then=genuine,
    )


def _object(sources: Sources, tmp: Path) -> Spec:
    folder = plant.object_with(sources, tmp, FLOAT_AS_INT)
    return Spec(
        folder,
        plant.item_file(folder, plant.OBJECT),
        maybe_bad=frozenset({plant.OBJECT}),
        reference=sources.flat,
        then=sources.model_bin,
    )


def _legacy(sources: Sources, tmp: Path) -> Spec:
    """A pre-1.6 file (several pickles, then the storages) carrying the BUILD; the genuine
    one after it is pre-1.6 too (dtypes torch.load reads back from that format)."""
    state = {"weight": torch.linspace(-1, 1, 12).reshape(3, 4), "steps": torch.arange(5)}
    genuine = opcodes.write(tmp / "genuine" / "legacy.pth", _legacy_saved(state))
    hostile = _legacy_saved({**state, plant.PT_KEY: MARKER})
    path = opcodes.write(tmp / "hostile" / "legacy.pth", opcodes.splice(hostile, FLOAT_AS_INT))
    return Spec(
        path,
        path.name,
        refused=None,
        maybe_bad=frozenset({plant.PT_KEY}),
        reference=genuine,
        then=genuine,
    )


def _legacy_saved(value: object) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


def _metadata(name: str, sources: Sources, tmp: Path) -> Spec:
    """The record class ``name`` gets ``__setstate__ = tuple`` (``torch.Size``'s stand-in):
    every later ``.metadata`` would lose those records' fields. (``TensorProperties`` has a
    ``__setstate__`` of its own, which BUILD calls instead.)"""
    target = glob("torch.distributed.checkpoint.metadata", name)
    snippet = build_slots(target, __setstate__=glob("torch", "Size"))
    folder = plant.metadata_with(sources, tmp, snippet, plant.planner_entry(plant.TENSOR))
    return Spec(
        folder,
        ".metadata",
        refused=None,
        maybe_bad=frozenset({plant.TENSOR}),
        reference=sources.seed,
        then=sources.seed,
    )


PARAMETER_REPR = build_slots(
    glob("torch.nn.parameter", "Parameter"), __repr__=glob("builtins", "str")
)
REBUILD_DEFAULTS = build_slots(
    glob("torch._utils", "_rebuild_tensor_v2"), __defaults__=opcodes.EMPTY_TUPLE
)

CASES: dict[str, IsolatedGenerator] = {
    "poison:FloatStorage@pt": partial(_pt, FLOAT_AS_INT, "model_bin"),
    "poison:UntypedStorage@pt": _untyped,
    "poison:FloatStorage@object": _object,
    "poison:FloatStorage@legacy": _legacy,
    "poison:TensorProperties@metadata": partial(_metadata, "TensorProperties"),
    "poison:Metadata@metadata": partial(_metadata, "Metadata"),
    "poison:ChunkStorageMetadata@metadata": partial(_metadata, "ChunkStorageMetadata"),
    "poison:Parameter@pt": partial(_pt, PARAMETER_REPR, "model_bin"),
    "poison:rebuild-defaults@pt": partial(_pt, REBUILD_DEFAULTS, "model_bin"),
}
