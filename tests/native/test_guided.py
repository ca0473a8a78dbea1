"""Coverage-guided fuzzing of the native entries (tests/native/guided.py): libFuzzer through
atheris, the C code built by clang with its coverage counters, ASan and UBSan. ``make test``
runs the ``table`` target (a DCP open, native and Python, so the three decoders run) for
``GUIDED_FUZZ_SECONDS`` (8 by default); ``make fuzz`` runs every target for longer. A
sanitizer report, an exception or a native/Python difference fails the run."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.native import sanitized

SECONDS = float(os.environ.get("GUIDED_FUZZ_SECONDS", "8"))
TARGETS = os.environ.get("GUIDED_TARGETS", "table").split(",")
# Edges libFuzzer sees at the start (seeds alone): 474 (metadata), 18 (opscan), measured.
FLOOR = {"metadata": 300, "opscan": 12, "table": 300}
STATS = re.compile(r"#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+) corp: (\d+)/")


@pytest.mark.parametrize("target", TARGETS)
def test_coverage_guided(target: str, guided_build: Path, corpus: Path, seeds: Path) -> None:
    template = corpus / "genuine-seed"
    if not template.is_dir():
        template = sorted(p.parent for p in corpus.glob("genuine-*/.metadata"))[0]
    done = sanitized.guided(guided_build, target, template, seeds, SECONDS)
    assert done.returncode == 0, done.stderr[-6000:]
    found = STATS.search(done.stderr)
    assert found, done.stderr[-3000:]
    runs, cov, features, corp = map(int, found.groups())
    # Without clang's counters in the C code, libFuzzer sees no edges at all (Python is not
    # instrumented): the coverage is the extensions'.
    assert cov > FLOOR[target], found[0]
    assert runs > 0 and corp > 0 and features >= cov
