"""The DCP reader against torch's own reader, on checkpoints saved by real FSDP2 runs."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

import inspector
from inspector.dtypes import name_of
from inspector.errors import CorruptCheckpointError, NotACheckpointError
from tests.conftest import run_python
from tests.fixtures.formats import same

ALL = ("flat", "prefixed", "seed", "fp8")


def torch_state(path: Path) -> dict:
    import torchao.float8  # noqa: F401  (torch's reader needs it for the fp8 wrapper)

    flat, _ = flatten_state_dict(_load_state_dict_from_keys(checkpoint_id=str(path)))
    return flat


@pytest.mark.parametrize("name", ALL)
def test_keys_match_torch_metadata(demo_dir: Path, name: str) -> None:
    ck = inspector.open(demo_dir / name)
    md = FileSystemReader(str(demo_dir / name)).read_metadata()
    assert ck.keys() == list(md.state_dict_metadata)
    assert ck.format == "dcp"
    for key, item in md.state_dict_metadata.items():
        entry = ck.entry(key)
        if hasattr(item, "chunks"):
            assert (entry.kind, entry.dtype, entry.shape) == (
                "tensor",
                name_of(item.properties.dtype),
                tuple(item.size),
            )
            assert sorted(c.offsets for c in entry.chunks) == sorted(
                tuple(c.offsets) for c in item.chunks
            )
        else:
            assert entry.kind == "object"


@pytest.mark.parametrize("name", ALL)
def test_every_value_equals_torch(demo_dir: Path, name: str) -> None:
    ck = inspector.open(demo_dir / name)
    expected = torch_state(demo_dir / name)
    assert set(expected) == set(ck.keys())
    for key in ck.keys():
        if ck.entry(key).kind == "tensor":
            got, want = ck.read(key), expected[key]
            assert type(got) is torch.Tensor
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(
                got.view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)
            ), key
        else:
            assert ck.read_object(key) == expected[key], key


def test_chunks_span_both_rank_files(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "flat")
    entry = ck.entry("layers.0.attention.wq.weight")
    assert entry.files == ("__0_0.distcp", "__1_0.distcp")
    assert [(c.offsets, c.sizes) for c in entry.chunks] == [((0, 0), (32, 64)), ((32, 0), (32, 64))]
    assert ck.entry("train_state.step").shape == ()


@pytest.mark.parametrize(
    ("name", "layout", "components"),
    [
        ("flat", "flat", {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}),
        (
            "prefixed",
            "prefixed",
            {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"},
        ),
        ("seed", "model-only", {"model"}),
        ("fp8", "flat", {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}),
    ],
)
def test_layout_detected(demo_dir: Path, name: str, layout: str, components: set) -> None:
    ck = inspector.open(demo_dir / name)
    assert ck.layout == layout
    assert set(ck.components()) == components
    assert ck.components()["model"] == 21
    prefix = "model." if name == "prefixed" else ""
    assert ck.entry(f"{prefix}output.weight").component == "model"
    assert layout in ck.describe_layout()


def test_table_columns_and_values(demo_dir: Path) -> None:
    table = inspector.open(demo_dir / "flat").table()
    row = table.set_index("key").loc["layers.1.feed_forward.w2.weight"]
    assert list(table.columns[:9]) == [
        "key",
        "component",
        "kind",
        "dtype",
        "shape",
        "numel",
        "nbytes",
        "chunks",
        "files",
    ]
    values = [
        row[c]
        for c in ("component", "kind", "dtype", "shape", "numel", "nbytes", "chunks", "files")
    ]
    assert values == [
        "model",
        "tensor",
        "float32",
        (64, 128),
        8192,
        32768,
        2,
        ("__0_0.distcp", "__1_0.distcp"),
    ]
    assert table.set_index("key").loc["lr_scheduler.last_epoch", "kind"] == "object"


def test_objects_decoded(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "flat")
    assert ck.read_object("lr_scheduler.last_epoch") == 2
    assert ck.read_object("lr_scheduler.base_lrs") == [0.001]
    group = ck.read_object("optimizer.param_groups.output.weight.lr")
    assert group == pytest.approx(0.001 * 0.3)
    assert isinstance(ck.read_object("dataloader.dp_rank_1"), bytes)
    assert ck.read(key="train_state.step").item() == 2


def test_read_casts_on_request(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "seed")
    full = ck.read("norm.weight")
    assert torch.equal(ck.read("norm.weight", dtype=torch.bfloat16), full.to(torch.bfloat16))


def test_fp8_checkpoint_reads_without_torchao(demo_dir: Path) -> None:
    code = (
        "import json, sys, torch, inspector\n"
        "ck = inspector.open(sys.argv[1])\n"
        "t = ck.read('layers.0.attention.wq.weight')\n"
        "print(json.dumps({'type': type(t).__name__, 'sum': float(t.double().sum()),"
        " 'torchao': 'torchao' in sys.modules and sys.modules['torchao'] is not None}))\n"
    )
    result = run_python(code, str(demo_dir / "fp8"), block_torchao=True)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    expected = torch_state(demo_dir / "fp8")["layers.0.attention.wq.weight"]
    assert out == {"type": "Tensor", "sum": float(expected.double().sum()), "torchao": False}


def test_fp8_chunks_pickle_the_torchao_wrapper(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "fp8")
    wrapper = "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor"
    entry = ck.entry("layers.1.feed_forward.w3.weight")
    assert all(wrapper in ck.source.chunk_globals(entry, i) for i in range(len(entry.chunks)))
    plain = ck.entry("output.weight")
    assert wrapper not in ck.source.chunk_globals(plain, 0)


def test_torch_itself_needs_torchao_for_fp8(demo_dir: Path) -> None:
    code = (
        "import sys\n"
        "from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys\n"
        "_load_state_dict_from_keys({'layers.0.attention.wq.weight'}, checkpoint_id=sys.argv[1])\n"
    )
    result = run_python(code, str(demo_dir / "fp8"), block_torchao=True)
    assert result.returncode != 0


# --- damage: each case names the file and the key, and the rest stays readable -------------


def test_missing_shard_file(demo_copy) -> None:
    path = demo_copy("flat")
    os.remove(path / "__1_0.distcp")
    ck = inspector.open(path)
    entry = ck.entry("layers.0.attention.wq.weight")
    assert "__1_0.distcp is missing" in entry.error
    with pytest.raises(
        CorruptCheckpointError, match=r"layers\.0\.attention\.wq\.weight.*__1_0\.distcp is missing"
    ):
        ck.read("layers.0.attention.wq.weight")
    readable = [k for k in ck.keys() if not ck.facts(k).error]
    assert "dataloader.dp_rank_0" in readable
    assert ck.read_object("dataloader.dp_rank_0")
    assert ck.table().error.notna().sum() == len(ck.keys()) - len(readable) > 0


def test_truncated_shard(demo_copy) -> None:
    path = demo_copy("flat")
    shard = path / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    ck = inspector.open(path)
    broken = [k for k in ck.keys() if ck.facts(k).error]
    assert broken and all("__0_0.distcp" in ck.facts(k).error for k in broken)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        ck.read(broken[-1])
    first = next(k for k in ck.keys() if ck.entry(k).kind == "tensor" and not ck.facts(k).error)
    assert ck.read(first).numel() > 0


def test_item_bytes_overwritten(demo_copy) -> None:
    path = demo_copy("seed")
    ck = inspector.open(path)
    chunk = ck.entry("norm.weight").chunks[0]
    with open(path / chunk.file, "r+b") as f:
        f.seek(chunk.byte_offset)
        f.write(b"\0" * 64)
    with pytest.raises(
        CorruptCheckpointError, match=r"__0_0\.distcp.*'norm\.weight'.*no torch\.save archive"
    ):
        inspector.open(path).read("norm.weight")
    assert inspector.open(path).read("output.weight").shape == (256, 64)


def test_missing_metadata(demo_copy) -> None:
    path = demo_copy("seed")
    os.remove(path / ".metadata")
    with pytest.raises(NotACheckpointError, match=str(path)):
        inspector.open(path)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(NotACheckpointError):
        inspector.open(tmp_path)
    with pytest.raises(NotACheckpointError, match="no such file"):
        inspector.open(tmp_path / "nope")


def test_a_folder_with_checkpoints_below_says_where_they_are(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemWriter, save

    (tmp_path / "notes").mkdir()
    save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(tmp_path / "a"), no_dist=True)
    with pytest.raises(NotACheckpointError, match=f"holds one: open {tmp_path / 'a'}$"):
        inspector.open(tmp_path)
    save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(tmp_path / "b"), no_dist=True)
    with pytest.raises(NotACheckpointError, match=f"hold checkpoints: {tmp_path / 'a'}, "):
        inspector.open(tmp_path)


def test_unknown_key_suggests(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "prefixed")
    with pytest.raises(KeyError, match=r"did you mean 'model\.output\.weight'"):
        ck.entry("output.weight")


def test_object_and_tensor_apis_are_distinct(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "flat")
    with pytest.raises(inspector.InspectorError, match="read_object"):
        ck.read("lr_scheduler.last_epoch")
    with pytest.raises(inspector.InspectorError, match=r"read\(\)"):
        ck.read_object("norm.weight")


def test_missing_metadata_file_error_names_it(tmp_path: Path) -> None:
    (tmp_path / "__0.metadata").write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match=r"__0\.metadata"):
        inspector.open(tmp_path)


# --- FileSystemWriter(serialization_format=SAFETENSORS): .distcp files holding safetensors ----


def test_safetensors_distcp_one_process(dcp_single_written: dict) -> None:
    written = dcp_single_written["distcp-safetensors"]
    ck = inspector.open(written.path)
    assert ck.format == "dcp-safetensors"
    assert "serialization_format=SAFETENSORS" in ck.describe_layout()
    assert set(ck.keys()) == set(written.state)
    for key, want in written.state.items():
        if isinstance(want, torch.Tensor):
            entry = ck.entry(key)
            assert (entry.dtype, entry.shape, entry.error) == (
                name_of(want.dtype),
                want.shape,
                None,
            )
            assert same(ck.read(key), want), key
        else:
            assert ck.read_object(key) == want, key
    assert ck.entry("train_state.step").nested_path == ("train_state", "step")
    assert ck.source.chunk_globals(ck.entry("zoo.float32"), 0) == []


def test_safetensors_distcp_two_processes(dcp_distributed_written: dict) -> None:
    written = dcp_distributed_written["distcp-safetensors"]
    ck = inspector.open(written.path)
    assert ck.format == "dcp-safetensors"
    assert set(ck.keys()) == set(written.state)
    for key, want in written.state.items():
        if isinstance(want, torch.Tensor):
            assert same(ck.read(key), want), key
        else:
            assert ck.read_object(key) == want, key
    entry = ck.entry("layers.0.w.weight")
    assert [(c.offsets, c.sizes, c.file) for c in entry.chunks] == [
        ((0, 0), (4, 6), "__0_0.distcp"),
        ((4, 0), (3, 6), "__1_0.distcp"),
    ]
    assert ck.layout == "flat"


def test_safetensors_distcp_byte_ranges_follow_the_header(dcp_distributed_written: dict) -> None:
    """Objects come first in a rank's file; tensor bytes sit after the safetensors header."""
    folder = dcp_distributed_written["distcp-safetensors"].path
    md = FileSystemReader(str(folder)).read_metadata()
    ck = inspector.open(folder)
    entry = ck.entry("layers.0.cols")
    blob = next(
        info.offset
        for index, info in md.storage_data.items()
        if index.fqn == "layers.0.cols" and info.relative_path == "__0_0.distcp"
    )
    assert blob > 0  # the rank's dataloader bytes precede it
    chunk = entry.chunks[0]
    with open(folder / "__0_0.distcp", "rb") as f:
        f.seek(blob)
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    begin, end = header["layers.0.cols"]["data_offsets"]
    assert (chunk.byte_offset, chunk.byte_length) == (blob + 8 + header_len + begin, end - begin)


