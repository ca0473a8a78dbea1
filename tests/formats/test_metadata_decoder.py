"""The direct DCP ``.metadata`` reader (safe_pickle/_metadata.c) accepts genuine files and
builds exactly what the unpickler's path builds; wherever a file is odd or damaged it
declines, and the unpickler's path (which names the problem) decides. Checked on genuine
checkpoints, on metadata pickled from real torch records with one thing made wrong at a
time, and on thousands of byte-mutated files."""

from __future__ import annotations

import copyreg
import os
import pickle
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as tmd
from torch.distributed.checkpoint.filesystem import _StorageInfo

from inspector.errors import CorruptCheckpointError, InspectorError
from inspector.formats.base import file_sizes
from inspector.formats.dcp import reader
from inspector.formats.safe_pickle import direct
from inspector.storage.local import LocalStorage
from tests.native import boundaries
from tests.native.drive import opened

DECODER = direct._metadata
FILES = {"__0_0.distcp": 4096, "__1_0.distcp": 100}


@contextmanager
def unpickled_only() -> Iterator[None]:
    direct._metadata = None
    try:
        yield
    finally:
        direct._metadata = DECODER


def accepted(folder: Path) -> bool:
    storage = LocalStorage(folder)
    data = (folder / ".metadata").read_bytes()
    try:
        found = direct.metadata_entries(
            data, lambda names: file_sizes(storage, names, referrer=".metadata")
        )
    except InspectorError:
        return False
    return found is not None


def both(folder: Path) -> tuple[bool, Any, Any]:
    """Whether the direct reader accepts, what the reader opens with it, and without it."""
    took = accepted(folder)
    fast = opened(folder)
    with unpickled_only():
        slow = opened(folder)
    return took, fast, slow


def test_the_decoder_is_built() -> None:
    """make test builds it (a missing compiler would leave only the unpickler's path)."""
    assert DECODER is not None


# --- genuine checkpoints ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def varied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One dcp.save of what checkpoints hold besides plain weights: objects, 0-dim and empty
    tensors, every common dtype, a str checkpoint_id."""
    folder = tmp_path_factory.mktemp("varied")
    state = {
        "model": {f"w.{d}": torch.ones(3, 2, dtype=d) for d in (torch.float16, torch.bfloat16)},
        "int": torch.arange(5),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "fp8": torch.zeros(4, 4).to(torch.float8_e4m3fn),
        "train_state": {"step": 7, "name": "run"},
        "extra": [1, 2, 3],
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)))
    return folder


def test_genuine_checkpoints_are_read_directly_and_alike(
    demo_dir: Path, dcp_distributed_written: dict, hf_llama_dcp: dict, varied: Path
) -> None:
    demos = [demo_dir / name for name in ("flat", "prefixed", "fp8", "seed")]
    written = [dcp_distributed_written["distcp-safetensors"].path, *hf_llama_dcp.values()]
    for folder in [*demos, *written, varied]:
        took, fast, slow = both(folder)
        assert took, folder
        assert fast == slow, folder
        assert all(e.error is None for e in fast[0]), folder


def test_sharded_chunks_are_read_directly(hf_llama_dcp: dict) -> None:
    """FSDP2's dim-0 shards (two chunks per weight) take the direct path too."""
    folder = hf_llama_dcp["plain"]
    entries = reader.DcpSource(LocalStorage(folder)).entries()
    assert accepted(folder)
    assert any(len(e.chunks) == 2 for e in entries)


def test_per_rank_metadata_takes_the_unpickler_path(dcp_distributed_written: dict) -> None:
    folder = dcp_distributed_written["per-rank-metadata"].path
    assert not (folder / ".metadata").exists()
    fast = opened(folder)
    with unpickled_only():
        assert fast == opened(folder)


def test_the_checkpoint_id_path_is_shown_as_before(demo_dir: Path) -> None:
    source = reader.DcpSource(LocalStorage(demo_dir / "flat"))
    assert accepted(demo_dir / "flat")
    assert source.metadata == {"version": "1.0.0", "saved_to": "<PurePosixPath>"}


# --- metadata pickled from real torch records, one thing wrong at a time ------------------


