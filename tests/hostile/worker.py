"""A long-lived child interpreter that explores one file after another for the structure
fuzzer: a mutant that segfaults, aborts or hangs kills only the worker (the example fails,
a fresh worker takes the next one), and module state poisoned by one example is caught
before the next (the stand-ins' fingerprint is compared after each).

Protocol: one JSON line per request on stdin (``{"path": ..., "work": ...}``), one per
answer on stdout (``{"outcome": ..., "problem": ...}``).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.hostile import isolated

EXAMPLE_SECONDS = 20  # the worker's own watchdog: past this it dumps its stack and exits
_START_SECONDS = 300


class Worker:
    """The parent's handle: ``explore(path, work)`` returns ``(outcome, problem)``; a problem
    is None when the promise held."""

    def __init__(self, warm: list[Path], work: Path) -> None:
        self.setup = json.dumps({"warm": [str(p) for p in warm], "work": str(work)})
        self.process: subprocess.Popen | None = None
        self._start()  # now: an example's time must not include starting the interpreter

    def _start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(isolated.REPO), "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.hostile.worker", self.setup],
            cwd=isolated.REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        ready = self._answer(_START_SECONDS)
        if ready is None or ready.get("outcome") != "ready":
            raise RuntimeError(f"fuzz worker did not start: {self._death()}")

    def _answer(self, seconds: float) -> dict[str, Any] | None:
        stdout = self.process.stdout
        readable, _, _ = select.select([stdout], [], [], seconds)
        line = stdout.readline() if readable else ""
        return json.loads(line) if line else None

    def _death(self) -> str:
        """Stop the worker; how it ended and the end of what it printed."""
        process, self.process = self.process, None
        if process.poll() is None:
            process.kill()
        process.wait()
        tail = " | ".join(process.stderr.read().strip().splitlines()[-8:])
        code = process.returncode
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        return f"{how}: {tail}"

    def explore(self, path: Path, work: Path) -> tuple[str, str | None]:
        self.process.stdin.write(json.dumps({"path": str(path), "work": str(work)}) + "\n")
        self.process.stdin.flush()
        answer = self._answer(EXAMPLE_SECONDS + 10)
        if answer is None:
            why = self._death()
            self._start()  # now, so the next example's time is its own
            return "died", f"the worker died or hung ({why})"
        if (answer["problem"] or "").startswith("poisoned"):
            self._death()  # it leaves after a poisoned example
            self._start()
        return answer["outcome"], answer["problem"]

    def close(self) -> None:
        if self.process is not None:
            self.process.stdin.close()
            self.process.wait(timeout=30)
            self.process = None


def _explore(path: str, work: Path, baseline: dict[str, str]) -> tuple[str, str | None]:
    """Open, list, tree, scan and read everything under the guard; the outcome and the
    first broken promise (None if none)."""
    import inspector
    from inspector.errors import InspectorError
    from tests.hostile.guard import guarded

    Path("/proc/self/clear_refs").write_text("5")
    resident = isolated._status_kb("VmRSS")
    outcome, problem = "read in full", None
    try:
        with guarded(work):
            ck = inspector.open(path)
            ck.table()
            for view in ("stored", "flattened", "prefixed"):
                isolated._walk_tree(ck, view)
            ck.scan(progress=False)
            for entry in ck.entries()[: isolated.MAX_KEYS]:
                try:
                    if entry.kind == "tensor":
                        isolated._read_checked(ck, entry.key)
                    else:
                        repr(ck.read_object(entry.key))
                except InspectorError:
                    outcome = "partly readable"
            if len(ck) > isolated.MAX_KEYS:
                problem = f"{len(ck)} keys"
    except InspectorError:
        outcome = "refused"
    except BaseException as exc:  # every other outcome breaks the promise
        problem = f"{isolated._classify(exc)}: {type(exc).__name__}: {str(exc)[:300]}"
        problem += f" (at {isolated.where(exc)})"
    grown = (isolated._status_kb("VmHWM") - resident) * 1024
    if problem is None and grown > isolated.RSS_BYTES:
        problem = f"memory: resident set grew {grown / 2**20:.0f} MiB"
    changed = isolated._changed(baseline, isolated._fingerprint())
    if problem is None and changed:
        problem = f"poisoned: {', '.join(changed)[:300]}"
    return outcome, problem


def _serve(setup: dict[str, Any]) -> None:
    import faulthandler
    import resource

    faulthandler.enable()
    isolated._warm_up(setup["warm"], Path(setup["work"]) / f"warm-{os.getpid()}")
    import tests.hostile.guard  # noqa: F401  (installs the audit hook)

    baseline = isolated._fingerprint()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (isolated.ADDRESS_SPACE, hard))
    print(json.dumps({"outcome": "ready", "problem": None}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        start = time.perf_counter()
        faulthandler.dump_traceback_later(EXAMPLE_SECONDS, exit=True)
        outcome, problem = _explore(request["path"], Path(request["work"]), baseline)
        faulthandler.cancel_dump_traceback_later()
        seconds = time.perf_counter() - start
        print(json.dumps({"outcome": outcome, "problem": problem, "seconds": seconds}), flush=True)
        if problem is not None and problem.startswith("poisoned"):
            break  # a fresh worker for the next example
    os._exit(0)


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
