"""Export a ~1.3 GB DCP checkpoint: time and peak memory against torch and a plain copy.

The checkpoint is fp32, 2048-wide Llama-like layers, saved by two gloo ranks (row
shards in ``__0_0.distcp`` / ``__1_0.distcp``). Each row runs in a fresh process, after
``sync`` (no run pays for the previous one's dirty pages), rounds interleaved: bare
``import torch`` and ``import inspector``; a plain copy of the same bytes
(``shutil.copytree`` + fsync, since exports fsync too); torch's ``dcp_to_torch_save``;
``inspector.export`` to safetensors and to .pt, without and with verification.
"work" is a row's wall time less the bare import of what it imported (torch, or only
inspector: plain safetensors exports never import torch).
Goals (judged on the median over rounds; ranges printed):
- verified exports (the default): work <= 1.5 x copy, safetensors and .pt;
- .pt without verification: work <= 1.2 x copy;
- the default export (safetensors, verified): wall <= 0.5 x ``dcp_to_torch_save``'s wall;
- every export: peak RSS <= its bare import's peak + 2 x largest tensor + 100 MiB.
Run: ``.venv/bin/python benchmarks/export.py [rounds]`` (default 3; exit 0 when all met).
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

COPY = """
import os, shutil, sys
shutil.copytree(sys.argv[2], sys.argv[3])
for p in os.scandir(sys.argv[3]):
    with open(p.path, "rb") as f:
        os.fsync(f.fileno())
"""
TORCH = """
import sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[2], sys.argv[3])
"""
OURS = """
import sys, inspector
r = inspector.export(sys.argv[2], sys.argv[3], format=sys.argv[4], progress=False,
                     verify=sys.argv[5] == "verify")
assert r.tensors == int(sys.argv[6]), r.summary()
assert r.verification is None or r.verification.ok, r.verification
"""
EXPORTS = [(fmt, mode) for fmt in ("safetensors", "pt") for mode in ("no-verify", "verify")]
MIB = 2**20


def measured(snippet: str, *args: str) -> dict[str, float]:
    os.sync()
    return measure(snippet, *args)


def one_round(src: Path, tmp: str, n: int, tensors: int) -> dict[str, dict[str, float]]:
    rows = {
        "bare import torch": measured("import torch"),
        "bare import inspector": measured("import inspector"),
        "plain copy + fsync": measured(COPY, str(src), f"{tmp}/copy{n}"),
        "torch dcp_to_torch_save": measured(TORCH, str(src), f"{tmp}/torch{n}.pt"),
    }
    for fmt, mode in EXPORTS:
        out = f"{tmp}/st-{mode}{n}" if fmt == "safetensors" else f"{tmp}/ours-{mode}{n}.pt"
        rows[f"export {fmt} ({mode})"] = measured(OURS, str(src), out, fmt, mode, str(tensors))
    return rows


def work(rows: dict[str, dict[str, float]], name: str) -> float:
    """Wall time less the bare import of what the row imported."""
    bare = rows["bare import torch" if rows[name]["torch"] else "bare import inspector"]
    return rows[name]["wall"] - bare["wall"]


def main(rounds: int = 3) -> int:
    shapes = tensor_shapes(layers=5)
    largest = max(r * c * 4 for r, c in shapes.values())
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        src = build(Path(tmp) / "ckpt", shapes, ranks=2)
        size = folder_bytes(src)
        print(f"checkpoint: {size / 1e9:.2f} GB, {len(shapes)} tensors, largest {mib(largest)}")
        print(f"load average before: {os.getloadavg()[0]:.2f}")
        for n in range(rounds):
            runs.append(one_round(src, tmp, n, len(shapes)))
            for made in Path(tmp).iterdir():  # keep the disk's page cache for the source
                if made != src:
                    shutil.rmtree(made) if made.is_dir() else made.unlink()
        print(f"load average after: {os.getloadavg()[0]:.2f}\n")
    print(f"{'':30s} {'wall s':>13s} {'work / copy':>13s} {'peak RSS MiB':>13s} torch")
    for name in runs[0]:
        walls = [r[name]["wall"] for r in runs]
        ratios = [work(r, name) / r["plain copy + fsync"]["wall"] for r in runs]
        peaks = [r[name]["peak"] / MIB for r in runs]
        print(
            f"{name:30s} {spread(walls, 2):>13s} {spread(ratios, 2):>13s} "
            f"{spread(peaks, 0):>13s} {'yes' if runs[0][name]['torch'] else 'no'}"
        )
    print()
    ok = True
    for fmt, mode in EXPORTS:
        name = f"export {fmt} ({mode})"
        limit = 1.5 if mode == "verify" else 1.2 if fmt == "pt" else None
        ratios = [work(r, name) / r["plain copy + fsync"]["wall"] for r in runs]
        if limit is not None:
            ok &= goal_line(f"{name}: work <= {limit} x copy", ratios, limit)
        budgets = [
            r[name]["peak"]
            - r["bare import torch" if r[name]["torch"] else "bare import inspector"]["peak"]
            for r in runs
        ]
        budget = (2 * largest + 100 * MIB) / MIB
        ok &= goal_line(
            f"{name}: peak - bare import <= 2 x largest + 100 MiB ({budget:.0f} MiB)",
            [b / MIB for b in budgets],
            budget,
        )
    default = "export safetensors (verify)"
    ratios = [r[default]["wall"] / r["torch dcp_to_torch_save"]["wall"] for r in runs]
    ok &= goal_line("default export wall <= 0.5 x dcp_to_torch_save wall", ratios, 0.5)
    print("all goals met" if ok else "GOALS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3))
