"""Export a ~1.3 GB DCP checkpoint: time and peak memory against torch and a plain copy.

The checkpoint is fp32, 2048-wide Llama-like layers, saved by two gloo ranks (row
shards in ``__0_0.distcp`` / ``__1_0.distcp``). Measured in one run, each in a fresh
process: bare ``import torch``; a plain copy of the same bytes (``shutil.copytree`` +
fsync, since exports fsync too); torch's ``dcp_to_torch_save``; ``inspector.export`` to
safetensors and to .pt, without and with verification (which re-reads everything).
Goals: export wall - bare import wall <= 2 x copy wall; export peak RSS <= bare import
peak + 2 x largest tensor + 100 MiB. Each run starts after ``sync``, so no run pays for
the previous one's dirty pages. Run: ``.venv/bin/python benchmarks/export.py``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peak import measure, mib
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
"""


def measured(snippet: str, *args: str) -> dict[str, float]:
    os.sync()
    return measure(snippet, *args)


def main() -> int:
    shapes = tensor_shapes(layers=5)
    largest = max(r * c * 4 for r, c in shapes.values())
    with tempfile.TemporaryDirectory() as tmp:
        src = build(Path(tmp) / "ckpt", shapes, ranks=2)
        size = folder_bytes(src)
        print(f"checkpoint: {size / 1e9:.2f} GB, {len(shapes)} tensors, largest {mib(largest)}")
        bare = measured("import torch")
        rows = {
            "bare import torch": bare,
            "plain copy + fsync": measured(COPY, str(src), f"{tmp}/copy"),
            "torch dcp_to_torch_save": measured(TORCH, str(src), f"{tmp}/torch.pt"),
        }
        for fmt, out in (("safetensors", f"{tmp}/st"), ("pt", f"{tmp}/ours.pt")):
            for mode in ("no-verify", "verify"):
                target = (
                    f"{out}-{mode}" if fmt == "safetensors" else out.replace(".pt", f"-{mode}.pt")
                )
                rows[f"export {fmt} ({mode})"] = measured(
                    OURS, str(src), target, fmt, mode, str(len(shapes))
                )
    copy = rows["plain copy + fsync"]["wall"]
    budget = bare["peak"] + 2 * largest + 100 * 2**20
    print(f"{'':30s} {'wall s':>8s} {'(wall-bare)/copy':>17s} {'peak RSS':>10s}")
    ok = True
    for name, row in rows.items():
        ratio = (row["wall"] - bare["wall"]) / copy
        print(f"{name:30s} {row['wall']:8.2f} {ratio:17.2f} {mib(row['peak']):>10s}")
        if name.startswith("export"):
            ok &= row["peak"] <= budget
        if name.startswith("export") and "no-verify" in name:  # verify is a second full read
            ok &= ratio <= 2.0
    print(f"memory budget (bare + 2 x largest + 100 MiB): {mib(budget)}")
    print("goals met" if ok else "GOALS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
