"""paused_gc: no collection inside; what it built lands in the oldest generation."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

from inspector.gc_pause import paused_gc


def test_objects_built_in_a_pause_skip_the_young_generations() -> None:
    gc.collect()
    with paused_gc():
        assert not gc.isenabled()
        built = [[i] for i in range(10_000)]
        assert gc.get_count()[0] >= 10_000
    assert gc.isenabled() and gc.get_count()[0] < 1000
    assert gc.is_tracked(built[0]) and gc.get_freeze_count() == 0


def test_a_programs_own_frozen_objects_stay_frozen() -> None:
    """Compared by identity, not by count: a frozen object may be freed meanwhile."""
    kept: list[list[int]] = [[1]]
    gc.collect()
    gc.freeze()
    try:
        with paused_gc():
            built = [[i] for i in range(1000)]
        assert gc.get_freeze_count() > 0
        tracked = {id(o) for o in gc.get_objects()}  # generations 0-2; frozen ones are not in them
        assert id(kept) not in tracked and id(kept[0]) not in tracked
        assert id(built) in tracked and id(built[0]) in tracked
    finally:
        gc.unfreeze()


def test_a_disabled_collector_stays_disabled() -> None:
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


_FIRST_USE = """
import gc, sys
import torch
import inspector
full = []
gc.callbacks.append(lambda phase, info: full.append(sys._getframe(1).f_code.co_filename)
                    if phase == "start" and info["generation"] == 2 else None)
inspector.export(sys.argv[1], sys.argv[2], format="pt", progress=False)
print(len(full), full)
"""


def test_first_use_loads_modules_without_a_full_collection(demo_dir: Path, tmp_path: Path) -> None:
    """With torch's objects in the heap, loading the checkpoint and export modules on first
    use set off a full collection (0.1-0.2 s rescanning torch's heap); they load paused."""
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_USE, str(demo_dir / "flat"), str(tmp_path / "out.pt")],
        capture_output=True, text=True, check=True, timeout=300,
    )
    assert done.stdout.split()[0] == "0", done.stdout
