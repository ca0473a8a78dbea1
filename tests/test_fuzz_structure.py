"""Structure-aware fuzzing of the pickles checkpoints are made of: genuine ``.metadata``
files, DCP items' ``data.pkl`` (a plain tensor and a torchao float8 wrapper) and ``.pt``
files' ``data.pkl``, read as opcodes and changed where the memo, the nesting and the
integers live: a memo reference re-pointed at another slot (shared and cyclic objects),
a value replaced by a reference to an earlier container (subtrees duplicated through
the memo), a value replaced by 64 to 100,000 levels of lists, tuples or dicts, and
integers (shapes, offsets, lengths, numels, memo indices) set to 0, -1, 2^31, 2^63 or a
5000-digit number.

The acceptable outcomes are those of tests/test_fuzz.py (a result whose tensors have their
listed dtype and shape, or an InspectorError), checked in a worker process
(tests/hostile/worker.py) so that a segfault, an abort or a hang fails the example, and
the stand-ins' module state is compared after each. ``make test`` runs a few hundred
derandomized examples; ``FUZZ_PROFILE=fuzz`` many more with a fresh seed.
"""

from __future__ import annotations

import os
import pickletools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures.damage import copy, dcp_metadata, repoint, storage_indexes, write_dcp_metadata
from tests.hostile import opcodes
from tests.hostile.case import Sources
from tests.hostile.memo import FP8_KEY
from tests.hostile.tally import TALLY
from tests.hostile.worker import Worker

_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
_PROFILES = {
    "ci": settings(
        max_examples=50,
        derandomize=True,
        database=None,
        deadline=timedelta(seconds=5),
        suppress_health_check=_SLOW,
    ),
    "fuzz": settings(
        max_examples=3_000, deadline=timedelta(seconds=5), suppress_health_check=_SLOW
    ),
}
FUZZ = _PROFILES[os.environ.get("FUZZ_PROFILE", "ci")]
BOUNDARIES = [0, -1, 1 << 31, 1 << 63, 10**5000]
_DECIMAL = ["0", "-1", str(1 << 31), str(1 << 63), "1" + "0" * 5000]  # str() refuses 10**5000
DEPTHS = [64, 1000, 100_000]

_INTEGERS = {"INT", "LONG", "BININT", "BININT1", "BININT2", "LONG1", "LONG4"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_LEAVES = (
    _INTEGERS
    | {
        "BINUNICODE",
        "SHORT_BINUNICODE",
        "UNICODE",
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "BINFLOAT",
        "SHORT_BINBYTES",
        "BINBYTES",
        "EMPTY_TUPLE",
    }
    | _GETS
)
_CONTAINERS = {"EMPTY_DICT", "EMPTY_LIST", "MARK"}


@dataclass(frozen=True)
class Op:
    """One opcode of a pickle: its name, its argument, its bytes, and for memo opcodes the
    slot it names."""

    name: str
    raw: bytes
    slot: int | None = None


def ops_of(data: bytes) -> list[Op]:
    """The pickle's opcodes, frames dropped (a frameless protocol-4 pickle is valid) and
    MEMOIZE's implicit slots made explicit."""
    found, slots = [], 0
    parsed = list(pickletools.genops(data))
    ends = [pos for _, _, pos in parsed[1:]] + [len(data)]
    for (opcode, arg, pos), end in zip(parsed, ends, strict=True):
        if opcode.name == "FRAME":
            continue
        slot = None
        if opcode.name == "MEMOIZE":
            slot, slots = slots, slots + 1
        elif opcode.name in _PUTS | _GETS:
            slot = int(arg)
            slots = max(slots, slot + 1) if opcode.name in _PUTS else slots
        found.append(Op(opcode.name, data[pos:end] if opcode.name != "MEMOIZE" else b"\x94", slot))
    return found


@dataclass(frozen=True)
class Change:
    """Replace opcode ``at`` (an index into the candidates of ``kind``) by new opcodes:

    ``repoint`` a memo GET to slot ``value`` (or, when that slot is not put before it, to
    one that is); ``share`` a value by such a GET (a container still being built makes a
    cycle); ``deepen`` a value
    into ``size`` levels of ``value`` (0 lists, 1 tuples, 2 dicts); ``integer`` an int to
    ``BOUNDARIES[value]``; ``memo-index`` a PUT or GET's slot to ``BOUNDARIES[value]``.
    """

    kind: str
    at: int
    value: int = 0
    size: int = 0

    def apply(self, ops: list[Op]) -> list[Op]:
        places = candidates(ops, self.kind)
        if not places:
            return ops
        i = places[self.at % len(places)]
        earlier = [op.slot for op in ops[:i] if op.name in _PUTS]
        if self.kind in ("repoint", "share"):
            if not earlier:
                return ops
            slot = self.value if self.value in earlier else earlier[self.value % len(earlier)]
            raw = opcodes.get(slot)
        elif self.kind == "deepen":
            build = (opcodes.deep_list, opcodes.deep_tuple, opcodes.deep_dict)[self.value % 3]
            raw = build(self.size)
        elif self.kind == "integer":
            raw = opcodes.integer(BOUNDARIES[self.value])
        else:
            letter = "p" if ops[i].name in _PUTS else "g"
            raw = f"{letter}{_DECIMAL[self.value]}\n".encode()
        return [*ops[:i], Op("MUTATED", raw), *ops[i + 1 :]]


def candidates(ops: list[Op], kind: str) -> list[int]:
    names = {
        "repoint": _GETS,
        "share": _LEAVES,
        "deepen": _LEAVES,
        "integer": _INTEGERS,
        "memo-index": _PUTS | _GETS,
    }[kind]
    return [i for i, op in enumerate(ops) if op.name in names]


def container_slots(ops: list[Op]) -> list[int]:
    """Slots holding containers (put right after one is started): what ``share`` prefers."""
    return [
        ops[i + 1].slot
        for i in range(len(ops) - 1)
        if ops[i].name in _CONTAINERS and ops[i + 1].name in _PUTS
    ]


KINDS = ["repoint", "share", "deepen", "integer", "memo-index"]


@st.composite
def changes(draw: st.DrawFn, ops: list[Op]) -> list[Change]:
    """One to three changes; ``share`` aims at a container slot half the time."""
    found = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(KINDS))
        at = draw(st.integers(0, 10_000))
        value = {
            "repoint": st.integers(0, 10_000),
            "share": st.integers(0, 10_000),
            "deepen": st.integers(0, 2),
            "integer": st.integers(0, len(BOUNDARIES) - 1),
            "memo-index": st.integers(0, len(BOUNDARIES) - 1),
        }[kind]
        value = draw(value)
        slots = container_slots(ops)
        if kind == "share" and slots and draw(st.booleans()):
            value = draw(st.sampled_from(slots))
        size = draw(st.sampled_from(DEPTHS)) if kind == "deepen" else 0
        found.append(Change(kind, at, value, size))
    return found


