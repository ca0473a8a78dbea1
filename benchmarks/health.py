"""Run health over 4 saved steps of a ~0.85 GB run against reading the same tensors once.

The run: TinyLlama widened to ~18 M parameters, trained 4 AdamW steps by the real loop in
:mod:`inspector.demo.run`, each step saved (model + flattened Adam state, ~213 MB, DCP).
The anchor is reading, once, every tensor health reads (each parameter and its exp_avg and
exp_avg_sq in every step) with ``ck.read``, the tool's reader (health itself reads plain local
tensors in blocks with ``readinto``, and the rest with ``ck.read``). Measured side by side in 3
interleaved rounds from the page cache (read once first); the goal is judged on the median
ratio: health within 1.2x of the anchor. Also printed: health with 2 workers (process start
included); health's reads alone (the same archive parse and block reads, no arithmetic: the
floor any health pass in one process stands on); health's C kernel alone on the same tensors
held in memory (the compute the goal would have to fit, with the parse and the reads, into 0.2x
of the anchor); reading the optimizer step counters and hyper-parameters health reads (step,
lr, betas, eps: small values per parameter and step, which the anchor does not read; read
together, identical stored bytes decoded once); reading the run's files with plain ``readinto``
(the disk anchor); and health's peak memory in a fresh process above what opening the run
takes, against the bound of two float32 copies of the largest parameter and the read blocks.
Run: ``.venv/bin/python benchmarks/health.py [RUN_DIR]``.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import inspector
from inspector.analysis import health_pass
from inspector.analysis.health import health
from inspector.demo.model import TinyLlamaConfig
from inspector.demo.run import RunPlan, build_run
from inspector.formats.base import bytes_view

GOAL = 1.2
RUNS = 3
PLAN = RunPlan(
    steps=4,
    save_every=1,
    config=TinyLlamaConfig(vocab_size=4096, dim=512, n_layers=4, n_heads=8, hidden_dim=1536),
    batch=(4, 32),
)
BLOCK = 1 << 22
BLOCK_BUFFERS = 4  # health's read, scratch and products buffers, and exp_avg_sq's alongside
SLACK = 1 << 20  # the allocator's rounding and the report's rows


def health_tensors(run: Path) -> Iterator[tuple[inspector.Checkpoint, str]]:
    """Each step's checkpoint with each tensor health reads in it: the parameters, exp_avg
    and exp_avg_sq."""
    for step in inspector.open(run).steps:
        ck = inspector.open(step.location)
        for entry in ck.entries():
            if entry.kind == "tensor" and (
                entry.component == "model" or entry.key.endswith(("exp_avg", "exp_avg_sq"))
            ):
                yield ck, entry.key


def read_once(run: Path) -> int:
    """Every tensor health reads, read once through ``ck.read``."""
    return sum(ck.read(key).numel() for ck, key in health_tensors(run))


def reads_alone(run: Path) -> int:
    """Every tensor health reads, parsed and read in blocks exactly as health reads it, with
    no number taken: health's floor."""
    workspace, total = health_pass.Workspace(), 0
    for ck, key in health_tensors(run):
        blocks = health_pass._Values.of(ck, key).blocks(health_pass.BLOCK, workspace, "x")
        total += sum(block.numel() for block in blocks)
    return total