def tensor(key: str, shape: tuple, pieces: list[tuple[tuple, tuple]], dtype: Any) -> Any:
    chunks = [tmd.ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in pieces]
    properties = tmd.TensorProperties(dtype=dtype)
    return tmd.TensorStorageMetadata(properties, torch.Size(shape), chunks)


def base() -> tuple[dict, dict, dict]:
    """A small genuine table: a whole weight, a weight in two row shards, an object."""
    table = {
        "model.a": tensor("model.a", (4, 4), [((0, 0), (4, 4))], torch.float32),
        "model.b": tensor("model.b", (4, 2), [((0, 0), (2, 2)), ((2, 0), (2, 2))], torch.bfloat16),
        "train_state": tmd.BytesStorageMetadata(),
    }
    storage = {
        tmd.MetadataIndex("model.a", torch.Size((0, 0))): _StorageInfo("__0_0.distcp", 0, 64),
        tmd.MetadataIndex("model.b", torch.Size((0, 0))): _StorageInfo("__0_0.distcp", 64, 8),
        tmd.MetadataIndex("model.b", torch.Size((2, 0))): _StorageInfo("__0_0.distcp", 72, 8),
        tmd.MetadataIndex("train_state"): _StorageInfo("__1_0.distcp", 0, 50),
    }
    planner = {
        "model.a": ("model", "a"),
        "model.b": ("model", "b"),
        "train_state": ("train_state",),
    }
    return table, storage, planner


def index(key: str, offsets: Any = None) -> Any:
    return tmd.MetadataIndex(key, torch.Size(offsets) if offsets is not None else None)


def chunk_of(table: dict, key: str, i: int = 0) -> Any:
    return table[key].chunks[i]


def set_field(obj: Any, **fields: Any) -> Any:
    vars(obj).update(fields)
    return obj


def record_of(storage: dict, key: str, offsets: Any = (0, 0)) -> Any:
    wanted = None if offsets is None else tuple(offsets)
    for idx, info in storage.items():
        if idx.fqn == key and (idx.offset if idx.offset is None else tuple(idx.offset)) == wanted:
            return info
    raise KeyError(key)


Change = Callable[[dict, dict, dict, dict], None]


def shared_list(t: dict, s: dict, p: dict, m: dict) -> None:
    t["model.c"] = tmd.TensorStorageMetadata(
        t["model.a"].properties, t["model.a"].size, t["model.a"].chunks
    )
    s[index("model.c", (0, 0))] = _StorageInfo("__0_0.distcp", 80, 64)


class Twin:
    """Pickles as torch's MetadataIndex with these fields, but hashes by identity: a dict can
    hold it beside an equal index (as a hand-made pickle can)."""

    def __init__(self, fqn: str, offset: Any) -> None:
        self.fields = {"fqn": fqn, "offset": offset, "index": None}

    def __reduce_ex__(self, protocol: object) -> tuple:
        return copyreg.__newobj__, (tmd.MetadataIndex,), self.fields

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # what the pickler checks NEWOBJ's class against
        return tmd.MetadataIndex


def deep(dims: int) -> Change:
    """A key of ``dims`` dimensions, whole in one chunk with its record (at most 64 are read)."""

    def change(t: dict, s: dict, p: dict, m: dict) -> None:
        shape = (1,) * dims
        t["model.deep"] = tensor("model.deep", shape, [((0,) * dims, shape)], torch.float32)
        s[index("model.deep", (0,) * dims)] = _StorageInfo("__0_0.distcp", 1000, 4)

    return change


def duplicate_record(t: dict, s: dict, p: dict, m: dict) -> None:
    s[Twin("model.a", torch.Size((0, 0)))] = _StorageInfo("__0_0.distcp", 200, 64)


def bool_offsets(t: dict, s: dict, p: dict, m: dict) -> None:
    """A second record at offsets (False, False), which Python finds equal to (0, 0)."""
    s[Twin("model.a", (False, False))] = _StorageInfo("__0_0.distcp", 300, 64)


class SharedState:
    """Pickles as a ``cls`` built from ``state``: one dict that several records can share (the
    pickler writes it once and builds each from it; torch's records never share one)."""

    def __init__(self, cls: type, state: dict) -> None:
        self.cls, self.state = cls, state

    def __reduce_ex__(self, protocol: object) -> tuple:
        return copyreg.__newobj__, (self.cls,), self.state

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return self.cls