def test_safetensors_distcp_truncated(dcp_distributed_written: dict, tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    shutil.copytree(dcp_distributed_written["distcp-safetensors"].path, folder)
    shard = folder / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 4)
    ck = inspector.open(folder)
    broken = [e.key for e in ck.entries() if e.error]
    assert broken and all("truncated" in ck.facts(k).error for k in broken)
    with pytest.raises(CorruptCheckpointError, match=rf"{broken[0]!r}"):
        ck.read(broken[0])
    assert ck.read_object("dataloader.dp_rank_1") == pickle.dumps({"rank": 1})


def test_metadata_file_opens_its_folder(demo_dir: Path) -> None:
    ck = inspector.open(demo_dir / "seed" / ".metadata")
    assert ck.path == demo_dir / "seed" and ck.keys() == inspector.open(demo_dir / "seed").keys()


@pytest.fixture(scope="module")
def zstd_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A DCP folder written with torch's ZStandard stream transform on every item."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    state = {"w": torch.randn(64, 48), "bf": torch.randn(7).bfloat16(), "extra": {"lr": 0.5}}
    path = tmp_path_factory.mktemp("zstd")
    writer = dcp.FileSystemWriter(path, _extensions=[ZStandard()])
    dcp.save(state, storage_writer=writer, no_dist=True)
    return path, state