def kernel_alone(run: Path) -> Callable[[], None]:
    """Health's per-block C calls over every tensor health reads, held in memory beforehand
    (read here, not timed; matrices taken as vectors, a little less work): the compute
    alone, which a goal of 1.2x the anchor would have to fit, with the per-tensor parse and
    the reads, in 0.2x of it."""
    kernel = health_pass._health
    assert kernel is not None, "the C kernel is not built"
    steps = [inspector.open(s.location) for s in inspector.open(run).steps]
    names = [e.key for e in steps[0].entries() if e.kind == "tensor" and e.component == "model"]
    held = [{n: [_floats(ck, k) for k in _with_moments(n)] for n in names} for ck in steps]
    largest = max(len(views[0]) // 4 for step in held for views in step.values())
    kept, update = (bytes_view(torch.zeros(largest)) for _ in range(2))

    def run_kernel() -> None:
        for name in names:
            for index, step in enumerate(held):
                w, m, v = step[name]
                mode = min(index, 2)  # nothing carried yet, the values before, and an update
                for start in range(0, len(w) // 4, health_pass.BLOCK):
                    at = slice(start * 4, (start + health_pass.BLOCK) * 4)
                    n = len(w[at]) // 4
                    kernel.weights(w[at], n, kept, update if mode else None, start, mode, 1,
                                   None, 0, None)  # fmt: skip
                    kernel.moments(m[at], v[at], n, 1e-8, True)

    return run_kernel


def _with_moments(name: str) -> tuple[str, str, str]:
    return name, f"optimizer.state.{name}.exp_avg", f"optimizer.state.{name}.exp_avg_sq"


def _floats(ck: inspector.Checkpoint, key: str) -> memoryview:
    return bytes_view(ck.read(key).float().reshape(-1))


def read_hyper(run: Path) -> int:
    """The optimizer step counters and hyper-parameters health reads, read together per step
    as health reads them (``ck.read_objects``)."""
    total = 0
    for step in inspector.open(run).steps:
        ck = inspector.open(step.location)
        small = [e.key for e in ck.entries() if e.key.endswith((".lr", ".betas", ".eps", ".step"))]
        total += len(ck.read_objects(small))
    return total


# In a fresh process: RSS once health ran once (modules imported, steps parsed), then the
# peak RSS (VmHWM, reset through clear_refs) of a second run (bytes).
MEMORY = """
import sys
from pathlib import Path
from inspector.analysis.health import health
def kib(field):
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(next(x for x in lines if x.startswith(field)).split()[1]) * 1024
health(sys.argv[1])
Path("/proc/self/clear_refs").write_text("5")
settled = kib("VmRSS:")
health(sys.argv[1])
print(settled, kib("VmHWM:"))
"""


def memory(run: Path) -> tuple[int, int]:
    """(RSS before a second health, peak RSS during it), in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", MEMORY, str(run)], capture_output=True, text=True, check=True
    )
    opened, after = out.stdout.split()
    return int(opened), int(after)


def read_files(run: Path) -> int:
    buffer = memoryview(bytearray(BLOCK))
    total = 0
    for path in sorted(run.rglob("*.distcp")):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total


def timed(fn: Callable[[], object], cpu: list[float]) -> float:
    """Wall seconds of ``fn()``; its CPU seconds in this process appended to ``cpu``."""
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    cpu.append(time.process_time() - start_cpu)
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
        "inspector.health(workers=2)": lambda: health(run, workers=2),
        "health's reads alone (no arithmetic)": lambda: reads_alone(run),
        "C kernel alone (data in memory)": kernel_alone(run),
        "read step/lr/betas/eps together": lambda: read_hyper(run),
        "read the files (readinto)": lambda: read_files(run),
    }
    times: dict[str, list[float]] = {name: [] for name in candidates}
    cpu: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(RUNS):
        for name, fn in candidates.items():
            times[name].append(timed(fn, cpu[name]))
    anchor = next(iter(candidates))
    for name, seconds in times.items():
        ratios = [s / a for s, a in zip(seconds, times[anchor], strict=True)]
        print(
            f"{name:37s} {statistics.median(seconds):7.2f} s "
            f"(range {min(seconds):.2f}-{max(seconds):.2f}), ratio {statistics.median(ratios):.2f}"
        )
    ratio = statistics.median(
        h / a for h, a in zip(times["inspector.health"], times[anchor], strict=True)
    )
    largest = max(
        e.numel * 4 for e in inspector.open(run).entries() if e.kind == "tensor" and e.numel
    )
    opened, after = memory(run)
    bound = 2 * largest + BLOCK_BUFFERS * health_pass.BLOCK * 4 + SLACK
    print(
        f"health's peak memory: {(after - opened) / 1e6:.1f} MB above its resting RSS "
        f"({opened / 1e6:.0f} MB); bound: 2 x the largest parameter as float32 + the block "
        f"buffers + 1 MiB = {bound / 1e6:.1f} MB: {'within' if after - opened <= bound else 'OVER'}"
    )
    on_cpu = statistics.median(
        h / a for h, a in zip(cpu["inspector.health"], cpu[anchor], strict=True)
    )
    print(f"health / anchor in CPU seconds (less sensitive to a shared machine): {on_cpu:.2f}")
    verdict = "PASS" if ratio <= GOAL else "MISS"
    print(f"health / anchor: ratio {ratio:.2f}, goal <= {GOAL}: {verdict}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(main(Path(sys.argv[1])))
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(main(Path(tmp) / "run"))
