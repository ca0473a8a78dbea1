"""Class 9, numpy values: arrays torch.save pickles under ``numpy._core.multiarray`` (numpy 2)
and under the old ``numpy.core.multiarray`` names (numpy 1, as every older HF Trainer
``rng_state.pth`` and Megatron RNG state holds them), with ``numpy.dtype`` and
``_codecs.encode`` bytes, decode as numpy arrays equal to the saved ones; the array is built
only from checked bytes (the audit-hook guard sees no code run and no new import)."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

from tests.hostile.trust import Report, TrustCase

OLD, NEW = b"numpy.core.multiarray", b"numpy._core.multiarray"


def _state(kind: str) -> dict[str, Any]:
    import numpy
    import torch

    if kind == "trainer-rng":  # transformers.Trainer._save_rng_state
        numpy.random.seed(1234)
        numpy.random.rand(7)
        return {"python": ("py", 3), "numpy": numpy.random.get_state(),
                "cpu": torch.random.get_rng_state()}
    if kind == "megatron-rng":  # megatron.training.checkpointing.get_rng_state
        numpy.random.seed(99)
        return {"rng_state": [{"random_rng_state": ("py", 1),
                               "np_rng_state": numpy.random.get_state(),
                               "torch_rng_state": torch.get_rng_state()}]}
    return {
        "f4": numpy.linspace(-1, 1, 12, dtype=numpy.float32).reshape(3, 4),
        "i8": numpy.arange(-5, 5, dtype=numpy.int64),
        "u1": numpy.frombuffer(b"\x00\x01\xff", dtype=numpy.uint8),
        "b1": numpy.array([True, False, True]),
        "f2": numpy.array([0.5, -2.0], dtype=numpy.float16),
        "f8-fortran": numpy.asfortranarray(numpy.arange(6.0).reshape(2, 3)),
        "empty": numpy.zeros((0, 4), dtype=numpy.float32),
        "scalar": numpy.float64(2.5),
    }


def _old_names(path: Path) -> None:
    """Rewrite the archive's pickle to name numpy's modules as numpy 1 did."""
    with zipfile.ZipFile(path) as z:
        records = [(i, z.read(i)) for i in z.infolist()]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info, data in records:
            if info.filename.endswith("data.pkl"):
                assert NEW in data
                data = data.replace(NEW, OLD)
            z.writestr(info.filename, data)
    path.write_bytes(out.getvalue())


def _same(got: Any, want: Any) -> None:
    import numpy
    import torch

    if isinstance(want, numpy.ndarray):
        assert type(got) is numpy.ndarray, type(got)
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
        assert numpy.array_equal(got, want), (got, want)
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert set(got) == set(want)
        for k in want:
            _same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _same(g, w)
    else:
        assert got == want, (got, want)


def run(args: dict[str, Any], report: Report) -> None:
    import torch

    import inspector
    from tests.hostile.guard import guarded

    tmp = Path(args["tmp"])
    state = _state(args["state"])
    path = tmp / "rng_state.pth"
    torch.save(state, path)
    if args["names"] == "old":
        _old_names(path)
    with guarded(tmp):
        ck = inspector.open(path)
        for key in ck.keys():
            entry = ck.entry(key)
            assert entry.error is None, (key, entry.error)
            got = ck.read(key) if entry.kind == "tensor" else ck.read_object(key)
            want: Any = state
            for part in entry.nested_path or (key,):
                want = want[part]
            _same(got, want)
        rows = inspector.diff(ck, ck, progress=False)
        assert rows.status.eq("same").all()
    report({"keys": len(ck.keys())})


CASES = {
    f"numpy:{state}@{names}": TrustCase(
        "tests.hostile.numpy_values:run", {"state": state, "names": names}
    )
    for state in ("trainer-rng", "megatron-rng", "arrays")
    for names in ("new", "old")
}
