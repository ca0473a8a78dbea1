"""The DCP entry table's C fast path (formats/dcp/_table.c) builds exactly the entries the
Python path builds: on genuine checkpoints (where it builds every one) and on random, often
malformed tables (where it leaves the damaged keys to Python, which names the problem)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inspector.errors import InspectorError
from inspector.formats.dcp import metadata as md
from inspector.formats.dcp import reader
from inspector.formats.safe_pickle import DtypeName, direct
from inspector.storage.local import LocalStorage

FILES = {"__0_0.distcp": 4096, "__1_0.distcp": 100}
C_TABLE = reader._table


def record(cls: type, **fields: Any) -> Any:
    """A stand-in record as a pickle's NEWOBJ + BUILD makes it."""
    obj = object.__new__(cls)
    vars(obj).update(fields)
    return obj


@contextmanager
def python_only() -> Iterator[None]:
    reader._table = None
    try:
        yield
    finally:
        reader._table = C_TABLE


def outcome(build: Callable[[], Any]) -> Any:
    try:
        return build()
    except InspectorError as exc:
        return type(exc), str(exc)


def both(build: Callable[[], Any]) -> tuple[Any, Any]:
    fast = outcome(build)
    with python_only():
        slow = outcome(build)
    return fast, slow


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> LocalStorage:
    folder = tmp_path_factory.mktemp("table")
    for name, size in FILES.items():
        (folder / name).write_bytes(b"\0" * size)
    return LocalStorage(folder)


def test_the_c_table_is_built() -> None:
    """make test builds it (a missing compiler would leave only the Python path)."""
    assert C_TABLE is not None


def genuine_folders(demo_dir: Path, dcp_distributed_written: dict) -> list[Path]:
    folders = [demo_dir / name for name in ("flat", "prefixed", "fp8", "seed")]
    return folders + [
        dcp_distributed_written[n].path for n in ("distcp-safetensors", "per-rank-metadata")
    ]


def test_genuine_checkpoints_take_the_fast_path_for_every_key(
    demo_dir: Path, dcp_distributed_written: dict
) -> None:
    for folder in genuine_folders(demo_dir, dcp_distributed_written):
        storage = LocalStorage(folder)
        files = reader.metadata_files(storage) or [reader.METADATA_FILE]
        parts = [reader._read_metadata(storage, n, storage.read(n)) for n in files]
        raw, problems = reader._merge(parts, "m")
        by_key, names = C_TABLE.storage_by_key(raw.storage_data)
        assert (by_key, names) == reader._storage_by_key(raw.storage_data)
        sizes = {n: storage.size(n) for n in names}
        planner = raw.planner_data if isinstance(raw.planner_data, dict) else None
        rows = reader._fast_entries(raw.state_dict_metadata, by_key, sizes, planner, problems)
        assert not problems and None not in rows, folder
        direct_reader, direct._metadata = direct._metadata, None  # the unpickler's path
        try:
            fast, slow = both(lambda f=folder: reader.DcpSource(LocalStorage(f)).entries())
        finally:
            direct._metadata = direct_reader
        assert fast == slow and all(e.error is None for e in fast)


# --- random tables: mostly genuine, with every field sometimes wrong -------------------------

SMALL = st.integers(0, 40)
NUMBERS = st.one_of(
    SMALL, SMALL, SMALL, st.sampled_from([-1, 1 << 62, 1 << 63, 1 << 70, True, False, 2.0, None])
)


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    """``good`` 7 times in 8: most records are genuine, so both paths meet near misses."""
    return st.integers(0, 7).flatmap(lambda n: bad if n == 0 else good)


def dims(n: int) -> st.SearchStrategy:
    return st.one_of(
        st.tuples(*[NUMBERS] * n),
        st.lists(NUMBERS, min_size=n, max_size=n),
        st.lists(NUMBERS, max_size=3),
        st.sampled_from([None, "ab", 7, {}]),
    )


DTYPES = st.sampled_from([DtypeName("nonsense"), "float32", None, 3])
FILE_NAMES = st.sampled_from(["missing.distcp", 5, None])
TRANSFORMS = st.sampled_from([[1], "ab", 0, {"a": 1}])


