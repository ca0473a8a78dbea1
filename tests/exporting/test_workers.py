"""Worker processes started from a plain script: they do not re-run the caller's
``__main__``, and a worker's death is reported with its real cause."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import inspector
from inspector.errors import ExportError
from tests.exporting.test_parallel import tree_bytes

# No ``if __name__ == "__main__":`` guard: multiprocessing's workers would import this
# script as their main module and run its top level again.
UNGUARDED = """
import os, sys
import inspector
with open(sys.argv[3], "a") as runs:
    runs.write(f"{os.getpid()}\\n")
result = inspector.export(sys.argv[1], sys.argv[2], workers=2, progress=False,
                          max_shard_size="100KB")
print("verified", result.verification.ok)
"""


def test_workers_from_a_script_without_a_main_guard(demo_dir: Path, tmp_path: Path) -> None:
    script, runs = tmp_path / "export_script.py", tmp_path / "runs.txt"
    script.write_text(UNGUARDED)
    done = subprocess.run(
        [sys.executable, str(script), str(demo_dir / "flat"), str(tmp_path / "out"), str(runs)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["verified True"]
    assert len(runs.read_text().splitlines()) == 1  # the top level ran once, in the script
    one = inspector.export(demo_dir / "flat", tmp_path / "one", progress=False,
                           max_shard_size="100KB")
    assert one.verification.ok and tree_bytes(tmp_path / "out") == tree_bytes(tmp_path / "one")


def dies_in_a_worker(key: str) -> str:
    """A rename that kills the worker process calling it (the parent plans first, alive)."""
    if multiprocessing.parent_process() is not None:
        os.kill(os.getpid(), signal.SIGKILL)
    return key


def test_a_dead_worker_is_reported_with_its_signal(demo_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="a worker process died: killed by SIGKILL") as error:
        inspector.export(demo_dir / "flat", tmp_path / "out", workers=2, progress=False,
                         rename=dies_in_a_worker, max_shard_size="100KB")
    assert "memory" not in str(error.value)  # no OOM kill was counted
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
