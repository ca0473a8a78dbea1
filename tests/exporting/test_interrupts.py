"""Ctrl-C (a real SIGINT) during a real export of a big DCP checkpoint, in a child process:
the export stops within about a second (not when the export is done), raises
KeyboardInterrupt, leaves nothing in the target folder and the source as it was.

Each tensor is bigger than a copy step (64 MiB), so a stop that waits for the tensor in hand
(or for the rest of the export) is measured as too slow."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import save_dcp

TENSORS, NUMEL = 3, 20 << 20  # float32: three 80 MiB tensors, 240 MiB in all
LATEST_STOP = 1.0  # seconds from the signal to the KeyboardInterrupt out of export()
LATEST_EXIT = 10.0  # ... to the child's exit (a busy machine takes seconds to unload torch)

CHILD = """
import sys, time
import inspector

def progress(done):
    print("progress", flush=True)
    time.sleep(0.5)  # the parent's Ctrl-C lands while the export is under way, however fast

try:
    inspector.export(sys.argv[1], sys.argv[2], format=sys.argv[3], workers=int(sys.argv[4]),
                     progress=False, on_progress=progress)
except KeyboardInterrupt:
    print("interrupted at", time.monotonic(), flush=True)
    raise
print("finished", flush=True)
"""


def digests(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by name: its SHA-256."""
    found = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        with path.open("rb") as f:
            found[path.name] = hashlib.file_digest(f, "sha256").hexdigest()
    return found


@pytest.fixture(scope="module")
def big_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    state = {"model": {f"layers.{i}.weight": torch.full((NUMEL,), i + 0.5) for i in range(TENSORS)}}
    return save_dcp(state, tmp_path_factory.mktemp("big") / "step-1")


@pytest.mark.parametrize(
    ("fmt", "target", "workers"),
    [("pt", "model.pt", 1), ("safetensors", "model", 1), ("pt", "model.pt", 2),
     ("safetensors", "model", 2)],
)
def test_ctrl_c_stops_an_export_within_a_second(
    big_dcp: Path, tmp_path: Path, fmt: str, target: str, workers: int
) -> None:
    before = digests(big_dcp)
    script, folder = tmp_path / "child.py", tmp_path / "out"
    script.write_text(CHILD)
    folder.mkdir()
    child = subprocess.Popen(
        [sys.executable, str(script), str(big_dcp), str(folder / target), fmt, str(workers)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert child.stdout is not None
    first = child.stdout.readline()  # the first tensor is written: the export is under way
    child.send_signal(signal.SIGINT)
    sent = time.monotonic()
    out, err = child.communicate(timeout=60)
    exited = time.monotonic() - sent
    assert first == "progress\n", err
    assert child.returncode == -signal.SIGINT and "KeyboardInterrupt" in err, err
    stopped = float(out.split("interrupted at ")[1]) - sent
    assert "finished" not in out and stopped < LATEST_STOP, f"stopped {stopped:.2f} s after Ctrl-C"
    assert exited < LATEST_EXIT
    assert list(folder.iterdir()) == []  # no temp file, no partial output
    assert digests(big_dcp) == before
