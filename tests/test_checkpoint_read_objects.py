"""``ck.read_objects``: each key's value equals ``read_object``'s (``read``'s for a tensor),
read together."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import inspector
from inspector.errors import InspectorError

MEGATRON = Path(__file__).resolve().parent / "fixtures" / "megatron" / "distopt" / "iter_0000003"


def _objects(location: Path) -> tuple[inspector.Checkpoint, list[str]]:
    ck = inspector.open(location)
    return ck, [e.key for e in ck.entries() if e.kind == "object" and not e.error]


def test_equals_read_object_on_a_training_run(healthy_run: Path) -> None:
    ck, keys = _objects(healthy_run / "step-20")
    assert sum(k.endswith(".lr") for k in keys) > 10  # the same lr in every parameter group
    together = ck.read_objects(keys)
    assert list(together) == keys
    assert together == {k: ck.read_object(k) for k in keys}
    assert {type(v) for v in together.values()} >= {float, tuple, bool}


def test_step_tensors_as_read(healthy_run: Path) -> None:
    ck = inspector.open(healthy_run / "step-20")
    steps = [e.key for e in ck.entries() if e.kind == "tensor" and e.key.endswith(".step")]
    assert len(steps) > 10  # the same step for every parameter: decoded once
    together = ck.read_objects(steps)
    for key in steps:
        alone = ck.read(key)
        assert together[key].dtype == alone.dtype and torch.equal(together[key], alone)
    first, second = (together[k] for k in steps[:2])
    first.add_(1)  # copies, not one tensor shared
    assert torch.equal(second, ck.read(steps[1]))


def test_megatron_sharded_objects_as_read_object() -> None:
    """Shards of identical bytes are unwrapped as ``read_object`` unwraps them."""
    ck, keys = _objects(MEGATRON)
    assert sum("/shard_" in k for k in keys) >= 8
    together = ck.read_objects(keys)
    assert {k: repr(v) for k, v in together.items()} == {
        k: repr(ck.read_object(k)) for k in keys
    }


def test_views_of_one_storage_as_read(tmp_path: Path) -> None:
    """A matrix and its transpose share bytes, shape and dtype: each still reads as itself."""
    w = torch.arange(4.0).reshape(2, 2)
    torch.save({"w": w, "t": w.t(), "one": w[0, 0], "last": w[1, 1]}, tmp_path / "views.pt")
    ck = inspector.open(tmp_path / "views.pt")
    together = ck.read_objects(["w", "t", "one", "last"])
    assert torch.equal(together["t"], w.t()) and torch.equal(together["w"], w)
    assert (float(together["one"]), float(together["last"])) == (0.0, 3.0)


def test_errors_as_read_object(healthy_run: Path) -> None:
    ck, keys = _objects(healthy_run / "step-20")
    with pytest.raises(InspectorError) as alone:
        ck.read_object("optimizer.nope")
    with pytest.raises(type(alone.value), match=r"optimizer\.nope"):
        ck.read_objects([keys[0], "optimizer.nope"])