def assemble(ops: list[Op]) -> bytes:
    return b"".join(op.raw for op in ops)


# --- the genuine pickles and where their mutants go ------------------------------------------


@dataclass
class Target:
    """A genuine pickle (as opcodes), how to put a mutant in place, and what to open."""

    ops: list[Op]
    write: Callable[[bytes], None]
    opens: Path


def _metadata(source: Path, work: Path) -> Target:
    folder = copy(source, work)
    ops = ops_of((source / ".metadata").read_bytes())
    return Target(ops, (folder / ".metadata").write_bytes, folder)


def _item(source: Path, key: str, work: Path) -> Target:
    """``key``'s chunk, its ``data.pkl`` mutated, in a file of its own that ``.metadata``
    points the key at."""
    folder = copy(source, work)
    metadata = dcp_metadata(folder)
    info = metadata.storage_data[storage_indexes(metadata, key)[0]]
    with open(folder / info.relative_path, "rb") as f:
        f.seek(info.offset)
        item = f.read(info.length)

    def write(pkl: bytes) -> None:
        blob = opcodes.with_data_pkl(item, pkl)
        (folder / "__9_0.distcp").write_bytes(blob)
        old = repoint(metadata, key, relative_path="__9_0.distcp", offset=0, length=len(blob))
        write_dcp_metadata(folder, metadata)
        metadata.storage_data[storage_indexes(metadata, key)[0]] = old

    return Target(ops_of(opcodes.data_pkl(item)), write, folder)


def _pt(source: Path, work: Path) -> Target:
    archive = source.read_bytes()
    target = work / source.name
    work.mkdir(parents=True, exist_ok=True)

    def write(pkl: bytes) -> None:
        target.write_bytes(opcodes.with_data_pkl(archive, pkl))

    return Target(ops_of(opcodes.data_pkl(archive)), write, target)


FAMILIES: dict[str, Callable[[Sources, Path], Target]] = {
    "seed .metadata": lambda s, work: _metadata(s.seed, work),
    "flat .metadata": lambda s, work: _metadata(s.flat, work),
    "DCP item data.pkl": lambda s, work: _item(s.seed, "layers.0.attention.wq.weight", work),
    "FP8 wrapper data.pkl": lambda s, work: _item(s.fp8, FP8_KEY, work),
    ".pt data.pkl": lambda s, work: _pt(s.pt, work),
    "pytorch_model.bin data.pkl": lambda s, work: _pt(s.model_bin, work),
}


@pytest.fixture(scope="module")
def sources(genuine, demo_dir: Path, dcp_single_written: dict) -> Sources:
    return Sources(genuine, demo_dir / "fp8", dcp_single_written["hf"].path)


@pytest.fixture(scope="module")
def worker(sources: Sources, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    warm = [sources.seed, sources.flat, sources.fp8, sources.pt, sources.model_bin]
    found = Worker(warm, tmp_path_factory.mktemp("worker"))
    yield found
    found.close()


@pytest.fixture(scope="module")
def targets(sources: Sources, tmp_path_factory: pytest.TempPathFactory):
    built: dict[str, Target] = {}

    def get(family: str) -> Target:
        if family not in built:
            built[family] = FAMILIES[family](sources, tmp_path_factory.mktemp("structure"))
        return built[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
@FUZZ
@given(data=st.data())
def test_structure(family: str, targets, worker: Worker, data: Any) -> None:
    target = targets(family)
    ops = target.ops
    for change in data.draw(changes(target.ops)):
        ops = change.apply(ops)
    target.write(assemble(ops))
    start = time.perf_counter()
    outcome, problem = worker.explore(target.opens, target.opens.parent)
    TALLY.example(f"structure {family}", time.perf_counter() - start, outcome)
    assert problem is None, problem


def test_mutations_change_what_they_say(sources: Sources) -> None:
    """Each kind rewrites the opcode it names, and only that one."""
    ops = ops_of(opcodes.data_pkl(sources.model_bin.read_bytes()))
    for kind in KINDS:
        places = candidates(ops, kind)
        assert places, kind
        at = len(places) // 2
        changed = Change(kind, at, 2, 64).apply(ops)
        diff = [i for i, (a, b) in enumerate(zip(ops, changed, strict=True)) if a != b]
        assert diff == [places[at]], (kind, diff)
    assert assemble(ops) == opcodes.data_pkl(sources.model_bin.read_bytes())
