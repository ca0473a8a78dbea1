"""CRC-32 digests: zip's CRC (zlib's), combinable, re-read from storage; file stamps."""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

from inspector.storage import LocalStorage
from inspector.storage.base import ByteRange
from inspector.storage.digest import crc32, crc32_combine, range_crc, ranges_crc, stamps


def test_crc32_is_zlibs_and_combines_like_concatenation() -> None:
    rng = random.Random(14)
    for _ in range(50):
        a = rng.randbytes(rng.randrange(0, 5000))
        b = rng.randbytes(rng.choice([0, 1, 7, 64, rng.randrange(0, 100_000)]))
        assert crc32(a) == zlib.crc32(a) and crc32(b, crc32(a)) == zlib.crc32(a + b)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    big = os.urandom(3 << 20)
    parts = [big[: 1 << 20], big[1 << 20 : 5 << 19], big[5 << 19 :]]
    value = 0
    for part in parts:
        value = crc32_combine(value, zlib.crc32(part), len(part))
    assert value == zlib.crc32(big)


def test_range_crc_reads_exactly_the_range(tmp_path: Path) -> None:
    data = os.urandom((9 << 20) + 12345)  # more than one read block
    (tmp_path / "f.bin").write_bytes(data)
    storage = LocalStorage(tmp_path)
    assert range_crc(ByteRange(storage, "f.bin", 0, len(data))) == zlib.crc32(data)
    assert range_crc(ByteRange(storage, "f.bin", 100, 0)) == 0
    pieces = [ByteRange(storage, "f.bin", 7, 1000), ByteRange(storage, "f.bin", 5 << 20, 4 << 20)]
    expected = zlib.crc32(data[5 << 20 : 9 << 20], zlib.crc32(data[7:1007]))
    assert ranges_crc(pieces) == expected


def test_stamps_change_when_a_byte_is_written(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 100)
    storage = LocalStorage(tmp_path)
    before = stamps(storage, ["a", "gone"])
    assert before["gone"] is None and before["a"][0] == 100
    assert stamps(storage, ["a", "gone"]) == before
    with open(tmp_path / "a", "r+b") as f:
        f.seek(50)
        f.write(b"y")
    after = stamps(storage, ["a"])
    assert after["a"] != before["a"] and after["a"][0] == 100