def test_zstd_transform_is_decoded(zstd_checkpoint: tuple[Path, dict]) -> None:
    path, state = zstd_checkpoint
    ck = inspector.open(path)
    assert {e.chunks[0].transforms for e in ck.entries()} == {("stream.zstd/1",)}
    assert torch.equal(ck.read("w"), state["w"]) and torch.equal(ck.read("bf"), state["bf"])
    assert ck.read_object("extra.lr") == 0.5
    assert ck.byte_ranges("w") is None  # compressed bytes are never copied raw


def test_zstd_without_its_package_is_refused_clearly(zstd_checkpoint: tuple[Path, dict]) -> None:
    code = (
        "import sys, inspector\n"
        "sys.modules['zstandard'] = None\n"
        "try:\n"
        "    inspector.open(sys.argv[1]).read('w')\n"
        "except inspector.UnsupportedError as exc:\n"
        "    print(exc)\n"
    )
    result = run_python(code, str(zstd_checkpoint[0]))
    assert result.returncode == 0, result.stderr
    assert "key 'w'" in result.stdout and "install the 'zstandard' package" in result.stdout


def test_unknown_transform_is_refused(zstd_checkpoint: tuple[Path, dict], tmp_path: Path) -> None:
    import pickle
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    copy = tmp_path / "copy"
    shutil.copytree(zstd_checkpoint[0], copy)
    meta = FileSystemReader(str(copy)).read_metadata()
    for info in meta.storage_data.values():
        info.transform_descriptors = ["stream.lz4/1"]
    meta.storage_meta = None
    (copy / ".metadata").write_bytes(pickle.dumps(meta))  # the test's own trusted metadata
    with pytest.raises(inspector.UnsupportedError, match=r"key 'w'.*unknown stream transforms"):
        inspector.open(copy).read("w")


