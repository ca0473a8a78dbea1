"""torchao integer weights (Int8Tensor, IntxUnpackedToInt8Tensor): described from pickles and
dequantized bit for bit like torchao's own ``dequantize``, in .pt, DCP and torch_checkpointing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import inspector
from inspector import tensors as fp8
from inspector.exporting.fp8 import plan_fp8
from tests.fixtures import fp8_checkpoints as fx
from tests.fixtures.torch_checkpointing import make_manager
from tests.tensors.test_fp8 import dcp_save, run_without_torchao, same_bits, via_archive

FACTS = {
    "w8_row": ("Int8Tensor", "int8 data + per-row scale + zero point"),
    "w8_group": ("Int8Tensor", "int8 data + group 32 scale + zero point"),
    "w8a8": (
        "Int8Tensor",
        "int8 data + per-row scale + zero point, dynamic activation quantization",
    ),
    "int4_g32": ("IntxUnpackedToInt8Tensor", "int4 in int8 + group 32 scale + zero point"),
    "int2_g32_asym": ("IntxUnpackedToInt8Tensor", "int2 in int8 + group 32 scale + zero point"),
    "int8_axis": ("IntxUnpackedToInt8Tensor", "int8 data + per-row scale + zero point"),
    "int4_g64_fp32": ("IntxUnpackedToInt8Tensor", "int4 in int8 + group 64 scale + zero point"),
}
# dcp.save refuses IntxUnpackedToInt8Tensor in torchao 0.18 (no aten.is_pinned for it).
DCP_SAVES = ("w8_row", "w8_group", "w8a8")


@pytest.fixture(scope="session")
def int_objects() -> dict[str, torch.Tensor]:
    return fx.int_payloads(fx.weight())


@pytest.fixture(scope="session")
def int_pt(int_objects, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("int") / "int.pt"
    torch.save(int_objects, path)
    return path


def torchao_value(obj: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torchao's own dequantization (IntxUnpackedToInt8Tensor takes no dtype: cast after)."""
    if type(obj).__name__ == "Int8Tensor":
        return obj.dequantize(dtype)
    value = obj.dequantize()
    return value if dtype is None else value.to(dtype)


def test_int_payloads_described_and_dequantized_like_torchao(int_objects, int_pt: Path) -> None:
    described, values = via_archive(int_pt)
    assert set(described) == set(FACTS)
    for name, (label, facts) in FACTS.items():
        found = fp8.describe(described[name])
        assert (found.kind, found.payload, found.subclass, found.fp8) == (
            "payload",
            "int",
            label,
            facts,
        ), name
        assert found.parts == ("scale", "zero_point")
        obj = int_objects[name]
        assert same_bits(fp8.dequantize(values[name]), torchao_value(obj)), name
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert same_bits(fp8.dequantize(values[name], dtype=dtype), torchao_value(obj, dtype))


def test_int_payloads_in_dcp_read_and_planned(int_objects, tmp_path: Path) -> None:
    state = {f"{name}.weight": int_objects[name] for name in DCP_SAVES}
    ck = inspector.open(dcp_save(state, tmp_path / "int"))
    ck.scan(progress=False)
    for name in DCP_SAVES:
        obj, key = int_objects[name], f"{name}.weight"
        assert (ck.facts(key).subclass, ck.facts(key).fp8) == FACTS[name]
        assert ck.entry(key).dtype == str(obj.dtype).removeprefix("torch.")
        assert same_bits(ck.read(key), torchao_value(obj))
        assert same_bits(ck.read(key, dtype="float32"), torchao_value(obj, torch.float32))
    outputs, _ = plan_fp8(ck, ["w8_row.weight", "w8_group.weight"], mode="keep")
    got = {o.name: o.read() for o in outputs}
    assert list(got) == [
        "w8_row.weight",
        "w8_row.weight_scale",
        "w8_row.weight_zero_point",
        "w8_group.weight",
        "w8_group.weight_scale",
        "w8_group.weight_zero_point",
    ]
    for name in ("w8_row", "w8_group"):
        obj = int_objects[name]
        assert same_bits(got[f"{name}.weight"], obj.qdata)
        assert same_bits(got[f"{name}.weight_scale"], obj.scale)
        assert same_bits(got[f"{name}.weight_zero_point"], obj.zero_point)


def test_int_payloads_in_torch_checkpointing_item(int_objects, tmp_path: Path) -> None:
    from torch_checkpointing import ItemSpec

    manager = make_manager({"model": ItemSpec(), "step": ItemSpec()})
    try:
        manager.save(str(tmp_path / "step_1"), {"model": dict(int_objects), "step": 1})
    finally:
        manager.close()
    ck = inspector.open(tmp_path / "step_1")
    assert ck.format == "torch-checkpointing"
    for name, obj in int_objects.items():
        assert same_bits(ck.read(f"model.{name}"), torchao_value(obj)), name
    assert ck.read_object("step") == 1


def test_int_dequantize_needs_no_torchao(int_pt: Path, int_objects) -> None:
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from tests.tensors.test_fp8 import via_archive\n"
        "from inspector import tensors as fp8\n"
        "_, values = via_archive(Path(sys.argv[1]))\n"
        "out = {k: fp8.dequantize(v).float().double().sum().item() for k, v in values.items()}\n"
        "print(json.dumps({'torchao': sys.modules.get('torchao') is not None, 'out': out}))\n"
    )
    got = run_without_torchao(code, str(int_pt))
    assert got["out"] == {
        k: torchao_value(obj).float().double().sum().item() for k, obj in int_objects.items()
    }
