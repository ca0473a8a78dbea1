"""A coverage-guided fuzz target per native entry point: libFuzzer, through atheris, drives
the Python entry of a C extension built by clang with ``-fsanitize=fuzzer-no-link`` (its
edge counters guide the search; see sanitized.GUIDED_FLAGS), ASan and UBSan.

``python guided.py TARGET TEMPLATE [libFuzzer arguments]``, run by ``sanitized.guided``:
- ``metadata``: ``_metadata.entries`` on the input;
- ``opscan``: ``_opscan.clean`` on the input;
- ``table``: the input as the ``.metadata`` of a copy of the checkpoint folder TEMPLATE,
  opened with the native code and without it (``_table.c`` runs on what ``_metadata.c``
  decoded): a difference raises, so libFuzzer reports it as a crash.
Half the mutations are tests/native/mutate.py's structure-aware ones (memo indices, counts
at capacity boundaries, FRAME lengths, nesting), half libFuzzer's own.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path

import atheris

ROOT = Path(__file__).parents[2]
sys.path.append(str(ROOT))  # tests.*; inspector comes first from PYTHONPATH (the build's)

from inspector.formats.safe_pickle import direct, prescan  # noqa: E402
from tests.native import drive, mutate  # noqa: E402

TARGETS = ("metadata", "opscan", "table")


def _sizes(names: set[str]) -> dict[str, int]:
    return dict.fromkeys(names, 1 << 40)


def target(name: str, template: Path) -> Callable[[bytes], None]:
    """The function libFuzzer calls with each input, for entry ``name``."""
    if name == "metadata":
        consts = direct._consts()
        return lambda data: drive.NATIVE[0].entries(data, _sizes, consts)
    if name == "opscan":
        return lambda data: drive.NATIVE[2](data, 0, len(data), prescan._OPSCAN_TABLE)
    work = template.parent.parent / "guided-mutants"

    def table(data: bytes) -> None:
        if drive.differs(mutate.place(template, work, data)):
            raise AssertionError(f"native and Python differ on {data.hex()}")

    return table


def mutator(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    found = mutate.mutant(data, rng) if rng.random() < 0.5 else atheris.Mutate(data, max_size)
    return found[:max_size]


def main(argv: list[str]) -> None:
    drive.check_build()
    one = target(argv[1], Path(argv[2]))
    atheris.Setup([argv[0], *argv[3:]], one, custom_mutator=mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