# --- use_collectives=False (one __<rank>.metadata per rank) and saves that did not finish -----


def test_per_rank_metadata_two_processes(dcp_distributed_written: dict) -> None:
    written = dcp_distributed_written["per-rank-metadata"]
    assert sorted(p.name for p in written.path.iterdir()) == [
        "__0.metadata",
        "__0_0.distcp",
        "__1.metadata",
        "__1_0.distcp",
    ]
    ck = inspector.open(written.path)
    assert (ck.format, ck.ranks) == ("dcp", 2)
    assert "2 per-rank metadata files (saved without collectives)" in ck.source.notes
    assert set(ck.keys()) == set(written.state)
    for key, want in written.state.items():
        if isinstance(want, torch.Tensor):
            assert same(ck.read(key), want), key
        else:
            assert ck.read_object(key) == want, key
    assert [(c.offsets, c.file) for c in ck.entry("layers.0.cols").chunks] == [
        ((0, 0), "__0_0.distcp"),
        ((0, 5), "__1_0.distcp"),
    ]
    assert len(ck.entry("norm.weight").chunks) == 1  # both ranks wrote it; one copy is read


def test_per_rank_metadata_of_a_rank_missing(dcp_distributed_written: dict, tmp_path: Path) -> None:
    written = dcp_distributed_written["per-rank-metadata"]
    folder = tmp_path / "ck"
    shutil.copytree(written.path, folder)
    os.remove(folder / "__1.metadata")
    ck = inspector.open(folder)
    why = "the save of rank 1 did not finish (no __1.metadata)"
    assert any(note.startswith(why) for note in ck.source.notes)
    assert why in ck.entry("layers.0.w.weight").error
    with pytest.raises(CorruptCheckpointError, match=r"'layers\.0\.w\.weight'.*rank 1"):
        ck.read("layers.0.w.weight")
    assert same(ck.read("norm.weight"), written.state["norm.weight"])
    assert ck.read_object("dataloader.dp_rank_0") == written.state["dataloader.dp_rank_0"]


