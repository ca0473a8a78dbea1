"""Fuzzing: genuine files mutated (bit flips, overwritten bytes and integers, truncation,
splices with a second genuine file, duplicated and deleted ranges) and then opened,
listed, scanned and read in full. The only acceptable outcomes are a result whose tensors
have their listed dtype and shape, or an InspectorError: no other exception, no hang, no
code execution (the audit-hook guard), no large allocation.

``make test`` runs the "ci" profile (derandomized, so CI is reproducible); ``make fuzz``
the "fuzz" profile, many more examples with a fresh seed each run
(``FUZZ_PROFILE=fuzz``).
"""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures.damage import (
    copy,
    dcp_metadata,
    repoint,
    storage_indexes,
    write_dcp_metadata,
)
from tests.hostile.case import Genuine
from tests.hostile.guard import GuardViolation, guarded
from tests.hostile.pipeline import Probe, explore, usage
from tests.hostile.tally import TALLY

_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci",
    max_examples=300,
    derandomize=True,
    database=None,
    deadline=timedelta(seconds=5),
    suppress_health_check=_SLOW,
)
settings.register_profile(
    "fuzz", max_examples=10_000, deadline=timedelta(seconds=5), suppress_health_check=_SLOW
)
FUZZ = settings.get_profile(os.environ.get("FUZZ_PROFILE", "ci"))
HANG_SECONDS = 30  # an example still running then is stopped (its deadline already failed)
RSS_BYTES = 256 << 20
# Integers that make length and offset fields lie: zero, edges of 31/32/63/64 bits, -1.
LIES = [0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 40, (1 << 63) - 1, (1 << 64) - 1]


@dataclass
class Target:
    """A genuine file to mutate: its bytes, a second genuine file to splice in, the
    ranges holding structure rather than tensor data (mutated more often), how to put the
    mutated bytes in place, and the path to open."""

    name: str
    data: bytes
    partner: bytes
    hot: list[tuple[int, int]]
    write: Callable[[bytes], None]
    opens: Path


@dataclass(frozen=True)
class Mutation:
    """One change at byte ``at`` (clamped to the current length); ``value`` and ``size``
    mean: the bit, the byte, the integer and its width, the partner offset and length."""

    kind: str
    at: int
    value: int = 0
    size: int = 0

    def apply(self, data: bytearray, partner: bytes) -> None:
        at = min(self.at, len(data))
        if self.kind == "flip" and data:
            data[min(at, len(data) - 1)] ^= 1 << self.value
        elif self.kind in ("byte", "integer"):
            data[at : at + self.size] = self.value.to_bytes(self.size, "little")
        elif self.kind == "truncate":
            del data[at:]
        elif self.kind == "splice":
            data[at:] = partner[self.value :]
        elif self.kind == "insert":
            data[at:at] = partner[self.value : self.value + self.size]
        elif self.kind == "duplicate":
            data[at:at] = data[at : at + self.size]
        elif self.kind == "delete":
            del data[at : at + self.size]


def mutate(target: Target, mutations: list[Mutation]) -> bytes:
    data = bytearray(target.data)
    for mutation in mutations:
        mutation.apply(data, target.partner)
    return bytes(data)


@st.composite
def mutations(draw: st.DrawFn, target: Target) -> list[Mutation]:
    """One to four mutations of the target."""
    found = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(KINDS))
        start, end = draw(st.sampled_from([*target.hot, (0, len(target.data))]))
        at = draw(st.integers(start, max(start, end - 1)))
        partner_at = st.integers(0, len(target.partner))
        value, size = {
            "flip": (st.integers(0, 7), st.just(0)),
            "byte": (st.sampled_from([0, 1, 0x7F, 0x80, 0xFF]), st.just(1)),
            "integer": (st.sampled_from(LIES), st.sampled_from([4, 8])),
            "truncate": (st.just(0), st.just(0)),
            "splice": (partner_at, st.just(0)),
            "insert": (partner_at, st.integers(1, 512)),
            "duplicate": (st.just(0), st.integers(1, 512)),
            "delete": (st.just(0), st.integers(1, 512)),
        }[kind]
        size = draw(size)
        value = draw(value)
        if kind == "integer":
            value &= (1 << (8 * size)) - 1
        found.append(Mutation(kind, at, value, size))
    return found


KINDS = ["flip", "byte", "integer", "truncate", "splice", "insert", "duplicate", "delete"]


# --- running one example ---------------------------------------------------------------------


