"""Single safetensors files: written by ``safetensors.torch.save_file``, read back bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import inspector
from inspector.dtypes import name_of
from inspector.errors import CorruptCheckpointError
from tests.fixtures.damage import (
    bytes_read,
    copy,
    edit_header,
    header_of,
    truncate,
    write_header,
)
from tests.fixtures.formats import FLOAT8, same


def test_every_dtype_read_bit_exact(safetensors_written: dict) -> None:
    written = safetensors_written["single"]
    ck = inspector.open(written.path)
    assert ck.format == "safetensors"
    assert ck.source_files == ("zoo.safetensors",)
    assert ck.keys() == list(header_of(written.path)[0])[1:]  # after __metadata__
    assert set(ck.keys()) == set(written.state)
    for key, want in written.state.items():
        entry = ck.entry(key)
        assert (entry.kind, entry.dtype, entry.shape) == (
            "tensor",
            name_of(want.dtype),
            tuple(want.shape),
        )
        assert same(ck.read(key), want), key
    assert {ck.entry(f"zoo.{str(dt).removeprefix('torch.')}").dtype for dt in FLOAT8} == set(
        map(name_of, FLOAT8)
    )


def test_metadata_is_the_files_own(safetensors_written: dict) -> None:
    ck = inspector.open(safetensors_written["single"].path)
    assert ck.metadata == {"format": "pt", "producer": "tests"}
    with safe_open(safetensors_written["single"].path, framework="pt") as f:
        assert ck.metadata == f.metadata()


def test_agrees_with_safetensors_own_reader(safetensors_written: dict) -> None:
    path = safetensors_written["single"].path
    ck = inspector.open(path)
    skip = {"zoo.float8_e8m0fnu", "zoo.float4_e2m1fn_x2"}  # safetensors' torch loader lacks them
    with safe_open(path, framework="pt") as f:
        reference = {k: f.get_tensor(k) for k in f.keys() if k not in skip}
    assert len(reference) == len(ck.keys()) - len(skip)
    for key, want in reference.items():
        assert same(ck.read(key), want), key


def test_entries_point_at_their_bytes(safetensors_written: dict) -> None:
    path = safetensors_written["single"].path
    ck = inspector.open(path)
    header, _ = header_of(path)
    data_start = path.stat().st_size - sum(
        v["data_offsets"][1] - v["data_offsets"][0]
        for k, v in header.items()
        if k != "__metadata__"
    )
    entry = ck.entry("zoo.float32")
    (chunk,) = entry.chunks
    begin, end = header["zoo.float32"]["data_offsets"]
    assert (chunk.file, chunk.byte_offset, chunk.byte_length) == (
        "zoo.safetensors",
        data_start + begin,
        end - begin,
    )
    assert (entry.component, entry.nested_path) == ("model", ("zoo.float32",))


def test_open_reads_the_header_only(tmp_path: Path) -> None:
    big = torch.arange(8 << 20, dtype=torch.float32)  # 32 MiB
    small = torch.arange(10, dtype=torch.int16)
    path = tmp_path / "big.safetensors"
    save_file({"big": big, "small": small}, path)
    inspector.open(path)  # warm up imports
    before = bytes_read()
    ck = inspector.open(path)
    opened = bytes_read()
    assert torch.equal(ck.read("small"), small)
    read = bytes_read()
    assert opened - before < 64 << 10
    assert read - opened < 64 << 10
    assert torch.equal(ck.read("big"), big)


def test_reads_into_a_contiguous_destination(safetensors_written: dict) -> None:
    ck = inspector.open(safetensors_written["single"].path)
    entry = ck.entry("zoo.bfloat16")
    out = torch.empty(entry.shape, dtype=torch.bfloat16)
    got = ck.source.read_chunk(entry, 0, out)
    assert got is out and same(out, safetensors_written["single"].state["zoo.bfloat16"])


# --- damaged files: InspectorError naming file and key; never partial data ------------------


def test_truncated_data(safetensors_written: dict, tmp_path: Path) -> None:
    path = copy(safetensors_written["single"].path, tmp_path)
    header, _ = header_of(path)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    truncate(path, path.stat().st_size - 1)
    ck = inspector.open(path)
    assert "truncated" in ck.facts(last).error
    with pytest.raises(CorruptCheckpointError, match=rf"{path.name}.*{last!r}.*truncated"):
        ck.read(last)
    assert same(ck.read("zoo.int64"), safetensors_written["single"].state["zoo.int64"])


def test_truncated_inside_header(safetensors_written: dict, tmp_path: Path) -> None:
    path = copy(safetensors_written["single"].path, tmp_path)
    truncate(path, 40)
    with pytest.raises(CorruptCheckpointError, match=rf"{path.name}.*header length \d+ runs past"):
        inspector.open(path)


def test_header_length_past_end_of_file(safetensors_written: dict, tmp_path: Path) -> None:
    path = copy(safetensors_written["single"].path, tmp_path)
    raw = bytearray(path.read_bytes())
    raw[:8] = (len(raw) + 1).to_bytes(8, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="runs past the end of the file"):
        inspector.open(path)


def test_header_not_json(safetensors_written: dict, tmp_path: Path) -> None:
    path = copy(safetensors_written["single"].path, tmp_path)
    header, data = header_of(path)
    text = json.dumps(header).encode()
    write_header(path, text[:-1] + b",", data)
    with pytest.raises(CorruptCheckpointError, match=rf"{path.name}.*not valid JSON"):
        inspector.open(path)


@pytest.mark.parametrize(
    "bad",
    [b'{"a": 1, "a": 2}', b'{"__metadata__": {"x": 1}}'],
    ids=["duplicate-key", "metadata-not-strings"],
)
def test_header_structure_refused(tmp_path: Path, bad: bytes) -> None:
    path = tmp_path / "bad.safetensors"
    write_header(path, bad, b"")
    with pytest.raises(CorruptCheckpointError, match=r"bad\.safetensors"):
        inspector.open(path)


def test_lying_entries_are_marked_not_allocated(safetensors_written: dict, tmp_path: Path) -> None:
    path = copy(safetensors_written["single"].path, tmp_path)

    def lie(header: dict) -> None:
        header["zoo.float32"]["shape"] = [1 << 40, 1 << 20]
        header["zoo.int8"]["data_offsets"] = [0, 1 << 50]
        header["zoo.float16"]["dtype"] = "F6_E2M3"
        header["zoo.int16"]["data_offsets"] = [5, 3]

    edit_header(path, lie)
    ck = inspector.open(path)
    assert "needs" in ck.facts("zoo.float32").error
    assert "needs" in ck.facts("zoo.int8").error
    assert "unknown safetensors dtype 'F6_E2M3'" in ck.facts("zoo.float16").error
    assert "bad data_offsets" in ck.facts("zoo.int16").error
    with pytest.raises(CorruptCheckpointError, match=r"'zoo\.float32'"):
        ck.read("zoo.float32")
    assert same(ck.read("zoo.bool"), safetensors_written["single"].state["zoo.bool"])


def test_odd_float4_shape_refused(tmp_path: Path) -> None:
    path = tmp_path / "f4.safetensors"
    save_file({"x": torch.zeros(2, 2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}, path)
    edit_header(path, lambda h: h["x"].update(shape=[2, 3]))
    assert "even last dimension" in inspector.open(path).entry("x").error