def shared_state(t: dict, s: dict, p: dict, m: dict) -> None:
    """model.c's chunk built from the very dict model.a's chunk is."""
    state = vars(chunk_of(t, "model.a"))
    t["model.c"] = tensor("model.c", (4, 4), [((0, 0), (4, 4))], torch.float32)
    t["model.a"].chunks[0] = SharedState(tmd.ChunkStorageMetadata, state)
    t["model.c"].chunks[0] = SharedState(tmd.ChunkStorageMetadata, state)
    s[index("model.c", (0, 0))] = _StorageInfo("__0_0.distcp", 80, 64)


# (name, change, whether the direct reader still accepts it)
CHANGES: list[tuple[str, Change, bool]] = [
    ("genuine", lambda t, s, p, m: None, True),
    ("a str checkpoint_id", lambda t, s, p, m: m.update(checkpoint_id="/ckpt/step-10"), True),
    ("no storage_meta", lambda t, s, p, m: m.update(storage_meta=None), True),
    ("no planner_data", lambda t, s, p, m: m.update(planner_data=None), True),
    ("a planner path as a list", lambda t, s, p, m: p.update({"model.a": ["model", "a"]}), True),
    ("a planner path with an index", lambda t, s, p, m: p.update({"model.a": ("model", 3)}), True),
    ("an empty planner path", lambda t, s, p, m: p.update({"model.a": ()}), True),
    ("a key missing from the planner", lambda t, s, p, m: p.pop("model.a"), True),
    (
        "a planner path with a bool",
        lambda t, s, p, m: p.update({"model.a": ("model", True)}),
        False,
    ),
    ("a planner path of 65 names", lambda t, s, p, m: p.update({"model.a": ("x",) * 65}), False),
    ("a planner path that is a str", lambda t, s, p, m: p.update({"model.a": "model"}), True),
    (
        "a dtype alias",
        lambda t, s, p, m: set_field(t["model.a"].properties, dtype=torch.half),
        True,
    ),
    (
        "a transform list",
        lambda t, s, p, m: set_field(
            record_of(s, "model.a"), transform_descriptors=["stream.zstd/1"]
        ),
        True,
    ),
    (
        "a transform str",
        lambda t, s, p, m: set_field(record_of(s, "model.a"), transform_descriptors="ab"),
        False,
    ),
    ("a shared chunk list", shared_list, False),
    ("a record given twice", duplicate_record, False),
    ("record offsets with a bool", bool_offsets, False),
    ("a key of 64 dims", deep(64), True),
    ("a key of 65 dims", deep(65), False),
    (
        "chunk offsets of bools",
        lambda t, s, p, m: set_field(chunk_of(t, "model.a"), offsets=(False, False)),
        False,
    ),
    (
        "a record past its file",
        lambda t, s, p, m: set_field(record_of(s, "model.a"), offset=4090),
        False,
    ),
    (
        "a record in a missing file",
        lambda t, s, p, m: set_field(record_of(s, "model.a"), relative_path="__9_0.distcp"),
        False,
    ),
    (
        "a negative byte offset",
        lambda t, s, p, m: set_field(record_of(s, "model.a"), offset=-1),
        False,
    ),
    (
        "a byte offset past 2^62",
        lambda t, s, p, m: set_field(record_of(s, "model.a"), offset=1 << 62),
        False,
    ),
    (
        "a record naming no file",
        lambda t, s, p, m: set_field(record_of(s, "model.a"), relative_path=3),
        False,
    ),
    (
        "a chunk with no record",
        lambda t, s, p, m: set_field(chunk_of(t, "model.b", 1), offsets=torch.Size((3, 0))),
        False,
    ),
    (
        "a gap between shards",
        lambda t, s, p, m: set_field(chunk_of(t, "model.b", 1), sizes=torch.Size((1, 2))),
        False,
    ),
    ("shards out of order", lambda t, s, p, m: t["model.b"].chunks.reverse(), True),
    ("a shape as a list", lambda t, s, p, m: set_field(t["model.a"], size=[4, 4]), False),
    ("a negative dim", lambda t, s, p, m: set_field(t["model.a"], size=torch.Size((-4, 4))), False),
    (
        "a dim of 2^62",
        lambda t, s, p, m: set_field(t["model.a"], size=torch.Size((1 << 62, 4))),
        False,
    ),
    ("65 dims", lambda t, s, p, m: set_field(t["model.a"], size=torch.Size((1,) * 65)), False),
    (
        "a dtype that is a str",
        lambda t, s, p, m: set_field(t["model.a"].properties, dtype="float32"),
        False,
    ),
    ("no properties", lambda t, s, p, m: set_field(t["model.a"], properties=None), False),
    (
        "chunks as a tuple",
        lambda t, s, p, m: set_field(t["model.a"], chunks=tuple(t["model.a"].chunks)),
        False,
    ),
    (
        "an object with no record",
        lambda t, s, p, m: t.update(orphan=tmd.BytesStorageMetadata()),
        False,
    ),
    ("a field torch never had", lambda t, s, p, m: set_field(t["model.a"], colour="red"), False),
    ("a key that is not a str", lambda t, s, p, m: t.update({7: t["model.a"]}), False),
    ("an unknown global", lambda t, s, p, m: m.update(version=os.getcwd), False),
    ("a version that is an int", lambda t, s, p, m: m.update(version=3), False),
    ("Megatron's plans", lambda t, s, p, m: m.update(all_local_plans=[]), False),
    ("one state dict for two records", shared_state, False),
]