@st.composite
def storage_info(draw: st.DrawFn, length: int = 0) -> Any:
    """A record of ``length`` bytes inside one of FILES, sometimes with a field wrong."""
    if draw(st.integers(0, 15)) == 0:
        return draw(st.sampled_from([None, 3, "x", record(md.MetadataIndex, fqn="a")]))
    file = draw(mostly(st.sampled_from(list(FILES)), FILE_NAMES))
    room = FILES.get(file, 0) if isinstance(file, str) else 0
    fields = {
        "relative_path": file,
        "offset": draw(mostly(st.integers(0, max(room - length, 0)), NUMBERS)),
        "length": draw(mostly(st.just(length), NUMBERS)),
    }
    if draw(st.booleans()):
        good = st.sampled_from([None, [], (), ["stream.zstd/1"]])
        fields["transform_descriptors"] = draw(mostly(good, TRANSFORMS))
    return record(md.StorageInfo, **fields)


@st.composite
def chunk_list(draw: st.DrawFn, shape: tuple) -> list[tuple[Any, Any]]:
    """(offsets, sizes) of chunks splitting ``shape`` along one dimension (empty pieces
    included, in any order), sometimes with one wrong (outside, overlapping, not ints)."""
    ndim = len(shape)
    if not ndim:
        return [((), ())] * draw(st.sampled_from([0, 1, 1, 2]))
    dim = draw(st.integers(0, ndim - 1))
    cuts = sorted(draw(st.lists(st.integers(0, shape[dim]), max_size=9)))
    boxes = []
    for start, end in zip([0, *cuts], [*cuts, shape[dim]], strict=True):
        offsets = tuple(start if d == dim else 0 for d in range(ndim))
        sizes = tuple(end - start if d == dim else n for d, n in enumerate(shape))
        wrap = draw(st.sampled_from([tuple, tuple, tuple, list]))
        boxes.append(
            (
                draw(mostly(st.just(wrap(offsets)), dims(ndim))),
                draw(mostly(st.just(wrap(sizes)), dims(ndim))),
            )
        )
    boxes = draw(st.permutations(boxes))
    return draw(mostly(st.just(boxes), st.lists(st.tuples(dims(ndim), dims(ndim)), max_size=3)))


def item_bytes(sizes: Any) -> int:
    """What a float32 chunk of ``sizes`` takes (4 where the sizes are not small ints)."""
    small = isinstance(sizes, (tuple, list)) and all(type(n) is int and 0 <= n < 64 for n in sizes)
    return 4 * math.prod(sizes) if small else 4


@st.composite
def tensor_metadata(draw: st.DrawFn, key: Any, storage_data: dict) -> Any:
    shape = draw(st.lists(st.integers(0, 12), max_size=3).map(tuple))
    chunks = []
    for offsets, sizes in draw(chunk_list(shape)):
        chunks.append(
            draw(
                mostly(
                    st.just(record(md.ChunkStorageMetadata, offsets=offsets, sizes=sizes)),
                    st.sampled_from([None, 3]),
                )
            )
        )
        if draw(st.integers(0, 15)) and isinstance(offsets, (tuple, list)):
            index = record(md.MetadataIndex, fqn=key, offset=offsets)
            storage_data[index] = draw(storage_info(item_bytes(sizes)))
    properties = record(
        md.TensorProperties,
        dtype=draw(mostly(st.sampled_from([DtypeName("float32"), DtypeName("bfloat16")]), DTYPES)),
    )
    return record(
        md.TensorStorageMetadata,
        properties=draw(mostly(st.just(properties), st.sampled_from([None, 3]))),
        size=draw(mostly(st.sampled_from([shape, list(shape)]), dims(len(shape)))),
        chunks=draw(mostly(st.just(chunks), st.sampled_from([tuple(chunks), None]))),
    )


