"""Scale-out export: 1 vs 2 worker processes on a cast-to-bfloat16 safetensors export.

The checkpoint is fp32 (~660 MB, 2048-wide Llama-like layers), saved by torch's DCP save
from one process. Each row runs in a fresh process after ``sync``, rounds interleaved:
``inspector.export(..., dtype="bfloat16", workers=N)`` (verified, one ``model.safetensors``
whose tensors the workers write at their offsets; and HF shards of 200 MB, dealt whole).
Peak RSS is each process's own VmHWM: the parent's, and every worker's, sampled from
``/proc`` while the export runs (the largest worker is shown).
Goals (median over rounds): 2 workers' wall <= 0.8 x 1 worker's, both layouts; every
worker's peak <= bare ``import torch`` + 2 x the largest tensor + 100 MiB.
Run: ``.venv/bin/python benchmarks/parallel.py [rounds] [layers]`` (default 3 rounds of
2 layers, 667 MB; 6 layers: 1.48 GB; exit 0 when all met).
The machine's cores are shared with whatever else runs: the load average is printed.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peak import goal_line, measure, mib, spread
from synthetic import build, folder_bytes, tensor_shapes

EXPORT = """
import json, os, re, sys, threading, time
import inspector

def hwm(pid):
    try:
        text = open(f"/proc/{pid}/status").read()
    except OSError:
        return None
    found = re.search(r"VmHWM:\\s+(\\d+) kB", text)
    return int(found.group(1)) * 1024 if found else None

peaks, running = {}, True

def sample():
    # peaks of every process below this one (workers are the forkserver's children)
    me = str(os.getpid())
    while running:
        parents = {}
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    ppid = re.search(r"PPid:\\s+(\\d+)", open(f"/proc/{pid}/status").read())
                except OSError:
                    continue
                if ppid:
                    parents[pid] = ppid.group(1)
        for pid in parents:
            up = parents.get(pid)
            while up is not None and up != me:
                up = parents.get(up)
            if up == me and (value := hwm(pid)):
                peaks[pid] = max(peaks.get(pid, 0), value)
        time.sleep(0.05)

if __name__ == "__main__":
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    r = inspector.export(sys.argv[2], sys.argv[3], dtype="bfloat16", progress=False,
                         workers=int(sys.argv[4]), max_shard_size=sys.argv[5])
    running = False
    thread.join()
    assert r.verification.ok and r.tensors == int(sys.argv[6]), r.summary()
    print("@@workers " + json.dumps(sorted(peaks.values())), file=sys.stderr)
"""
LAYOUTS = {"one file": "5GB", "200MB shards": "200MB"}
MIB = 2**20


def one_round(src: Path, tmp: str, n: int, tensors: int) -> dict[str, dict]:
    rows: dict[str, dict] = {"bare import torch": measure("import torch")}
    for layout, limit in LAYOUTS.items():
        for workers in (1, 2):
            os.sync()
            out = f"{tmp}/out-{n}-{workers}-{limit}"
            rows[f"{layout}, workers={workers}"] = _measured(
                str(src), out, str(workers), limit, str(tensors)
            )
    return rows


def _measured(*args: str) -> dict:
    """``measure`` of the export, plus the workers' peaks (which it prints on stderr)."""
    import json
    import subprocess

    from peak import _WRAPPER

    done = subprocess.run(
        [sys.executable, "-c", _WRAPPER, EXPORT, *args], capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-4000:])
    row = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("@@"))[2:])
    found = next(x for x in done.stderr.splitlines() if x.startswith("@@workers "))
    row["workers"] = json.loads(found.split(" ", 1)[1])
    return row


def main(rounds: int = 3, layers: int = 2) -> int:
    shapes = tensor_shapes(layers=layers)
    largest = max(r * c * 4 for r, c in shapes.values())
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        src = build(Path(tmp) / "ckpt", shapes, ranks=1)
        size = folder_bytes(src)
        print(f"checkpoint: {size / 1e6:,.0f} MB fp32, {len(shapes)} tensors, "
              f"largest {mib(largest)}; cores {os.cpu_count()}")
        print(f"load average before: {os.getloadavg()[0]:.2f}")
        for n in range(rounds):
            runs.append(one_round(src, tmp, n, len(shapes)))
            for made in Path(tmp).iterdir():
                if made != src:
                    shutil.rmtree(made) if made.is_dir() else made.unlink()
        print(f"load average after: {os.getloadavg()[0]:.2f}\n")
    print(f"{'':28s} {'wall s':>12s} {'parent MiB':>12s} {'worker MiB (max)':>17s}")
    for name in runs[0]:
        walls = [r[name]["wall"] for r in runs]
        parents = [r[name]["peak"] / MIB for r in runs]
        workers = [max(r[name].get("workers") or [0]) / MIB for r in runs]
        shown = spread(workers, 0) if any(workers) else "-"
        print(f"{name:28s} {spread(walls):>12s} {spread(parents, 0):>12s} {shown:>17s}")
    print()
    ok = True
    for layout in LAYOUTS:
        ratios = [r[f"{layout}, workers=2"]["wall"] / r[f"{layout}, workers=1"]["wall"]
                  for r in runs]
        ok &= goal_line(f"{layout}: 2 workers' wall <= 0.8 x 1 worker's", ratios, 0.8)
        budget = 2 * largest + 100 * MIB
        over = [max(r[f"{layout}, workers=2"]["workers"]) - r["bare import torch"]["peak"]
                for r in runs]
        ok &= goal_line(
            f"{layout}: worker peak - bare import torch <= 2 x largest + 100 MiB "
            f"({budget / MIB:.0f} MiB)", [o / MIB for o in over], budget / MIB,
        )
    print("all goals met" if ok else "GOALS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:3])))