def write(folder: Path, change: Change) -> Path:
    table, storage, planner = base()
    meta: dict[str, Any] = {}
    change(table, storage, planner, meta)
    storage_meta = tmd.StorageMeta(checkpoint_id=PurePosixPath("/ckpt"), save_id="x")
    if "checkpoint_id" in meta:
        storage_meta.checkpoint_id = meta.pop("checkpoint_id")
    metadata = tmd.Metadata(
        state_dict_metadata=table,
        planner_data=planner,
        storage_data=storage,
        storage_meta=meta.pop("storage_meta", storage_meta),
        version=meta.pop("version", "1.0.0"),
    )
    if "planner_data" in meta:
        metadata.planner_data = meta.pop("planner_data")
    vars(metadata).update(meta)
    folder.mkdir()
    for name, size in FILES.items():
        (folder / name).write_bytes(b"\0" * size)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
    return folder


@pytest.mark.parametrize(("name", "change", "takes"), CHANGES, ids=[c[0] for c in CHANGES])
def test_one_change_at_a_time(tmp_path: Path, name: str, change: Change, takes: bool) -> None:
    folder = write(tmp_path / "ckpt", change)
    took, fast, slow = both(folder)
    assert took is takes, name
    assert fast == slow, name


# --- byte-mutated files -----------------------------------------------------------------------


def mutants(data: bytes, count: int, seed: int) -> Iterator[bytes]:
    """Pickles a byte or a few changed, dropped, repeated or cut (most no longer decode;
    those inside a string still do, as other keys)."""
    rng = random.Random(seed)
    for _ in range(count):
        at = rng.randrange(len(data))
        kind = rng.randrange(5)
        if kind == 0:
            yield data[:at] + bytes([rng.randrange(256)]) + data[at + 1 :]
        elif kind == 1:
            yield data[:at] + data[at + rng.randrange(1, 4) :]
        elif kind == 2:
            n = rng.randrange(1, 12)
            yield data[:at] + data[at : at + n] * 2 + data[at + n :]
        elif kind == 3:
            yield data[:at]
        else:
            yield data + bytes(rng.randrange(1, 3))


@pytest.mark.parametrize("demo", ["seed", "fp8"])
def test_byte_mutated_files_are_declined_or_read_alike(
    demo_dir: Path, tmp_path: Path, demo: str
) -> None:
    folder = tmp_path / demo
    shutil.copytree(demo_dir / demo, folder)
    data = (folder / ".metadata").read_bytes()
    taken = 0
    for mutant in mutants(data, 1000 if demo == "seed" else 150, seed=len(data)):
        (folder / ".metadata").write_bytes(mutant)
        took, fast, slow = both(folder)
        assert fast == slow
        taken += took
    if demo == "seed":  # some are still sound (a changed id, path or version), and compared
        assert taken > 10


