"""Open a DeepSpeed ZeRO-3 checkpoint and rebuild its fp32 master weights: inspector against
DeepSpeed's own ``zero_to_fp32``, same checkpoint, same run.

DeepSpeed is not a dependency of the project: pass the generator's virtualenv (see
``tests/fixtures/deepspeed/generate.py``), which writes the checkpoint (a real 3-rank ZeRO-3
run on CPU, >= 500 MB) into a temporary folder (or use ``--run DIR``) and runs DeepSpeed's side::

    .venv/bin/python benchmarks/deepspeed.py --venv /work/genv/deepspeed [--rounds 3]

Two tasks, each in a fresh interpreter (time after the imports, and peak RSS):

- rebuild: ``inspector.open(run)`` then ``ck.read`` of every model weight, one at a time,
  against ``get_fp32_state_dict_from_zero_checkpoint(run)`` (what zero_to_fp32 returns);
- export: ``inspector.export(run, out)`` against
  ``convert_zero_checkpoint_to_state_dict(run, out)``, its pickle path (its safetensors path
  refuses a tied model in DeepSpeed 0.19.8: it passes shared tensors to ``save_file``); the
  two files are compared tensor by tensor.

Goals: time <= 1x DeepSpeed's, peak RSS <= 0.5x (DeepSpeed loads every partition whole).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak import goal_line, measure, mib, spread

ROOT = Path(__file__).resolve().parents[1]
GENERATE = ROOT / "tests" / "fixtures" / "deepspeed" / "generate.py"
MIN_BYTES = 500 * 10**6

# torch is imported before the clock starts on both sides (DeepSpeed imports it).
OURS_REBUILD = """
import sys, torch, inspector
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
import sys, torch, inspector
imported()
inspector.export(sys.argv[2], sys.argv[3], format="safetensors", overwrite=True)
"""
THEIRS_EXPORT = """
import os, sys
os.environ["DS_ACCELERATOR"] = "cpu"
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict
imported()
convert_zero_checkpoint_to_state_dict(sys.argv[2], sys.argv[3], safe_serialization=False,
                                      max_shard_size=None)
"""


def _generate(python: str, run: Path, hidden: int) -> None:
    subprocess.run(
        [python, str(GENERATE), "--big", str(run), "--hidden", str(hidden)],
        check=True,
        capture_output=True,
    )


def _same(a: Path, b: Path) -> bool:
    """Whether our safetensors file and DeepSpeed's torch.save file hold the same names,
    dtypes and bytes."""
    import torch
    from safetensors.torch import load_file

    ours, theirs = load_file(str(a)), torch.load(b, weights_only=True)
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
    parser.add_argument("--run", type=Path, help="an existing ZeRO-3 run folder to use")
    args = parser.parse_args()
    python = str(args.venv / "bin" / "python")
    work = Path(tempfile.mkdtemp(prefix="ds-bench-"))
    try:
        run = args.run or work / "run"
        if args.run is None:
            _generate(python, run, args.hidden)
        size = sum(p.stat().st_size for p in run.rglob("*.pt"))
        print(f"ZeRO-3 checkpoint, 3 ranks: {size / 1e6:,.0f} MB of .pt files")
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
                ours_run = partial(measure, ours, str(run), str(out_ours / "model.safetensors"))
                theirs_run = partial(measure, theirs, str(run), str(out_theirs), python=python)
                if i % 2:  # each side goes first in every other round (the cache is warmer after)
                    b, a = theirs_run(), ours_run()
                else:
                    a, b = ours_run(), theirs_run()
                times.append(a["work"] / b["work"])
                peaks.append(a["peak"] / b["peak"])
                print(
                    f"{task} round {i + 1}: inspector {a['work']:.2f} s ({a['wall']:.2f} s "
                    f"with imports) {mib(a['peak'])}, DeepSpeed {b['work']:.2f} s "
                    f"({b['wall']:.2f} s) {mib(b['peak'])}"
                )
                if task == "export":
                    same = _same(out_ours / "model.safetensors", out_theirs / "pytorch_model.bin")
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
