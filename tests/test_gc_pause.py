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
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with paused_gc():
            _ = [[i] for i in range(1000)]
        assert gc.get_freeze_count() == frozen
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