@st.composite
def tables(draw: st.DrawFn) -> tuple[Any, dict, dict]:
    state: dict[Any, Any] = {}
    storage_data: dict[Any, Any] = {}
    planner: dict[Any, Any] = {}
    for i in range(draw(st.integers(1, 6))):
        key = draw(mostly(st.just(f"layers.{i}.w"), st.sampled_from([DtypeName(f"k{i}"), i])))
        good_path = st.sampled_from([("model", f"layers.{i}.w"), ("optimizer", "state", 0)])
        bad_path = st.sampled_from(
            [
                None,
                [],
                ["model", 3],
                ("m", True),
                (1 << 20,),
                ("m",) * 65,
                "ab",
                ("m", DtypeName("x")),
            ]
        )
        path = draw(mostly(good_path, bad_path))
        if path is not None:
            planner[key] = path
        if draw(st.integers(0, 4)) == 0:
            state[key] = draw(
                mostly(st.just(record(md.BytesStorageMetadata)), st.sampled_from([None, 3]))
            )
            offset = draw(mostly(st.just(None), st.sampled_from([(), (0,)])))
            storage_data[record(md.MetadataIndex, fqn=key, offset=offset)] = draw(storage_info(64))
        else:
            state[key] = draw(tensor_metadata(key, storage_data))
    meta = record(
        md.Metadata,
        state_dict_metadata=state,
        storage_data=storage_data,
        planner_data=draw(mostly(st.just(planner), st.sampled_from([None, [1]]))),
    )
    problems = {k: "damaged" for k in state if isinstance(k, str) and draw(st.integers(0, 15)) == 0}
    return meta, problems, storage_data


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables())
def test_random_tables_give_the_python_entries(storage: LocalStorage, drawn: tuple) -> None:
    meta, problems, storage_data = drawn
    fast, slow = both(lambda: reader._entries(meta, problems, storage, "x/.metadata"))
    assert fast == slow
    assert C_TABLE.storage_by_key(storage_data) == reader._storage_by_key(storage_data)
    if isinstance(slow, list):  # the items' check, on entries of every kind of damage
        for safetensors in (set(), {"__1_0.distcp"}):
            checked = both(lambda s=safetensors: reader._check_items(slow, s, ".metadata"))
            assert checked[0] == checked[1]


@given(
    st.dictionaries(
        st.one_of(
            st.builds(
                lambda fqn, offset: record(md.MetadataIndex, fqn=fqn, offset=offset),
                st.sampled_from(["a", "b", DtypeName("a"), 3, None]),
                st.sampled_from([None, (), (0, 1), [0, 1], "ab", 5, [[1]], {"x": 1}]),
            ),
            st.sampled_from([3, "a", None]),
        ),
        st.one_of(storage_info(16), st.sampled_from([None, 3])),
        max_size=6,
    )
)
def test_storage_records_are_keyed_as_python_keys_them(storage_data: dict) -> None:
    assert C_TABLE.storage_by_key(storage_data) == reader._storage_by_key(storage_data)


# --- one field of a genuine table wrong at a time --------------------------------------------


def genuine() -> tuple[dict, dict, dict]:
    """A (4, 2) float32 tensor in two row chunks, and an object: table, storage, planner."""
    chunks = [
        record(md.ChunkStorageMetadata, offsets=(0, 0), sizes=(2, 2)),
        record(md.ChunkStorageMetadata, offsets=(2, 0), sizes=(2, 2)),
    ]
    properties = record(md.TensorProperties, dtype=DtypeName("float32"))
    table = {
        "w": record(md.TensorStorageMetadata, properties=properties, size=(4, 2), chunks=chunks),
        "o": record(md.BytesStorageMetadata),
    }
    info = {
        (0, 0): record(md.StorageInfo, relative_path="__0_0.distcp", offset=0, length=16),
        (2, 0): record(md.StorageInfo, relative_path="__0_0.distcp", offset=16, length=16),
        None: record(md.StorageInfo, relative_path="__1_0.distcp", offset=0, length=64),
    }
    storage_data = {
        record(md.MetadataIndex, fqn="o" if at is None else "w", offset=at): one
        for at, one in info.items()
    }
    return table, storage_data, {"w": ("model", "w"), "o": ("train_state", "o")}


def chunk(table: dict, i: int) -> Any:
    return table["w"].chunks[i]


def info(storage_data: dict, fqn: str, i: int = 0) -> Any:
    return [v for k, v in storage_data.items() if k.fqn == fqn][i]