@pytest.mark.parametrize("form", ["directory", "fifo", "no-table"])
def test_per_rank_metadata_unreadable(
    dcp_distributed_written: dict, tmp_path: Path, form: str
) -> None:
    """A ``__1.metadata`` that is a folder, a FIFO or a pickle without its tables leaves out
    rank 1's chunks (marking the keys they belong to), not the whole folder."""
    written = dcp_distributed_written["per-rank-metadata"]
    folder = tmp_path / "ck"
    shutil.copytree(written.path, folder)
    bad = folder / "__1.metadata"
    bad.unlink()
    if form == "directory":
        bad.mkdir()
    elif form == "fifo":
        os.mkfifo(bad)
    else:
        bad.write_bytes(pickle.dumps({"not": "metadata"}))
    ck = inspector.open(folder)
    why = "unreadable per-rank metadata __1.metadata"
    assert any(note.startswith(why) for note in ck.source.notes), ck.source.notes
    assert why in ck.entry("layers.0.w.weight").error
    with pytest.raises(CorruptCheckpointError, match=r"'layers\.0\.w\.weight'.*__1\.metadata"):
        ck.read("layers.0.w.weight")
    assert same(ck.read("norm.weight"), written.state["norm.weight"])
    assert ck.read_object("dataloader.dp_rank_0") == written.state["dataloader.dp_rank_0"]


@pytest.mark.parametrize("leftover", [".metadata.tmp", None])
def test_unfinished_save_is_named(demo_copy, leftover: str | None) -> None:
    path = demo_copy("flat")
    if leftover:
        os.rename(path / ".metadata", path / leftover)
    else:
        os.remove(path / ".metadata")
    with pytest.raises(inspector.UnfinishedSaveError, match="the save did not finish") as caught:
        inspector.open(path)
    assert caught.value.file == str(path)
    size = sum((path / f).stat().st_size for f in ("__0_0.distcp", "__1_0.distcp"))
    assert f"2 .distcp files there: ranks 0-1, {size:,} bytes" in str(caught.value)
    assert caught.value.found == ("__0_0.distcp", "__1_0.distcp", *([leftover] if leftover else []))
    assert (".metadata.tmp was written but never renamed" in str(caught.value)) == bool(leftover)
