"""paused_gc: no collection inside; what it built lands in the oldest generation."""

from __future__ import annotations

import gc

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