CHANGES: dict[str, Callable[[dict, dict, dict], object]] = {
    "genuine": lambda t, s, p: None,
    "size as a list": lambda t, s, p: setattr(t["w"], "size", [4, 2]),
    "offsets as a list": lambda t, s, p: setattr(chunk(t, 1), "offsets", [2, 0]),
    "planner path empty": lambda t, s, p: p.update(w=[]),
    "planner path not a list": lambda t, s, p: p.update(w="ab"),
    "key not in planner": lambda t, s, p: p.pop("w"),
    "transforms named": lambda t, s, p: setattr(info(s, "w"), "transform_descriptors", ["z"]),
    "chunks in reverse order": lambda t, s, p: t["w"].chunks.reverse(),
    "an empty piece": lambda t, s, p: add_chunk(t, s, (4, 0), (0, 2)),
    "split along dim 1": lambda t, s, p: split_columns(t, s),
    "an empty piece outside": lambda t, s, p: add_chunk(t, s, (5, 0), (0, 2)),
    "pieces with a gap": lambda t, s, p: setattr(chunk(t, 1), "sizes", (1, 2)),
    "a piece twice": lambda t, s, p: add_chunk(t, s, (2, 0), (2, 2), at=(2, 0)),
    "a piece not whole across": lambda t, s, p: setattr(chunk(t, 1), "sizes", (2, 1)),
    "dtype a plain str": lambda t, s, p: setattr(t["w"].properties, "dtype", "float32"),
    "dtype unknown": lambda t, s, p: setattr(t["w"].properties, "dtype", DtypeName("f99")),
    "no properties": lambda t, s, p: setattr(t["w"], "properties", None),
    "shape negative": lambda t, s, p: setattr(t["w"], "size", (4, -2)),
    "shape a float": lambda t, s, p: setattr(t["w"], "size", (4, 2.0)),
    "shape a bool": lambda t, s, p: setattr(t["w"], "size", (4, True)),
    "shape too large": lambda t, s, p: setattr(t["w"], "size", (1 << 31, 1 << 31)),
    "shape 65 dims": lambda t, s, p: setattr(t["w"], "size", (1,) * 65),
    "chunks a tuple": lambda t, s, p: setattr(t["w"], "chunks", tuple(t["w"].chunks)),
    "chunk not a record": lambda t, s, p: t["w"].chunks.__setitem__(1, 3),
    "offsets of 1 dim": lambda t, s, p: setattr(chunk(t, 1), "offsets", (2,)),
    "offsets a bool": lambda t, s, p: setattr(chunk(t, 0), "offsets", (False, 0)),
    "sizes past 2**62": lambda t, s, p: setattr(chunk(t, 1), "sizes", (1 << 62, 2)),
    "chunks overlap": lambda t, s, p: setattr(chunk(t, 1), "sizes", (3, 2)),
    "no record for a chunk": lambda t, s, p: s.pop(next(k for k in s if k.offset == (2, 0))),
    "file missing": lambda t, s, p: setattr(info(s, "w"), "relative_path", "gone.distcp"),
    "file not named": lambda t, s, p: setattr(info(s, "w"), "relative_path", 5),
    "byte offset negative": lambda t, s, p: setattr(info(s, "w"), "offset", -1),
    "byte length a bool": lambda t, s, p: setattr(info(s, "w"), "length", True),
    "item past the file end": lambda t, s, p: setattr(info(s, "w"), "offset", 4090),
    "transform not a str": lambda t, s, p: setattr(info(s, "w"), "transform_descriptors", [1]),
    "transforms a str": lambda t, s, p: setattr(info(s, "w"), "transform_descriptors", "ab"),
    "record not StorageInfo": lambda t, s, p: s.update(
        {k: record(md.MetadataIndex, fqn="w") for k in s if k.offset == (0, 0)}
    ),
    "planner path too long": lambda t, s, p: p.update(w=("m",) * 65),
    "planner index too large": lambda t, s, p: p.update(w=("model", 1 << 20)),
    "planner path holds a bool": lambda t, s, p: p.update(w=("model", True)),
    "object record at ()": lambda t, s, p: s.update(
        {record(md.MetadataIndex, fqn="o", offset=()): s.pop(next(k for k in s if k.fqn == "o"))}
    ),
    "object past the file end": lambda t, s, p: setattr(info(s, "o"), "length", 101),
}


def add_chunk(
    table: dict, storage_data: dict, offsets: tuple, sizes: tuple, at: Any = None
) -> None:
    """One more chunk of ``w``; its record is a new one, or (``at``) an existing chunk's."""
    table["w"].chunks.append(record(md.ChunkStorageMetadata, offsets=offsets, sizes=sizes))
    if at is None:
        where = record(md.StorageInfo, relative_path="__0_0.distcp", offset=32, length=0)
        storage_data[record(md.MetadataIndex, fqn="w", offset=offsets)] = where


