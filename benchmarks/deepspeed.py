"""Open a DeepSpeed ZeRO-3 checkpoint and rebuild its fp32 master weights: inspector against
DeepSpeed's own ``zero_to_fp32``, same checkpoint, same run.

DeepSpeed is not a dependency of the project: pass the generator's virtualenv (see
``tests/fixtures/deepspeed/generate.py``), which writes the checkpoint (a real 2-rank ZeRO-3
run on CPU, >= 500 MB) into a temporary folder and runs DeepSpeed's side::

    .venv/bin/python benchmarks/deepspeed.py --venv /work/genv/deepspeed [--rounds 3]

Two tasks, each in a fresh interpreter (wall time including imports, and peak RSS):

- rebuild: ``inspector.open(run)`` then ``ck.read`` of every model weight, one at a time,
  against ``get_fp32_state_dict_from_zero_checkpoint(run)`` (what zero_to_fp32 returns);
- export: ``inspector.export(run, out)`` against
  ``convert_zero_checkpoint_to_state_dict(run, out, safe_serialization=True)``; both write
  one safetensors file, and the two files are compared tensor by tensor.

Goals: time <= 1x DeepSpeed's, peak RSS <= 0.5x (DeepSpeed loads every partition whole).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak import goal_line, measure, mib, spread

ROOT = Path(__file__).resolve().parents[1]
GENERATE = ROOT / "tests" / "fixtures" / "deepspeed" / "generate.py"
MIN_BYTES = 500 * 10**6

OURS_REBUILD = """
import sys, inspector
imported()
ck = inspector.open(sys.argv[2])
for key in ck.keys():
    if ck.entry(key).component == "model":
        ck.read(key)
"""
THEIRS_REBUILD = """
import os, sys
os.environ["DS_ACCELERATOR"] = "cpu"
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
imported()
state = get_fp32_state_dict_from_zero_checkpoint(sys.argv[2])
"""
OURS_EXPORT = """
import sys, inspector
imported()
inspector.export(sys.argv[2], sys.argv[3], format="safetensors", overwrite=True)
"""
THEIRS_EXPORT = """
import os, sys
os.environ["DS_ACCELERATOR"] = "cpu"
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict
imported()
convert_zero_checkpoint_to_state_dict(sys.argv[2], sys.argv[3], safe_serialization=True,
                                      max_shard_size=None)
"""


def _generate(python: str, run: Path, hidden: int) -> int:
    subprocess.run(
        [python, str(GENERATE), "--big", str(run), "--hidden", str(hidden)],
        check=True,
        capture_output=True,
    )
    return sum(p.stat().st_size for p in run.rglob("*.pt"))


def _same(a: Path, b: Path) -> bool:
    """Whether two safetensors files hold the same names, dtypes and bytes."""
    import torch
    from safetensors.torch import load_file

    ours, theirs = load_file(str(a)), load_file(str(b))
    return ours.keys() == theirs.keys() and all(
        ours[k].dtype == theirs[k].dtype
        and ours[k].reshape(-1).view(torch.uint8).equal(theirs[k].reshape(-1).view(torch.uint8))
        for k in ours
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, required=True, help="the generator's virtualenv")
    parser.add_argument("--hidden", type=int, default=1280)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    python = str(args.venv / "bin" / "python")
    work = Path(tempfile.mkdtemp(prefix="ds-bench-"))
    try:
        run = work / "run"
        size = _generate(python, run, args.hidden)
        print(f"ZeRO-3 checkpoint, 2 ranks: {size / 1e6:,.0f} MB of .pt files")
        if size < MIN_BYTES:
            raise SystemExit(f"only {size / 1e6:.0f} MB: pass a larger --hidden")
        for p in run.rglob("*.pt"):  # the page cache holds the files for both sides alike
            p.read_bytes()
        ok = True
        for task, ours, theirs in (
            ("rebuild", OURS_REBUILD, THEIRS_REBUILD),
            ("export", OURS_EXPORT, THEIRS_EXPORT),
        ):
            times, peaks = [], []
            for i in range(args.rounds):
                out_ours, out_theirs = work / f"ours{i}", work / f"theirs{i}"
                a = measure(ours, str(run), str(out_ours / "model.safetensors"))
                b = measure(theirs, str(run), str(out_theirs), python=python)
                times.append(a["wall"] / b["wall"])
                peaks.append(a["peak"] / b["peak"])
                print(
                    f"{task} round {i + 1}: inspector {a['wall']:.2f} s {mib(a['peak'])}, "
                    f"DeepSpeed {b['wall']:.2f} s {mib(b['peak'])}"
                )
                if task == "export":
                    same = _same(out_ours / "model.safetensors", out_theirs / "model.safetensors")
                    print(f"  exports equal bit for bit: {same}")
                    ok &= same
            print(f"{task}: time ratio {spread(times)}, peak RSS ratio {spread(peaks)}")
            ok &= goal_line(f"{task} time <= 1.0 x DeepSpeed's", times, 1.0)
            ok &= goal_line(f"{task} peak RSS <= 0.5 x DeepSpeed's", peaks, 0.5)
        print("all goals met" if ok else "GOALS MISSED")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
