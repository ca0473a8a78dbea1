"""Hostile inputs, third round (tests/hostile/trust.py): text that reaches a terminal or
matplotlib, remote servers that stall, trickle, ignore Range or gzip-bomb, ambiguous and
partly broken archives, absurd key names and numpy values. Each case runs in a child forked
from a warmed-up zygote, with a 3 GiB address space and a time limit, and raises on any
broken promise of the README's Security section.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hostile import browsable, names, network, numpy_values, plotting, terminal
from tests.hostile.zygote import Zygote

FAMILIES = {
    "terminal": terminal.CASES,
    "plotting": plotting.CASES,
    "network": network.CASES,
    "names": names.CASES,
    "numpy": numpy_values.CASES,
    "browsable": {n: c for n, c in browsable.CASES.items() if n.startswith("browsable:")},
    "agreement": {n: c for n, c in browsable.CASES.items() if n.startswith("agreement:")},
}
CASES = {name: case for cases in FAMILIES.values() for name, case in cases.items()}


@pytest.fixture(scope="module")
def trust_zygote(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("trust-zygote")
    found = Zygote({"prepare": "tests.hostile.trust:prepare", "work": str(work)}, work)
    yield found
    found.close()


@pytest.mark.parametrize("name", sorted(CASES))
def test_trust(name: str, trust_zygote: Zygote, tmp_path: Path) -> None:
    case = CASES[name]
    stderr = tmp_path / "stderr"
    ended = trust_zygote.run(
        case.target, {**case.args, "tmp": str(tmp_path)}, stderr, case.seconds
    )
    said = stderr.read_text(errors="replace")[-4000:] if stderr.exists() else ""
    assert not ended.timed_out, f"hung past {case.seconds} s: {ended.records}\n{said}"
    assert ended.returncode == 0, f"exit status {ended.returncode}: {said}"


def test_every_class_has_several_variants() -> None:
    counts = {family: len(cases) for family, cases in FAMILIES.items()}
    assert all(n >= 3 for n in counts.values()), counts