def split_columns(table: dict, storage_data: dict) -> None:
    for i, c in enumerate(table["w"].chunks):
        vars(c).update(offsets=(0, i), sizes=(4, 1))
    for k in [k for k in storage_data if k.fqn == "w"]:
        storage_data[record(md.MetadataIndex, fqn="w", offset=(0, k.offset[0] // 2))] = (
            storage_data.pop(k)
        )


FAST = {
    "chunks in reverse order",
    "an empty piece",
    "split along dim 1",
    "genuine",
    "size as a list",
    "offsets as a list",
    "planner path empty",
    "planner path not a list",
    "key not in planner",
    "transforms named",
}

# Python accepts these; the fast path leaves them to it (no genuine file has them)
SOUND_BUT_UNUSUAL = {"transforms a str", "object record at ()"}


@pytest.mark.parametrize("change", CHANGES)
def test_one_field_wrong_is_left_to_python(storage: LocalStorage, change: str) -> None:
    """The fast path builds the keys Python finds sound, and only those; the entries are the
    same either way (Python words each problem)."""
    table, storage_data, planner = genuine()
    CHANGES[change](table, storage_data, planner)
    meta = record(
        md.Metadata, state_dict_metadata=table, storage_data=storage_data, planner_data=planner
    )
    fast, slow = both(lambda: reader._entries(meta, {}, storage, "x/.metadata"))
    assert fast == slow
    by_key, _ = C_TABLE.storage_by_key(storage_data)
    rows = C_TABLE.entries(table, by_key, FILES, planner, {}, reader._TABLE_CONSTS)
    tensor_built = change in FAST or change.startswith("object")
    assert [row is not None for row in rows] == [tensor_built, not change.startswith("object")]
    assert (slow[0].error is None) is (tensor_built or change in SOUND_BUT_UNUSUAL)
    assert (slow[1].error is None) is (change != "object past the file end")
    assert all(row == entry for row, entry in zip(rows, slow, strict=True) if row is not None)


def test_a_key_with_a_known_problem_is_left_to_python() -> None:
    table, storage_data, planner = genuine()
    by_key, _ = C_TABLE.storage_by_key(storage_data)
    rows = C_TABLE.entries(table, by_key, FILES, planner, {"w": "x"}, reader._TABLE_CONSTS)
    assert rows[0] is None and rows[1] is not None


def test_shared_chunk_lists_are_found_as_python_finds_them() -> None:
    table, _, _ = genuine()
    shared = table["w"].chunks
    for i in range(3):
        table[f"copy{i}"] = record(md.TensorStorageMetadata, chunks=shared)
    table["tuple"] = record(md.TensorStorageMetadata, chunks=tuple(shared))
    table["other"] = record(md.TensorStorageMetadata, chunks=list(shared))
    firsts = C_TABLE.shared_chunk_lists(table, md.TensorStorageMetadata)
    assert firsts == reader._first_owners(table) == {f"copy{i}": "w" for i in range(3)}


@pytest.mark.parametrize(
    ("change", "fits", "named"),
    [
        ("genuine", True, None),
        ("items overlap", False, "bytes 8..24 of __0_0.distcp overlap the item of key 'w'"),
        ("item too small", False, "has 4 elements but its item in __0_0.distcp has only 0 bytes"),
        ("too small in a safetensors file", True, None),
    ],
)
def test_items_fit_gives_the_verdict_of_the_items_check(
    storage: LocalStorage, change: str, fits: bool, named: str | None
) -> None:
    table, storage_data, _ = genuine()
    table["v"] = table["w"]  # a second key, its records below
    records = [k for k in storage_data if k.fqn == "w"]
    for k in records:
        length = 0 if change.endswith("too small") or "safetensors" in change else 16
        offset = 8 if change == "items overlap" else 1000 + k.offset[0] * 8
        where = record(md.StorageInfo, relative_path="__0_0.distcp", offset=offset, length=length)
        storage_data[record(md.MetadataIndex, fqn="v", offset=k.offset)] = where
    meta = record(md.Metadata, state_dict_metadata=table, storage_data=storage_data)
    entries = reader._entries(meta, {}, storage, "x/.metadata")
    safetensors = {"__0_0.distcp"} if "safetensors" in change else set()
    assert C_TABLE.items_fit(entries, safetensors, reader._MAX_ZSTD_RATIO) is fits
    fast, slow = both(lambda: reader._check_items(entries, safetensors, ".metadata"))
    assert fast == slow
    errors = [e.error for e in slow if e.error]
    assert any(named in e for e in errors) if named else not errors
