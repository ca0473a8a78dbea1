"""Dtype names: one vocabulary without torch, and the torch dtype on demand."""

from __future__ import annotations

import pytest
import torch

from inspector import dtypes
from inspector.errors import InspectorError


def test_every_torch_dtype_has_its_name_and_size() -> None:
    found = {v for n in dir(torch) if isinstance(v := getattr(torch, n), torch.dtype)}
    for dtype in found:
        name = dtypes.name_of(dtype)
        assert name == str(dtype).removeprefix("torch.")
        assert dtypes.itemsize(name) == dtype.itemsize, name
        assert dtypes.to_torch(name) is dtype
        assert dtypes.is_complex(name) == dtype.is_complex, name


def test_names_aliases_and_prefixes() -> None:
    assert dtypes.name_of("bfloat16") == "bfloat16"
    assert dtypes.name_of("torch.float16") == dtypes.name_of("half") == "float16"
    assert dtypes.name_of(torch.float) == "float32"
    assert dtypes.optional_name(None) is None
    short = ["bf16", "BF16", "fp16", "fp32", "Fp64"]
    assert [dtypes.name_of(n) for n in short] == [
        "bfloat16", "bfloat16", "float16", "float32", "float64"
    ]
    assert {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"} == dtypes.FLOAT8


@pytest.mark.parametrize("wrong", ["float33", "Tensor", "", 7, None])
def test_bad_names_are_usage_errors(wrong: object) -> None:
    with pytest.raises(InspectorError, match="unknown dtype") as caught:
        dtypes.name_of(wrong)
    assert isinstance(caught.value, ValueError)
    assert "bfloat16" in str(caught.value)  # the message lists valid names


def test_short_names_reach_reads_and_exports(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    import inspector

    dcp.save({"w": torch.randn(4, 3)}, storage_writer=dcp.FileSystemWriter(tmp_path / "c"),
             no_dist=True)
    ck = inspector.open(tmp_path / "c")
    assert torch.equal(ck.read("w", dtype="bf16"), ck.read("w").to(torch.bfloat16))
    inspector.export(ck, tmp_path / "out.safetensors", dtype="fp16")
    from safetensors.torch import load_file

    assert load_file(tmp_path / "out.safetensors")["w"].dtype == torch.float16
