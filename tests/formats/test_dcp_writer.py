"""The DCP writer against torch's own reader: what it writes, torch's ``dcp.load`` and
``dcp_to_torch_save`` read back bit for bit (whole tensors and tensors stored as chunks),
with the metadata torch's own ``FileSystemWriter`` writes for the same state dict."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import inspector
from inspector.errors import ExportError
from inspector.formats.dcp.writer import Chunk, write_dcp
from inspector.formats.writing import Item


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes (so float8, -0.0 and NaN compare exactly)."""
    return tensor.reshape(-1).view(torch.uint8)


def item(name: str, tensor: torch.Tensor) -> Item:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return Item(name, dtype, tuple(tensor.shape), lambda: tensor)


def whole(item: Item) -> Chunk:
    """All of ``item``, stored under its own name."""
    return Chunk(item.name, item, (0,) * len(item.shape), item.shape)


def state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "tok_embeddings.weight": torch.randn(16, 8, generator=generator),
        "layers.0.attention_norm.weight": torch.randn(8, generator=generator).bfloat16(),
        "layers.0.moe.experts.w1": torch.randn(4, 6, 8, generator=generator),
        "step": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "fp8": torch.randn(4, 4, generator=generator).to(torch.float8_e4m3fn),
    }


def chunks_of(tensors: dict[str, torch.Tensor]) -> list[Chunk]:
    """Every tensor whole, except the stacked experts: one chunk per expert, out of order."""
    chunks = [whole(item(k, v)) for k, v in tensors.items() if k != "layers.0.moe.experts.w1"]
    stack = tensors["layers.0.moe.experts.w1"]
    for e in (2, 0, 3, 1):
        piece = item(f"expert {e}", stack[e : e + 1])
        chunks.insert(e, Chunk("layers.0.moe.experts.w1", piece, (e, 0, 0), tuple(stack.shape)))
    return chunks


def quiet_load(target: dict, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, checkpoint_id=path, no_dist=True)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("dcp_writer") / "ckpt"
    tensors = state()
    seen: list[str] = []
    files = write_dcp(folder, chunks_of(tensors), lambda i: seen.append(i.name), overwrite=False)
    assert sorted(p.name for p in files) == [".metadata", "__0_0.distcp"]
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp"]
    assert len(seen) == len(tensors) + 3 - 1  # four expert pieces, no bytes for "empty"
    return folder, tensors


def test_torch_dcp_load_reads_every_tensor(written) -> None:
    folder, tensors = written
    target = {
        k: torch.full_like(v, 0) if v.numel() else torch.empty_like(v) for k, v in tensors.items()
    }
    quiet_load(target, folder)
    for key, value in tensors.items():
        assert target[key].dtype == value.dtype and target[key].shape == value.shape
        assert torch.equal(raw(target[key]), raw(value)), key


def test_torch_loads_a_slice_of_a_chunked_tensor_into_a_resharded_target(written) -> None:
    """DCP reshards: a target holding rows 1..2 of the experts reads across two chunks."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    folder, tensors = written
    md = dcp.FileSystemReader(folder).read_metadata()
    stored = md.state_dict_metadata["layers.0.moe.experts.w1"]
    assert sorted(tuple(c.offsets) for c in stored.chunks) == [(e, 0, 0) for e in range(4)]
    assert {tuple(c.sizes) for c in stored.chunks} == {(1, 6, 8)}
    target = {"layers.0.moe.experts.w1": torch.zeros(4, 6, 8)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, checkpoint_id=folder, planner=DefaultLoadPlanner(), no_dist=True)
    assert torch.equal(target["layers.0.moe.experts.w1"], tensors["layers.0.moe.experts.w1"])


def test_metadata_is_what_torchs_own_writer_writes(written, tmp_path: Path) -> None:
    folder, tensors = written
    theirs = tmp_path / "torch"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(theirs), no_dist=True)
    ours = dcp.FileSystemReader(folder).read_metadata()
    reference = dcp.FileSystemReader(theirs).read_metadata()
    assert type(ours) is type(reference)
    assert ours.version == reference.version
    assert ours.planner_data == reference.planner_data
    assert sorted(ours.state_dict_metadata) == sorted(reference.state_dict_metadata)
    for key, theirs_md in reference.state_dict_metadata.items():
        ours_md = ours.state_dict_metadata[key]
        assert (ours_md.size, ours_md.properties) == (theirs_md.size, theirs_md.properties), key
        if key != "layers.0.moe.experts.w1":
            assert ours_md.chunks == theirs_md.chunks, key
    assert {i.relative_path for i in ours.storage_data.values()} == {"__0_0.distcp"}


def test_dcp_to_torch_save_and_our_reader_agree(written, tmp_path: Path) -> None:
    folder, tensors = written
    dcp_to_torch_save(folder, tmp_path / "all.pt")
    flat = torch.load(tmp_path / "all.pt", weights_only=True)
    ck = inspector.open(folder)
    assert (ck.format, sorted(ck.keys()), sorted(flat)) == ("dcp", sorted(tensors), sorted(tensors))
    for key, value in tensors.items():
        assert torch.equal(raw(flat[key]), raw(value)), key
        assert torch.equal(raw(ck.read(key)), raw(value)), key
    # the expert pieces tile dim 0, so the stacked tensor is one byte stream
    assert ck.byte_ranges("layers.0.moe.experts.w1") is not None


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([Chunk("w", item("a", torch.ones(1, 4)), (0, 0), (2, 4))], "do not add up"),
        (
            [
                Chunk("w", item("a", torch.ones(2, 4)), (0, 0), (3, 4)),
                Chunk("w", item("b", torch.ones(1, 4)), (1, 0), (3, 4)),
            ],
            "overlap",
        ),
        ([Chunk("w", item("a", torch.ones(2, 4)), (1, 0), (2, 4))], "lies outside"),
        (
            [
                Chunk("w", item("a", torch.ones(1, 4)), (0, 0), (2, 4)),
                Chunk("w", item("b", torch.ones(1, 4).double()), (1, 0), (2, 4)),
            ],
            "chunks disagree",
        ),
    ],
)
def test_chunks_that_do_not_tile_the_tensor_are_refused(tmp_path: Path, chunks, message) -> None:
    with pytest.raises(ExportError, match=message):
        write_dcp(tmp_path / "bad", chunks, lambda i: None, overwrite=False)
    assert not (tmp_path / "bad").exists()


def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    def broken() -> torch.Tensor:
        raise ExportError("source went away", key="b")

    chunks = [whole(item("a", torch.ones(3))), whole(Item("b", "float32", (3,), broken))]
    with pytest.raises(ExportError, match="source went away"):
        write_dcp(tmp_path / "new" / "ckpt", chunks, lambda i: None, overwrite=False)
    assert list(tmp_path.iterdir()) == []


def test_existing_checkpoint_is_kept_unless_overwrite(written, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    write_dcp(folder, [whole(item("a", torch.ones(3)))], lambda i: None, overwrite=False)
    with pytest.raises(ExportError, match="already exists"):
        write_dcp(folder, [whole(item("a", torch.zeros(3)))], lambda i: None, overwrite=False)
    assert torch.equal(inspector.open(folder).read("a"), torch.ones(3))
    write_dcp(folder, [whole(item("a", torch.zeros(3)))], lambda i: None, overwrite=True)
    assert torch.equal(inspector.open(folder).read("a"), torch.zeros(3))
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp"]
