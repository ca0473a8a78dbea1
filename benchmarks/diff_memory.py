"""Peak memory of ``inspector.diff`` on two ~1 GB checkpoints, against the largest tensor.

A: saved by two gloo ranks (DTensor row shards); B: the same values saved by one rank
with one element perturbed. The diff streams one tensor pair at a time, so its peak
should sit near (bare import) + 2 x (largest tensor) and must not grow with the
checkpoint: the run is repeated at half the size to show that.
Run: ``.venv/bin/python benchmarks/diff_memory.py``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peak import goal_line, measure, mib
from synthetic import build, folder_bytes, tensor_shapes

PERTURBED = "layers.1.feed_forward.w2.weight"


def peak_of_diff(layers: int, tmp: Path) -> tuple[float, float, float, int]:
    """(checkpoint GB, opened-only peak, diff peak, largest tensor bytes) for ``layers`` layers."""
    shapes = tensor_shapes(layers=layers)
    a = build(tmp / f"a{layers}", shapes, ranks=2)
    b = build(tmp / f"b{layers}", shapes, ranks=1, perturb=PERTURBED)
    opened = measure(
        "import inspector, inspector.analysis.diff, pandas, tqdm\n"
        f"inspector.open({str(a)!r}), inspector.open({str(b)!r})\n"
    )
    run = measure(
        "import inspector\n"
        f"t = inspector.diff({str(a)!r}, {str(b)!r}, key_map=None, progress=False)\n"
        f"bad = t[~t.equal]\nassert bad.key.tolist() == [{PERTURBED!r}], bad\n"
        "assert int(bad.n_diff.iloc[0]) == 1\n"
    )
    largest = max(r * c * 4 for r, c in shapes.values())
    size = folder_bytes(a) / 1e9
    print(
        f"{size:.2f} GB vs {folder_bytes(b) / 1e9:.2f} GB: opened (metadata only) "
        f"{mib(opened['peak'])}, diff peak {mib(run['peak'])} in {run['wall']:.1f} s"
    )
    return size, opened["peak"], run["peak"], largest


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        small = peak_of_diff(2, Path(tmp))
        large = peak_of_diff(4, Path(tmp))
    size, opened, peak, largest = large
    extra = peak - opened
    print(f"largest tensor: {mib(largest)}")
    print(f"diff peak - opened = {mib(extra)} = {extra / largest:.2f} x largest tensor")
    print(f"peak growth from {small[0]:.2f} GB to {size:.2f} GB: {mib(peak - small[2])}")
    met = goal_line("diff peak - opened <= 3 x largest tensor", [extra / largest], 3.0)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
