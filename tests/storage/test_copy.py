"""Copies stop at the first check for a stop that raises: at most one step (64 MiB) of a big
range or buffer is written, and the checksum thread of the copy is not left running."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from inspector.storage.base import ByteRange
from inspector.storage.copy import STEP, copy_range, halting, write_all
from inspector.storage.local import LocalStorage


class Stop(Exception):
    pass


def stop_after(checks: int) -> tuple[list[int], Callable[[], None]]:
    calls: list[int] = []

    def check() -> None:
        calls.append(1)
        if len(calls) >= checks:
            raise Stop

    return calls, check


@pytest.mark.parametrize("crc", [None, 0])
def test_a_range_copy_stops_within_a_step(tmp_path: Path, crc: int | None) -> None:
    source = tmp_path / "big.bin"
    source.write_bytes(bytes(range(256)) * ((3 * STEP + 1000) // 256))
    calls, check = stop_after(1)
    whole = ByteRange(LocalStorage(tmp_path), "big.bin", 0, source.stat().st_size)
    with open(tmp_path / "out.bin", "wb", buffering=0) as f, halting(check), pytest.raises(Stop):
        copy_range(whole, f.fileno(), crc)
    assert calls == [1] and (tmp_path / "out.bin").stat().st_size == STEP
    assert [t for t in threading.enumerate() if t.daemon and t.is_alive()
            and type(t).__name__ == "_Checksum"] == []


def test_a_buffer_write_stops_within_a_step(tmp_path: Path) -> None:
    calls, check = stop_after(2)
    with open(tmp_path / "out.bin", "wb", buffering=0) as f, halting(check), pytest.raises(Stop):
        write_all(f.fileno(), bytearray(3 * STEP))
    assert calls == [1, 1] and os.path.getsize(tmp_path / "out.bin") == 2 * STEP


def test_without_a_stop_everything_is_written(tmp_path: Path) -> None:
    calls, check = stop_after(10)
    with open(tmp_path / "out.bin", "wb", buffering=0) as f, halting(check):
        write_all(f.fileno(), b"x" * (STEP + 5))
    assert len(calls) == 2 and (tmp_path / "out.bin").read_bytes() == b"x" * (STEP + 5)
