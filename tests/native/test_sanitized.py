"""The native decoders under AddressSanitizer and UndefinedBehaviorSanitizer (see
tests/native/sanitized.py): the capacity-boundary inputs, every genuine and hostile DCP
checkpoint opened with and without the native code (the same result), and a short
structure-aware fuzz pass (``SANITIZED_FUZZ_SECONDS``, 30 by default; ``make fuzz`` runs a
long one). Any memory error, any undefined behaviour or index out of range aborts the
process and fails the test."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

from tests.hostile.tally import TALLY
from tests.native import sanitized

SECONDS = float(os.environ.get("SANITIZED_FUZZ_SECONDS", "30"))
SEED = os.environ.get("SANITIZED_FUZZ_SEED", "34")  # "random": a fresh one (make fuzz)


def test_the_sanitizer_catches_a_stale_pointer(build: Path) -> None:
    """The harness sees a read through a pointer kept across a PyMem_Realloc."""
    out = build / ("canary" + sysconfig.get_config_var("EXT_SUFFIX"))
    sanitized.compile_one(Path(__file__).with_name("canary.c"), out)
    done = sanitized.run(build, "import canary; canary.stale_read()", timeout=120)
    assert done.returncode != 0
    assert "heap-use-after-free" in done.stderr


def test_the_native_decoders_under_sanitizers(build: Path, corpus: Path) -> None:
    seed = int.from_bytes(os.urandom(4), "little") if SEED == "random" else int(SEED)
    done = sanitized.drive(build, corpus, SECONDS, seed)
    assert done.returncode == 0, f"seed {seed}: {done.stderr[-6000:]}"
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    TALLY.native = counts
    assert counts["boundaries"] > 10_000
    assert counts["folders"] >= 20
    assert counts["mutants"] > 100


def test_the_health_kernel_under_sanitizers(build: Path) -> None:
    """_health.c on every short block length, width and mode, specials and refused calls."""
    code = (
        "import runpy, sys; from inspector.analysis import _health; "
        f"assert _health.__file__.startswith({str(build)!r}), _health.__file__; "
        "sys.argv = ['health_cases']; runpy.run_module('tests.native.health_cases', "
        "run_name='__main__')"
    )
    done = sanitized.run(build, code, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert done.stdout.strip().endswith("ok")
