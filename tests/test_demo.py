"""The demo build's quiet import of torchao (inspector/demo/__init__.py): `make demo` prints
no GPU-kernel load failures or torch deprecation notes from it."""

from __future__ import annotations

import subprocess
import sys


def _stderr(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    ).stderr


def test_torchao_imports_quietly_for_the_demo() -> None:
    # a plain `import torchao.float8` prints "Failed to load ..." per GPU kernel library and
    # torch's pytree deprecation note here (a CPU-only torch)
    assert _stderr("from inspector.demo import float8_training; float8_training()") == ""
