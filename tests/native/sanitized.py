"""The C extensions built with AddressSanitizer and UndefinedBehaviorSanitizer, and a Python
process that runs them (tests/native/drive.py).

``build(dest)`` copies the ``inspector`` package to ``dest`` and compiles the
extensions into it with ``-fsanitize=address,undefined -fno-sanitize-recover=all`` and
``-DINSPECTOR_NATIVE_STRICT`` (an index out of range aborts instead of declining);
``drive(dest, ...)`` runs drive.py with that copy first on the path, ASan's runtime
preloaded (the interpreter itself is not instrumented) and ``PYTHONMALLOC=malloc`` (so that
every PyMem block is one ASan watches). gcc ships libasan and libubsan: nothing else to
install. ``python -m tests.native.sanitized CORPUS SECONDS`` is ``make fuzz``'s long run.
"""

from __future__ import annotations

import importlib.util
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
    "inspector/analysis/_health.c",
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
# The coverage-guided build (tests/native/guided.py): clang's libFuzzer edge counters too.
GUIDED_FLAGS = ("-fsanitize=fuzzer-no-link,address,undefined", *FLAGS[1:])


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


def compile_one(source: Path, out: Path, flags: tuple[str, ...] = FLAGS, cc: str = "") -> None:
    include = sysconfig.get_paths()["include"]
    subprocess.run(
        [cc or compiler(), *flags, f"-I{include}", str(source), "-o", str(out)],
        check=True,
        capture_output=True,
        text=True,
    )


def build(
    dest: Path,
    sources: dict[str, Path] | None = None,
    flags: tuple[str, ...] = FLAGS,
    cc: str = "",
) -> Path:
    """The inspector package, with sanitized extensions, under ``dest``; ``sources`` replaces
    the C file of an extension (by its path in EXTENSIONS); ``flags``/``cc``: GUIDED_FLAGS
    and clang for the coverage-guided build."""
    shutil.copytree(
        ROOT / "inspector", dest / "inspector", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for name in EXTENSIONS:
        source = (sources or {}).get(name, ROOT / name)
        compile_one(source, dest / (name.removesuffix(".c") + suffix), flags, cc)
    return dest


def environment(dest: Path, preload: str = "") -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(dest), str(ROOT)]),
        LD_PRELOAD=preload or runtime(),
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


def fuzzer_runtime() -> str:
    """atheris's ASan runtime with libFuzzer in it, preloaded for native-extension fuzzing."""
    spec = importlib.util.find_spec("atheris")
    if spec is None or spec.origin is None:
        raise RuntimeError("atheris is not installed")
    found = Path(spec.origin).parents[1] / "asan_with_fuzzer.so"
    if not found.is_file():
        raise RuntimeError(f"atheris has no {found.name}")
    return str(found)


def guided(
    dest: Path, target: str, template: Path, seeds: Path, seconds: float
) -> subprocess.CompletedProcess[str]:
    """tests/native/guided.py's ``target`` for ``seconds`` under the clang build in ``dest``;
    the corpus it grows goes to ``dest/guided-<target>`` (``seeds`` stays as it is),
    a crashing input to ``dest/crash-*``, libFuzzer's log to ``dest/guided-<target>.log``."""
    grown = dest / f"guided-{target}"
    grown.mkdir(exist_ok=True)
    args = [f"-max_total_time={int(seconds)}", "-max_len=20000", "-detect_leaks=0"]
    args += ["-print_final_stats=1", f"-artifact_prefix={dest}/", str(grown), str(seeds)]
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests/native/guided.py"), target, str(template), *args],
        env=environment(dest, fuzzer_runtime()),
        capture_output=True,
        text=True,
        timeout=seconds + 300,
        cwd=dest,
    )
    (dest / f"guided-{target}.log").write_text(done.stderr)
    return done
