"""Runs the native decoders over inputs, in a process of its own (the sanitized build's, see
tests/native/sanitized.py): any memory error or undefined behaviour aborts it.

``python drive.py CORPUS SECONDS SEED`` reads CORPUS (a folder of DCP checkpoint folders:
genuine ones and the hostile corpus's), then:
1. every boundary input (tests/native/boundaries.py) through ``_metadata.entries`` (each must
   be declined) and ``_opscan.clean``;
2. every corpus folder opened with the native code and without it (the differential: the
   same entries, facts and errors);
3. SECONDS of structure-aware mutation fuzzing of the corpus's ``.metadata`` files
   (tests/native/mutate.py), each mutant through both native entries, every tenth also
   opened both ways.
Prints one JSON line of counts; exits 1 on a difference (listed on stderr).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[2]
sys.path.append(str(ROOT))  # tests.*; inspector comes first from PYTHONPATH (the build's)

from inspector.errors import InspectorError  # noqa: E402
from inspector.formats.dcp import reader  # noqa: E402
from inspector.formats.safe_pickle import direct, prescan  # noqa: E402
from inspector.storage.local import LocalStorage  # noqa: E402
from tests.native import boundaries, mutate  # noqa: E402

NATIVE = (direct._metadata, reader._table, prescan._clean)


def native(on: bool) -> None:
    """Every native path on, or all off (the pure-Python one)."""
    direct._metadata, reader._table, prescan._clean = NATIVE if on else (None, None, None)


def opened(folder: Path) -> Any:
    """What the DCP reader makes of the folder: its entries and facts, or the error."""
    try:
        source = reader.DcpSource(LocalStorage(folder))
    except InspectorError as exc:
        return type(exc), str(exc)
    return source.entries(), source.metadata, source.nesting, source.format


def differs(folder: Path) -> bool:
    native(True)
    fast = opened(folder)
    native(False)
    slow = opened(folder)
    native(True)
    return fast != slow


def decode(data: bytes) -> Any:
    """Both native entries on `data`: _metadata's result and _opscan's verdict."""
    consts = direct._consts()
    found = NATIVE[0].entries(data, lambda names: dict.fromkeys(names, 1 << 40), consts)
    return found, NATIVE[2](data, 0, len(data), prescan._OPSCAN_TABLE)


def check_build() -> None:
    """Every native module loaded is the sanitized build's."""
    build = Path(os.environ["SANITIZED_BUILD"])
    for module in (direct._metadata, reader._table, sys.modules[prescan._clean.__module__]):
        assert module is not None and Path(module.__file__).is_relative_to(build), module


def main(corpus: Path, seconds: float, seed: int) -> int:
    check_build()
    counts = {"boundaries": 0, "folders": 0, "mutants": 0, "mutants_opened": 0}
    failures = []
    for name, data in boundaries.inputs():
        if decode(data)[0] is not None:
            failures.append(f"boundary input {name} was accepted")
        counts["boundaries"] += 1
    folders = sorted(p.parent for p in corpus.glob("*/.metadata"))
    for folder in folders:
        if differs(folder):
            failures.append(f"{folder.name}: native and Python differ")
        counts["folders"] += 1
    rng = random.Random(seed)
    seeds = [(folder, (folder / ".metadata").read_bytes()) for folder in folders]
    parsed = [mutate.ops(data) for _, data in seeds]
    work = corpus.parent / "mutants"
    end = time.monotonic() + seconds
    while seeds and time.monotonic() < end:
        pick = rng.randrange(len(seeds))
        folder, data = seeds[pick]
        mutant = mutate.mutant(data, rng, parsed[pick])
        decode(mutant)
        counts["mutants"] += 1
        if counts["mutants"] % 10 == 0:
            if differs(mutate.place(folder, work, mutant)):
                failures.append(f"mutant of {folder.name} ({mutant.hex()[:64]}...): differ")
            counts["mutants_opened"] += 1
    counts["seconds"] = round(seconds, 1)
    print(json.dumps(counts))
    for failure in failures[:20]:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])))
