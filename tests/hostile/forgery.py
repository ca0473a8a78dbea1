"""Class 1, memory corruption: numpy arrays and scalars whose dtype state is forged so an
object (``'O'``) field hides in a plain ``V8`` dtype (flags say "no objects"), and raw bytes
become object pointers. numpy builds them; ``repr`` (or a diff's hash) then dereferences
``0x4141414141414141``. The numpy globals themselves are on the data-pickle allow-list."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy

from tests.hostile import plant
from tests.hostile.case import IsolatedGenerator, Sources
from tests.hostile.isolated import Spec
from tests.hostile.opcodes import Reduce

_POINTER = b"\x41" * 8


def forged_dtype() -> Reduce:
    """``numpy.dtype('V8')`` whose state claims an object field at offset 0, flags 0."""
    state = (3, "|", None, ("a",), {"a": (numpy.dtype("O"), 0)}, 8, 1, 0)
    return Reduce(numpy.dtype, ("V8", False, True), state)


def forged_array() -> Reduce:
    """``_reconstruct(ndarray, (0,), b'b')`` set to one element of the forged dtype whose
    bytes are the fake pointer."""
    from numpy._core.multiarray import _reconstruct

    state = (1, (1,), forged_dtype(), False, _POINTER)
    return Reduce(_reconstruct, (numpy.ndarray, (0,), b"b"), state)


def forged_scalar() -> Reduce:
    from numpy._core.multiarray import scalar

    return Reduce(scalar, (forged_dtype(), _POINTER))


_FORGERIES = {"object-field": forged_array, "object-scalar": forged_scalar}


def _pt(forgery: str, sources: Sources, tmp: Path) -> Spec:
    """In a .pt next to genuine weights: one pickle, so refusing the file is in the promise."""
    path = plant.pt_with(sources, tmp, _FORGERIES[forgery]())
    return Spec(
        path,
        path.name,
        refused=None,
        maybe_bad=frozenset({plant.PT_KEY}),
        reference=sources.model_bin,
    )


def _object(forgery: str, sources: Sources, tmp: Path) -> Spec:
    """As a DCP object item: only that key may fail."""
    folder = plant.object_with(sources, tmp, _FORGERIES[forgery]())
    return Spec(
        folder,
        plant.item_file(folder, plant.OBJECT),
        maybe_bad=frozenset({plant.OBJECT}),
        reference=sources.flat,
    )


def _chunk(sources: Sources, tmp: Path) -> Spec:
    folder = plant.chunk_with(sources, tmp, forged_array())
    return Spec(folder, "__0_0.distcp", maybe_bad=frozenset({plant.TENSOR}), reference=sources.seed)


def _metadata(sources: Sources, tmp: Path) -> Spec:
    """numpy is never part of ``.metadata``: refused."""
    folder = plant.metadata_with(sources, tmp, forged_array(), plant.planner_entry(plant.TENSOR))
    return Spec(folder, ".metadata", refused=True)


CASES: dict[str, IsolatedGenerator] = {
    **{f"forgery:{f}@pt": partial(_pt, f) for f in _FORGERIES},
    **{f"forgery:{f}@object": partial(_object, f) for f in _FORGERIES},
    "forgery:object-field@chunk": _chunk,
    "forgery:object-field@metadata": _metadata,
}
