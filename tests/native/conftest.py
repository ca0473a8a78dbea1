"""The sanitized builds of the native extensions and the corpus their fuzzing starts from."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.hostile import damage, paths, pickles
from tests.native import boundaries, sanitized


@pytest.fixture(scope="session")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        sanitized.runtime()
    except (OSError, RuntimeError) as exc:  # make test installs gcc (.ci/run): never on CI
        pytest.skip(f"no compiler with AddressSanitizer: {exc}")
    return sanitized.build(tmp_path_factory.mktemp("sanitized"))


@pytest.fixture(scope="session")
def corpus(genuine, demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every DCP checkpoint the hostile corpus makes, and the genuine demo ones."""
    folder = tmp_path_factory.mktemp("native_corpus") / "corpus"
    folder.mkdir()
    for name in ("seed", "flat", "fp8"):
        if (demo_dir / name / ".metadata").exists():
            shutil.copytree(demo_dir / name, folder / f"genuine-{name}")
    work = tmp_path_factory.mktemp("hostile_cases")
    for family in (damage, paths, pickles):
        for name, generate in family.CASES.items():
            case = generate(genuine, work / name)
            if case.path.is_dir() and (case.path / ".metadata").is_file():
                shutil.copytree(case.path, folder / name, symlinks=True)
    return folder


@pytest.fixture(scope="session")
def guided_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The extensions built by clang with libFuzzer's coverage counters (tests/native/guided.py)."""
    missing = [name for name in ("clang",) if shutil.which(name) is None]
    try:
        sanitized.fuzzer_runtime()
    except RuntimeError as exc:
        missing.append(str(exc))
    if missing:  # `make fuzz` installs both (apt-get, pip); CI does not (see README)
        pytest.skip(f"coverage-guided fuzzing needs clang and atheris: missing {missing}")
    dest = tmp_path_factory.mktemp("guided")
    return sanitized.build(dest, flags=sanitized.GUIDED_FLAGS, cc="clang")


@pytest.fixture(scope="session")
def seeds(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every corpus ``.metadata``, issue 34's input and every 97th capacity-boundary input."""
    folder = tmp_path_factory.mktemp("guided_seeds")
    for meta in corpus.glob("*/.metadata"):
        shutil.copy(meta, folder / meta.parent.name)
    (folder / "issue-34").write_bytes(boundaries.issue_input())
    for k, (name, data) in enumerate(boundaries.inputs()):
        if k % 97 == 0:
            (folder / name).write_bytes(data)
    return folder
