"""Audit checksums and fingerprints of a ~660 MB DCP checkpoint against the physical anchor.

The anchor is what checking costs at the least: reading the checkpoint's files and
computing zlib's CRC-32 of every byte, in one process, in 4 MiB blocks (the fastest block
size on this project's machines). Measured side by side in 3 interleaved rounds (ranges shown;
ratios are to the anchor of the same round; the goal is judged on the median), all from
the page cache (the files are read once first): ``inspector.audit`` with checksums
(open, list every zip record, read and CRC each, completeness checks), the same without
checksums (its fixed cost), and ``inspector.fingerprint`` (BLAKE3 of every tensor's
bytes). Goal: each within 1.5x of the anchor. Also printed: raw throughput of zlib.crc32,
BLAKE3 and, when installed, xxHash's xxh3_128 over 64 MiB in memory (the hash choice).
Run: ``.venv/bin/python benchmarks/audit.py``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from synthetic import build, folder_bytes, tensor_shapes

import inspector

GOAL = 1.5
RUNS = 3
ANCHOR = "read + zlib.crc32 (anchor)"
GOALS = ("inspector.audit (checksums)", "inspector.fingerprint")
BLOCK = 1 << 22


def anchor(folder: Path) -> int:
    """Read every file of ``folder`` and CRC-32 its bytes: the least a check can cost."""
    buffer = memoryview(bytearray(BLOCK))
    crc = 0
    for path in sorted(folder.iterdir()):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                crc = zlib.crc32(buffer[:n], crc)
    return crc


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rounds(candidates: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
    """Each candidate timed once per round, RUNS rounds, interleaved: on a shared machine
    times measured next to each other are the comparable ones."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(RUNS):
        for name, fn in candidates.items():
            times[name].append(timed(fn))
    return times


def throughput() -> None:
    """GB/s of each candidate over 64 MiB in memory, fed in 4 MiB pieces."""
    import blake3

    data = memoryview(os.urandom(1 << 26))
    candidates: dict[str, Callable[[], object]] = {
        "zlib.crc32": lambda: [zlib.crc32(data[i : i + BLOCK]) for i in range(0, len(data), BLOCK)],
        "blake3": lambda: _feed(blake3.blake3(), data),
    }
    try:
        import xxhash

        candidates["xxh3_128"] = lambda: _feed(xxhash.xxh3_128(), data)
    except ImportError:
        pass
    for name, seconds in rounds(candidates).items():
        print(f"  {name:12s} {len(data) / min(seconds) / 1e9:5.2f} GB/s")


def _feed(hasher: object, data: memoryview) -> object:
    for i in range(0, len(data), BLOCK):
        hasher.update(data[i : i + BLOCK])  # type: ignore[attr-defined]
    return hasher.hexdigest()  # type: ignore[attr-defined]


def main() -> int:
    shapes = tensor_shapes(layers=2)
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp) / "ckpt", shapes, ranks=2)
        size = folder_bytes(path)
        print(f"checkpoint: {size / 1e6:,.0f} MB in 2 rank files, {len(shapes)} tensors")
        anchor(path)  # into the page cache
        report = inspector.audit(path)
        assert report.ok and report.checked and report.checked.verified, str(report)
        print(f"audit: {report.checked.text()}")
        rows = rounds(
            {
                ANCHOR: lambda: anchor(path),
                "inspector.audit (checksums)": lambda: inspector.audit(path),
                "inspector.audit (no checksums)": lambda: inspector.audit(path, checksums=False),
                "inspector.fingerprint": lambda: inspector.fingerprint(path),
            }
        )
    verdicts = []
    for name, times in rows.items():
        ratios = [t / a for t, a in zip(times, rows[ANCHOR], strict=True)]
        goal = ""
        if name in GOALS:
            passed = sorted(ratios)[len(ratios) // 2] <= GOAL
            verdicts.append(passed)
            goal = f"  goal <= {GOAL}: {'PASS' if passed else 'MISS'}"
        print(
            f"{name:32s} {min(times):6.3f}-{max(times):6.3f} s  "
            f"{min(ratios):.2f}-{max(ratios):.2f}x{goal}"
        )
    print("hash throughput in memory:")
    throughput()
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
