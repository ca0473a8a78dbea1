"""Hostile cases that may crash, hang, abort or poison the process (tests/hostile/isolated.py):
each runs in a child forked from a warmed-up zygote (tests/hostile/zygote.py) with a 3 GiB
address space, under the audit-hook guard and a per-step watchdog, and must do exactly what
the README's Security section promises.

Classes: memory corruption (``forgery``), interrupts (``interrupts``), amplification
through the pickle memo (``memo``), special files (``special_files``), allocation before
validation (``allocation``), foreign exception types (``exceptions``), cross-checkpoint
poisoning (``poisoning``) and Hugging Face cache containment (``containment``).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from tests.hostile import (
    allocation,
    containment,
    exceptions,
    forgery,
    interrupts,
    isolated,
    memo,
    poisoning,
    special_files,
)
from tests.hostile.case import Sources
from tests.hostile.tally import TALLY
from tests.hostile.zygote import Zygote

FAMILIES = {
    "forgery": forgery.CASES,
    "interrupts": interrupts.CASES,
    "memo": memo.CASES,
    "special_files": special_files.CASES,
    "allocation": allocation.CASES,
    "exceptions": exceptions.CASES,
    "poisoning": poisoning.CASES,
    "containment": containment.CASES,
}
CASES = {name: case for cases in FAMILIES.values() for name, case in cases.items()}


@pytest.fixture(scope="session")
def sources(genuine, demo_dir: Path, dcp_single_written: dict) -> Sources:
    return Sources(genuine, demo_dir / "fp8", dcp_single_written["hf"].path)


@pytest.fixture(scope="module")
def zygote(sources: Sources, tmp_path_factory: pytest.TempPathFactory):
    """One warmed-up process forking every case of this module."""
    warm = [str(p) for p in (*vars(sources.genuine).values(), sources.fp8, sources.dcp_hf)]
    work = tmp_path_factory.mktemp("zygote")
    setup = {"prepare": "tests.hostile.isolated:prepare", "warm": warm, "work": str(work)}
    found = Zygote(setup, work)
    yield found
    found.close()


@pytest.fixture(scope="session")
def digests(tmp_path_factory: pytest.TempPathFactory):
    """Digests of genuine checkpoints, once each: read by the inspector (``reference``) or
    by torch itself (``truth``, for what a later checkpoint must still read as)."""
    cache: dict[tuple[str, Path], dict[str, str]] = {}

    def get(kind: str, path: Path) -> dict[str, str]:
        if (kind, path) not in cache:
            if kind == "reference":
                cache[kind, path] = isolated.inspector_digests(path)
            else:
                cache[kind, path] = isolated.torch_digests(path, tmp_path_factory.mktemp("truth"))
        return cache[kind, path]

    return get


def source_hash(path: Path) -> str:
    """SHA-256 of the regular files under ``path`` (links and special files by name only,
    never opened: a case may hold a FIFO or a link to /dev/zero)."""
    digest = hashlib.sha256()
    if not path.is_dir() or path.is_symlink():
        found = [(path.parent, path.name)]
    else:
        found = [(Path(d), n) for d, dirs, files in os.walk(path) for n in sorted(dirs + files)]
    for folder, name in sorted(found):
        item = folder / name
        digest.update(str(item).encode())
        if stat.S_ISREG(item.lstat().st_mode):
            digest.update(item.read_bytes())
    return digest.hexdigest()


@pytest.mark.parametrize("name", sorted(CASES))
def test_isolated(name: str, sources: Sources, digests, zygote: Zygote, tmp_path: Path) -> None:
    spec = CASES[name](sources, tmp_path / "case")
    before = source_hash(spec.path) if spec.path is not None else None
    reference = digests("reference", spec.reference) if spec.reference else None
    truth = digests("truth", spec.then) if spec.then else None
    report = isolated.run(spec, tmp_path / "run", zygote, reference=reference, truth=truth)
    verdict = isolated.judge(spec, report, reference, truth)
    TALLY.isolated[name] = verdict.outcome
    (tmp_path / "verdict.json").write_text(json.dumps({"case": name, "problems": verdict.problems}))
    assert before is None or source_hash(spec.path) == before, "the source changed"
    assert not verdict.problems, "\n".join(verdict.problems)


def test_every_class_has_cases() -> None:
    """At least one case per class of the issue, several where it lists several forms."""
    counts = {family: len(cases) for family, cases in FAMILIES.items()}
    assert all(n >= 1 for n in counts.values()), counts
    assert counts["special_files"] >= 20 and counts["exceptions"] >= 12, counts
    assert len(CASES) >= 40


# --- the runner itself must see what it is there to see -------------------------------------


def _verdict(spec: isolated.Spec, tmp_path: Path, zygote: Zygote, **digests) -> isolated.Verdict:
    report = isolated.run(spec, tmp_path, zygote, **digests)
    return isolated.judge(spec, report, digests.get("reference"), digests.get("truth"))


def test_runner_passes_a_genuine_checkpoint(
    sources: Sources, digests, zygote: Zygote, tmp_path: Path
) -> None:
    spec = isolated.Spec(sources.seed, reference=sources.seed)
    verdict = _verdict(spec, tmp_path, zygote, reference=digests("reference", sources.seed))
    assert verdict.outcome == "ok", verdict.problems


@pytest.mark.parametrize(
    ("probe", "outcome"),
    [
        ("segfault", "crash:SIGSEGV@probe"),
        ("abort", "abort@probe"),
        ("hang", "timeout@probe"),
        ("poison", "poisoned@stand-ins"),
    ],
)
def test_runner_sees(probe: str, outcome: str, zygote: Zygote, tmp_path: Path) -> None:
    """A child that crashes, aborts, hangs or changes shared state fails the case, not the
    session, and the next case starts from the zygote's clean state."""
    spec = isolated.Spec(probe=probe, watchdog=3)
    assert _verdict(spec, tmp_path / "probe", zygote).outcome == outcome
    clean = isolated.Spec(probe="none")
    assert _verdict(clean, tmp_path / "after", zygote).outcome == "ok"


def test_runner_sees_wrong_values(
    sources: Sources, digests, zygote: Zygote, tmp_path: Path
) -> None:
    """A genuine checkpoint judged against another one's digests: reads differ."""
    spec = isolated.Spec(sources.seed, reference=sources.seed)
    wrong = {k: "not this" for k in digests("reference", sources.seed)}
    assert _verdict(spec, tmp_path, zygote, reference=wrong).outcome.startswith("wrong@read:")


def test_a_case_costs_little(zygote: Zygote, tmp_path: Path) -> None:
    """Forking a warmed-up child is what a case costs beyond its own steps."""
    import time

    start = time.perf_counter()
    for i in range(5):
        assert _verdict(isolated.Spec(probe="none"), tmp_path / str(i), zygote).outcome == "ok"
    assert (time.perf_counter() - start) / 5 < 0.5
