"""Class 5, allocation before validation: a few bytes that make the reader allocate
gigabytes. ``torch.Tensor(n)`` and numpy's ``_reconstruct(ndarray, (n,), ...)`` are
reachable from a data pickle; forty ``bytes(64 MiB)`` calls each pass the per-call cap; a
deflated ``data.pkl`` expands a thousandfold; and a genuine ``zeros(1).expand(2**31)``
(stride 0, 4 bytes on disk) must not be materialised as 8 GiB by export, diff or stats."""

from __future__ import annotations

import io
import zipfile
from functools import partial
from pathlib import Path

import numpy
import torch

from tests.hostile import opcodes, plant
from tests.hostile.case import IsolatedGenerator, Sources
from tests.hostile.isolated import Spec
from tests.hostile.opcodes import Reduce

_BOMB_BYTES = (1 << 30) - (1 << 20)  # zeros after the pickle's STOP: just under 1 GiB


def _tensor_call(numel: int) -> bytes:
    return opcodes.call(opcodes.glob("torch", "Tensor"), opcodes.integer(numel))


def _ndarray(numel: int) -> Reduce:
    from numpy._core.multiarray import _reconstruct

    return Reduce(_reconstruct, (numpy.ndarray, (numel,), b"b"))


def _many_bytes(count: int = 40, size: int = 1 << 26) -> bytes:
    call = opcodes.call(opcodes.glob("builtins", "bytes"), opcodes.integer(size))
    return opcodes.EMPTY_LIST + opcodes.MARK + call * count + b"e"  # APPENDS


_SNIPPETS = {
    "torch.Tensor(2^28)": partial(_tensor_call, 1 << 28),
    "torch.Tensor(2^30)": partial(_tensor_call, 1 << 30),
    "ndarray(2^33)": partial(_ndarray, 1 << 33),
    "bytes(2^26)x40": _many_bytes,
}


def _pt(snippet: str, sources: Sources, tmp: Path) -> Spec:
    path = plant.pt_with(sources, tmp, _SNIPPETS[snippet]())
    return Spec(
        path,
        path.name,
        refused=None,
        maybe_bad=frozenset({plant.PT_KEY}),
        reference=sources.model_bin,
    )


def _object(snippet: str, sources: Sources, tmp: Path) -> Spec:
    folder = plant.object_with(sources, tmp, _SNIPPETS[snippet]())
    file = plant.item_file(folder, plant.OBJECT)
    return Spec(folder, file, maybe_bad=frozenset({plant.OBJECT}), reference=sources.flat)


def deflate_bomb(archive: bytes) -> bytes:
    """The torch zip with ``data.pkl`` deflated and followed by zeros up to just under 1 GiB
    (after STOP, so the pickle itself is unchanged); about 5 MB."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for name, value in opcodes.records(archive).items():
            if not name.endswith("/data.pkl"):
                dst.writestr(zipfile.ZipInfo(name), value)
                continue
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            info._compresslevel = 1  # ZipInfo.compress_level from Python 3.13 on
            with dst.open(info, "w", force_zip64=True) as w:
                w.write(value)
                block = bytes(1 << 24)
                left = _BOMB_BYTES - len(value)
                while left > 0:
                    w.write(block[: min(left, len(block))])
                    left -= len(block)
    return out.getvalue()


def _deflate_pt(sources: Sources, tmp: Path) -> Spec:
    path = opcodes.write(tmp / "pytorch_model.bin", deflate_bomb(sources.model_bin.read_bytes()))
    return Spec(path, path.name, refused=None, reference=sources.model_bin)


def _deflate_chunk(sources: Sources, tmp: Path) -> Spec:
    folder = sources.copy("seed", tmp)
    plant.rewrite_item(folder, plant.TENSOR, deflate_bomb)
    return Spec(folder, "__0_0.distcp", maybe_bad=frozenset({plant.TENSOR}), reference=sources.seed)


def _expanded(shape: tuple[int, ...], sources: Sources, tmp: Path) -> Spec:
    """Genuine torch.save of a stride-0 view: 4 bytes of storage, ``shape`` elements."""
    state = {"zeros": torch.zeros(1).expand(*shape), "weight": torch.arange(12.0).reshape(3, 4)}
    path = plant.pt_of(tmp, state)
    return Spec(path, path.name, maybe_bad=frozenset({"zeros"}), then=path)


CASES: dict[str, IsolatedGenerator] = {
    **{f"alloc:{name}@pt": partial(_pt, name) for name in _SNIPPETS},
    **{
        f"alloc:{name}@object": partial(_object, name)
        for name in ("torch.Tensor(2^28)", "ndarray(2^33)")
    },
    "alloc:deflate-1GiB@pt": _deflate_pt,
    "alloc:deflate-1GiB@chunk": _deflate_chunk,
    "alloc:expand-2^31@pt": partial(_expanded, (1 << 31,)),
    "alloc:expand-2^40@pt": partial(_expanded, (1 << 20, 1 << 20)),
}