@contextmanager
def _hang_breaker(seconds: int) -> Iterator[None]:
    """Interrupt an example that never returns (hypothesis' deadline only judges finished
    ones)."""

    def stop(signum, frame):
        raise TimeoutError(f"example still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_example(family: str, target: Target, blob: bytes, work: Path) -> None:
    """Put ``blob`` in place and explore it under the guard; InspectorErrors are outcomes,
    anything else fails the example."""
    target.write(blob)
    start = time.perf_counter()
    try:
        with usage(trace=False) as used, guarded(work), _hang_breaker(HANG_SECONDS):
            ck, errors = explore(Probe(), target.opens)
    except GuardViolation as exc:  # a BaseException: made a failure hypothesis can shrink
        raise AssertionError(f"guard: {exc}") from None
    outcome = "refused" if ck is None else "partly readable" if errors else "read in full"
    TALLY.example(family, time.perf_counter() - start, outcome)
    assert used.rss_growth < RSS_BYTES, used


# --- the genuine files and where their mutants go --------------------------------------------


def _structure_of_zip(data: bytes) -> list[tuple[int, int]]:
    """The ranges of a torch.save zip around its tensor bytes: up to the first storage
    record's data, and from the last one's end (alignment padding allowed for)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        infos = [i for i in archive.infolist() if "/data/" in i.filename]
    if not infos:
        return [(0, len(data))]
    first = min(i.header_offset for i in infos) + 200
    last = max(i.header_offset + 30 + len(i.filename) + 64 + i.file_size for i in infos)
    return [(0, first), (last, len(data))]


def _metadata(genuine: Genuine, work: Path) -> Target:
    folder = copy(genuine.seed, work)
    data = (genuine.seed / ".metadata").read_bytes()
    return Target(
        "seed/.metadata",
        data,
        (genuine.flat / ".metadata").read_bytes(),
        [(0, len(data))],
        (folder / ".metadata").write_bytes,
        folder,
    )


def _items(genuine: Genuine, work: Path) -> list[Target]:
    """One target per tensor item of the seed checkpoint: the item goes to a file of its
    own and ``.metadata`` points the key at it."""
    folder = copy(genuine.seed, work)
    metadata = dcp_metadata(folder)
    shard = (folder / "__0_0.distcp").read_bytes()
    targets = []
    keys = sorted(metadata.state_dict_metadata)
    for key, partner_key in zip(keys, keys[1:] + keys[:1], strict=True):
        infos = [metadata.storage_data[storage_indexes(metadata, k)[0]] for k in (key, partner_key)]
        item, partner = (shard[i.offset : i.offset + i.length] for i in infos)

        def write(blob: bytes, key: str = key) -> None:
            (folder / "__0_1.distcp").write_bytes(blob)
            old = repoint(metadata, key, relative_path="__0_1.distcp", offset=0, length=len(blob))
            write_dcp_metadata(folder, metadata)
            metadata.storage_data[storage_indexes(metadata, key)[0]] = old

        hot = _structure_of_zip(item)
        targets.append(Target(f"seed item {key}", item, partner, hot, write, folder))
    return targets


def _file(path: Path, partner: Path, work: Path, hot: list[tuple[int, int]]) -> Target:
    target = work / path.name
    data = path.read_bytes()
    return Target(path.name, data, partner.read_bytes(), hot, target.write_bytes, target)


def _safetensors(genuine: Genuine, work: Path) -> Target:
    data = genuine.safetensors.read_bytes()
    (header,) = struct.unpack("<Q", data[:8])
    partner = next(genuine.hub.glob("*.safetensors"))
    return _file(genuine.safetensors, partner, work, [(0, 8 + header)])


def _index(genuine: Genuine, work: Path) -> Target:
    folder = copy(genuine.hub, work)
    index = folder / "model.safetensors.index.json"
    data = index.read_bytes()
    shard = folder / next(iter(json.loads(data)["weight_map"].values()))
    return Target(index.name, data, shard.read_bytes(), [(0, len(data))], index.write_bytes, folder)


def _pt(genuine: Genuine, work: Path) -> Target:
    data = genuine.pt.read_bytes()
    return _file(genuine.pt, genuine.model_bin, work, _structure_of_zip(data))


def _legacy(genuine: Genuine, work: Path) -> Target:
    data = genuine.legacy.read_bytes()
    return _file(genuine.legacy, genuine.pt, work, [(0, len(data) // 3)])


def _distcp_safetensors(genuine: Genuine, work: Path) -> Target:
    folder = copy(genuine.distcp_safetensors, work)
    shard = folder / "__0_0.distcp"
    data = shard.read_bytes()
    partner = genuine.safetensors.read_bytes()
    return Target(shard.name, data, partner, [(0, len(data))], shard.write_bytes, folder)


FAMILIES: dict[str, Callable[[Genuine, Path], list[Target]]] = {
    "DCP .metadata": lambda genuine, work: [_metadata(genuine, work)],
    "DCP .distcp items": _items,
    "DCP safetensors .distcp": lambda genuine, work: [_distcp_safetensors(genuine, work)],
    "safetensors": lambda genuine, work: [_safetensors(genuine, work)],
    "index.json": lambda genuine, work: [_index(genuine, work)],
    ".pt zip": lambda genuine, work: [_pt(genuine, work)],
    ".pt pre-1.6": lambda genuine, work: [_legacy(genuine, work)],
}


@pytest.fixture(scope="module")
def targets(genuine, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[Target]]:
    """A family's targets, built on first use (hypothesis runs the test once per example)."""
    built: dict[str, list[Target]] = {}

    def get(family: str) -> list[Target]:
        if family not in built:
            built[family] = FAMILIES[family](genuine, tmp_path_factory.mktemp("fuzz"))
        return built[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning:pickletools")
@FUZZ
@given(data=st.data())
def test_mutants(family: str, targets, data: st.DataObject) -> None:
    found = {t.name: t for t in targets(family)}
    target = found[data.draw(st.sampled_from(sorted(found)))]
    blob = mutate(target, data.draw(mutations(target)))
    run_example(family, target, blob, target.opens.parent)
