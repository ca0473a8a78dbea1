"""Run health over 4 saved steps of a ~0.85 GB run against reading the same tensors once.

The run: TinyLlama widened to ~18 M parameters, trained 4 AdamW steps by the real loop in
:mod:`inspector.demo.run`, each step saved (model + flattened Adam state, ~213 MB, DCP).
The anchor is reading, once, every tensor health reads (each parameter and its exp_avg and
exp_avg_sq in every step) with ``ck.read``, the same reader health uses. Measured side by
side in 3 interleaved rounds from the page cache (read once first); the goal is judged on
the median ratio: health within 1.2x of the anchor. Also printed: reading the run's files
with plain ``readinto`` (the disk anchor), the process's peak RSS and the largest tensor.
Run: ``.venv/bin/python benchmarks/health.py [RUN_DIR]``.
"""

from __future__ import annotations

import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import inspector
from inspector.analysis.health import health
from inspector.demo.model import TinyLlamaConfig
from inspector.demo.run import RunPlan, build_run

GOAL = 1.2
RUNS = 3
PLAN = RunPlan(
    steps=4,
    save_every=1,
    config=TinyLlamaConfig(vocab_size=4096, dim=512, n_layers=4, n_heads=8, hidden_dim=1536),
    batch=(4, 32),
)
BLOCK = 1 << 22


def read_once(run: Path) -> int:
    """Every tensor health reads, read once through ``ck.read``."""
    total = 0
    for step in inspector.open(run).steps:
        ck = inspector.open(step.location)
        for entry in ck.entries():
            if entry.kind == "tensor" and (
                entry.component == "model" or entry.key.endswith(("exp_avg", "exp_avg_sq"))
            ):
                total += ck.read(entry.key).numel()
    return total


def read_files(run: Path) -> int:
    buffer = memoryview(bytearray(BLOCK))
    total = 0
    for path in sorted(run.rglob("*.distcp")):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(run: Path) -> int:
    if not any(run.glob("step-*")):
        build_run(run, PLAN)
    size = sum(p.stat().st_size for p in run.rglob("*") if p.is_file())
    print(f"run: {run} ({size / 1e6:.0f} MB, {len(list(run.glob('step-*')))} steps)")
    read_files(run)  # into the page cache
    candidates = {
        "read each tensor once (anchor)": lambda: read_once(run),
        "inspector.health": lambda: health(run),
        "read the files (readinto)": lambda: read_files(run),
    }
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(RUNS):
        for name, fn in candidates.items():
            times[name].append(timed(fn))
    anchor = next(iter(candidates))
    for name, seconds in times.items():
        ratios = [s / a for s, a in zip(seconds, times[anchor], strict=True)]
        print(
            f"{name:34s} {statistics.median(seconds):7.2f} s "
            f"(range {min(seconds):.2f}-{max(seconds):.2f}), ratio {statistics.median(ratios):.2f}"
        )
    ratio = statistics.median(
        h / a for h, a in zip(times["inspector.health"], times[anchor], strict=True)
    )
    largest = max(e.nbytes for e in inspector.open(run).entries() if e.kind == "tensor")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"process peak RSS {peak / 1e6:.0f} MB; largest tensor {largest / 1e6:.0f} MB")
    verdict = "PASS" if ratio <= GOAL else "MISS"
    print(f"health / anchor: ratio {ratio:.2f}, goal <= {GOAL}: {verdict}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(main(Path(sys.argv[1])))
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(main(Path(tmp) / "run"))
