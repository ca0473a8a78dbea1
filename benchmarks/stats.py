"""The app's Stats against the reads it needs: a 16M-element bf16 weight and its norms per layer.

A DCP checkpoint of 18 layers, each one 4096x4096 bf16 weight (576 MiB), saved by torch's
DCP. The anchor is the least the Stats panel can cost: ``ck.read`` of the weight plus torch's
reductions on it (min, max, mean, std, NaN/Inf/zero counts, a 64-bin ``histc``), then
``ck.read`` of every layer's weight and its L2 norm. Measured against it, in interleaved
rounds from the page cache: the panel's core (``tensor_numbers``), with the time until its
numbers exist. Goals: first numbers <= 0.5 s; everything <= 1.5x the anchor (median).
Run: ``.venv/bin/python benchmarks/stats.py``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import inspector
from inspector.ui.views.numbers import tensor_numbers

LAYERS = 18
SHAPE = (4096, 4096)
RUNS = 3
FIRST_GOAL = 0.5
ALL_GOAL = 1.5
KEY = "layers.0.attention.wq.weight"


def build(folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    generator = torch.Generator().manual_seed(0)
    state = {
        f"layers.{i}.attention.wq.weight": (torch.randn(SHAPE, generator=generator) * 0.02).to(
            torch.bfloat16
        )
        for i in range(LAYERS)
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)


def anchor(ck: inspector.Checkpoint) -> float:
    start = time.perf_counter()
    values = ck.read(KEY).float()
    finite = values[torch.isfinite(values)]
    low, high = float(finite.min()), float(finite.max())
    _ = (finite.mean(), finite.std(), values.isnan().sum(), values.isinf().sum())
    _ = ((values == 0).sum(), torch.histc(finite, 64, low, high))
    for i in range(LAYERS):
        torch.linalg.vector_norm(ck.read(f"layers.{i}.attention.wq.weight").float())
    return time.perf_counter() - start


def panel(ck: inspector.Checkpoint) -> tuple[float, float]:
    """Seconds until the numbers exist, and until everything does."""
    start = time.perf_counter()
    first: list[float] = []

    def on_part(numbers: object) -> None:
        if not first:
            first.append(time.perf_counter() - start)

    tensor_numbers(ck, KEY, lambda *_: None, threading.Event(), on_part=on_part)
    return first[0], time.perf_counter() - start


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(folder)
        ck = inspector.open(folder)
        anchor(ck)  # into the page cache
        anchors, firsts, wholes = [], [], []
        for _ in range(RUNS):
            anchors.append(anchor(ck))
            first, whole = panel(ck)
            firsts.append(first)
            wholes.append(whole)
    ratio = statistics.median(w / a for w, a in zip(wholes, anchors, strict=True))
    first = statistics.median(firsts)
    print(f"anchor (read + torch): {min(anchors):.2f}-{max(anchors):.2f} s")
    print(f"Stats first numbers:   {min(firsts):.2f}-{max(firsts):.2f} s "
          f"(goal <= {FIRST_GOAL} s): {'PASS' if first <= FIRST_GOAL else 'MISS'}")
    print(f"Stats everything:      {min(wholes):.2f}-{max(wholes):.2f} s, "
          f"median {ratio:.2f}x the anchor (goal <= {ALL_GOAL}x): "
          f"{'PASS' if ratio <= ALL_GOAL else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