def test_a_key_given_twice_is_declined(tmp_path: Path) -> None:
    """A hand-made pickle can give a key twice (Python keeps the last value, in the first
    place); torch's pickler never does, so the direct reader declines."""

    def add_object(t: dict, s: dict, p: dict, m: dict) -> None:
        t["model.X"] = tmd.BytesStorageMetadata()
        s[index("model.X")] = _StorageInfo("__1_0.distcp", 50, 10)

    folder = write(tmp_path / "ckpt", add_object)
    data = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(data.replace(b"model.X", b"model.a"))
    took, fast, slow = both(folder)
    assert not took
    assert fast == slow
    assert [e.key for e in fast[0]].count("model.a") == 1


def test_an_unknown_memory_format_is_declined(tmp_path: Path) -> None:
    """``_MEM_FORMAT_ENCODING(7)`` fails in the unpickler (torch has three formats)."""
    folder = write(tmp_path / "ckpt", lambda t, s, p, m: None)
    data = (folder / ".metadata").read_bytes()
    at = data.index(b"K\x00", data.index(b"_MEM_FORMAT_ENCODING"))
    (folder / ".metadata").write_bytes(data[:at] + b"K\x07" + data[at + 2 :])
    took, fast, slow = both(folder)
    assert not took
    assert fast == slow and fast[0] is CorruptCheckpointError


# --- capacity boundaries (issue 34: a pointer kept across the node array's growth) -------------


def test_the_issue_use_after_free_input_is_declined_and_refused_alike(tmp_path: Path) -> None:
    """80 04, 246 EMPTY_LISTs, a pathlib.PosixPath REDUCE whose node fills the array (512),
    STOP: the native decoder declines it and both paths refuse the file alike."""
    data = boundaries.issue_input()
    assert len(data) == 275
    assert DECODER.entries(data, lambda names: {}, direct._consts()) is None
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(data)
    took, fast, slow = both(folder)
    assert not took
    assert fast == slow
    assert fast[0] is CorruptCheckpointError


def test_every_capacity_boundary_input_is_declined() -> None:
    """Every array, growing opcode and count around each capacity (tests/native/boundaries.py):
    none is metadata, so each is declined (the sanitized build runs them too)."""
    consts = direct._consts()
    taken = [name for name, data in boundaries.inputs() if DECODER.entries(data, dict, consts)]
    assert taken == []


def objects_first(folder: Path, count: int, big: bool) -> Path:
    """A sound file whose table starts with a tensor in two row shards, 4 or 300 rows (300:
    one int node more), then `count` object keys (two nodes each): its node count passes
    each value as `count` and `big` vary, at a string or at a NEWOBJ."""
    table, storage, planner = base()
    rows = 300 if big else 4
    half = rows // 2
    pieces = [((0, 0), (half, 4)), ((half, 0), (half, 4))]
    first = {"model.a": tensor("model.a", (rows, 4), pieces, torch.float32)}
    objects = {f"obj.{i}": tmd.BytesStorageMetadata() for i in range(count)}
    table = {**first, **objects, **{k: v for k, v in table.items() if k != "model.a"}}
    for i, key in enumerate(objects):
        storage[tmd.MetadataIndex(key)] = _StorageInfo("__2_0.distcp", i, 1)
        planner[key] = ("obj", str(i))
    del storage[tmd.MetadataIndex("model.a", torch.Size((0, 0)))]
    for at in (0, half):
        record = _StorageInfo("__2_0.distcp", count + at * 16, half * 16)
        storage[index("model.a", (at, 0))] = record
    metadata = tmd.Metadata(state_dict_metadata=table, planner_data=planner, storage_data=storage)
    folder.mkdir()
    for name, size in {**FILES, "__2_0.distcp": count + rows * 16}.items():
        (folder / name).write_bytes(b"\0" * size)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
    return folder


@pytest.mark.parametrize("cap", [512, 1024])
def test_sound_files_across_each_node_capacity_read_alike(tmp_path: Path, cap: int) -> None:
    fixed = boundaries.constants()["SMALL_ID"] + boundaries.constants()["SMALL_INTS"]
    middle = (cap - fixed) // 2
    for count in range(max(0, middle - 16), middle + 2):
        for big in (False, True):
            took, fast, slow = both(objects_first(tmp_path / f"{count}-{big}", count, big))
            assert took
            assert fast == slow
