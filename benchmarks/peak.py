"""Run a snippet in a fresh interpreter and report its wall time, peak RSS and whether it
imported torch; and the goal lines every benchmark prints.

Peak RSS is the kernel's VmHWM for the child's own address space (``ru_maxrss`` would
carry over the parent's peak across exec on Linux).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

_WRAPPER = """
import json, re, sys, time
start = time.perf_counter()
marks = [start]
cpu = [time.process_time()]
def imported():
    marks.append(time.perf_counter())
    cpu.append(time.process_time())
exec(compile(sys.argv[1], "<snippet>", "exec"))
end = time.perf_counter()
hwm = re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())
print("@@" + json.dumps({"wall": end - start, "work": end - marks[-1],
                         "cpu": time.process_time() - cpu[-1],
                         "peak": int(hwm.group(1)) * 1024, "torch": "torch" in sys.modules}))
"""


def measure(snippet: str, *args: str, python: str = sys.executable) -> dict[str, float]:
    """``{"wall": s, "work": s, "cpu": s, "peak": bytes, "torch": imported?}`` of ``snippet``
    run by ``python -c`` (imports included in "wall"; "work" counts from the snippet's last
    call of ``imported()``, or equals "wall"; "cpu": the process's CPU seconds, all its
    threads, user + system, over the same span as "work"). The snippet sees ``args`` as
    ``sys.argv[2:]``; ``python``: another interpreter (a producer's virtualenv)."""
    done = subprocess.run(
        [python, "-c", _WRAPPER, snippet, *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-4000:])
    line = next(line for line in done.stdout.splitlines() if line.startswith("@@"))
    return json.loads(line[2:])


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def spread(values: list[float], digits: int = 2) -> str:
    """``low-high`` of the values (one value alone when they agree to ``digits``)."""
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}-{high}"


def goal_line(what: str, values: list[float], limit: float, *, every: bool = False) -> bool:
    """Print ``what``, the values' median and range, and PASS / MISS: the median (or, with
    ``every``, every value) at most ``limit``. Returns whether it passed."""
    judged = max(values) if every else statistics.median(values)
    passed = judged <= limit
    rule = "every run" if every else "median"
    print(
        f"goal {what}: {rule} {judged:.2f} (range {spread(values)}, {len(values)} runs) "
        f"{'PASS' if passed else 'MISS'}"
    )
    return passed
