"""``ckpt-inspect ls`` of a torchtitan checkpoint against a bare ``python -c "import torch"``.

Listing needs no tensor, so the command must not pay for importing torch. Builds the demo
checkpoints (2 gloo ranks, FSDP2, AdamW state; ``fp8/`` holds torchao wrappers, which
``ls`` detects from each chunk's pickle), then times, interleaved, fresh processes of
``python -c "import torch"`` and ``python -m inspector ls PATH`` (scan included).
Goal: ls <= 0.25 x import torch.  Run: ``.venv/bin/python benchmarks/cli_ls.py``.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from inspector.demo import build_demo

GOAL = 0.25


def wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(rounds: int = 7) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        build_demo(Path(tmp))
        commands = {
            "import torch": [sys.executable, "-c", "import torch"],
            **{
                f"ls {name}/": [sys.executable, "-m", "inspector", "ls", str(Path(tmp) / name)]
                for name in ("flat", "fp8")
            },
        }
        times: dict[str, list[float]] = {label: [] for label in commands}
        for argv in commands.values():
            wall(argv)  # warm the page cache once
        for _ in range(rounds):
            for label, argv in commands.items():
                times[label].append(wall(argv))
    base = statistics.median(times["import torch"])
    worst = 0.0
    for label, values in times.items():
        median = statistics.median(values)
        ratio = median / base
        worst = max(worst, ratio) if label != "import torch" else worst
        print(
            f"{label:14s} {median:.3f} s (median of {rounds}; {min(values):.3f}-"
            f"{max(values):.3f})  {ratio:.2f}x import torch"
        )
    verdict = "PASS" if worst <= GOAL else "MISS"
    print(f"worst ls / import torch: {worst:.2f}  goal <= {GOAL}  {verdict}")
    return worst


if __name__ == "__main__":
    sys.exit(0 if main() <= GOAL else 1)
