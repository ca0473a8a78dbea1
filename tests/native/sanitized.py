"""The C extensions built with AddressSanitizer and UndefinedBehaviorSanitizer, and a Python
process that runs them (tests/native/drive.py).

``build(dest)`` copies the ``inspector`` package to ``dest`` and compiles the three
extensions into it with ``-fsanitize=address,undefined -fno-sanitize-recover=all`` and
``-DINSPECTOR_NATIVE_STRICT`` (an index out of range aborts instead of declining);
``drive(dest, ...)`` runs drive.py with that copy first on the path, ASan's runtime
preloaded (the interpreter itself is not instrumented) and ``PYTHONMALLOC=malloc`` (so that
every PyMem block is one ASan watches). gcc ships libasan and libubsan: nothing else to
install. ``python -m tests.native.sanitized CORPUS SECONDS`` is ``make fuzz``'s long run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).parents[2]
EXTENSIONS = (
    "inspector/formats/safe_pickle/_metadata.c",
    "inspector/formats/safe_pickle/_opscan.c",
    "inspector/formats/dcp/_table.c",
)
FLAGS = (
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
    "-DINSPECTOR_NATIVE_STRICT",
    "-g",
    "-O1",
    "-shared",
    "-fPIC",
)


def compiler() -> str:
    return os.environ.get("CC", "gcc")


def runtime() -> str:
    """The ASan runtime the interpreter must load first (an absolute path)."""
    found = subprocess.run(
        [compiler(), "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if not os.path.isabs(found):
        raise RuntimeError(f"{compiler()} has no libasan.so (it answered {found!r})")
    return found


def compile_one(source: Path, out: Path) -> None:
    include = sysconfig.get_paths()["include"]
    subprocess.run(
        [compiler(), *FLAGS, f"-I{include}", str(source), "-o", str(out)],
        check=True,
        capture_output=True,
        text=True,
    )


def build(dest: Path, sources: dict[str, Path] | None = None) -> Path:
    """The inspector package, with sanitized extensions, under ``dest``; ``sources`` replaces
    the C file of an extension (by its path in EXTENSIONS)."""
    shutil.copytree(
        ROOT / "inspector", dest / "inspector", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for name in EXTENSIONS:
        source = (sources or {}).get(name, ROOT / name)
        compile_one(source, dest / (name.removesuffix(".c") + suffix))
    return dest


def environment(dest: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(dest), str(ROOT)]),
        LD_PRELOAD=runtime(),
        ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1",
        UBSAN_OPTIONS="print_stacktrace=1",
        PYTHONMALLOC="malloc",
        SANITIZED_BUILD=str(dest),
    )
    return env


def run(dest: Path, code: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -c code`` under the sanitized build."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=environment(dest),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=dest,
    )


def drive(dest: Path, corpus: Path, seconds: float, seed: int) -> subprocess.CompletedProcess[str]:
    """drive.py over ``corpus`` (see there) under the sanitized build."""
    return subprocess.run(
        [sys.executable, str(ROOT / "tests/native/drive.py"), str(corpus), str(seconds), str(seed)],
        env=environment(dest),
        capture_output=True,
        text=True,
        timeout=seconds + 300,
        cwd=dest,
    )
