"""Exploring one file after another for the structure fuzzer, each in a child forked from a
warmed-up zygote (tests/hostile/zygote.py): a mutant that segfaults, aborts, hangs or
poisons module state costs only its own child (the example fails; the next one starts
from the zygote's clean state), and no example's time includes starting an interpreter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.hostile import isolated
from tests.hostile.zygote import Zygote

EXAMPLE_SECONDS = 20  # the child's own watchdog: past this it dumps its stack and exits
_KILL_SECONDS = EXAMPLE_SECONDS + 10  # the zygote's, should the watchdog fail too
_baseline: dict[str, str] = {}  # the stand-ins' fingerprint, taken once by the zygote


class Worker:
    """The parent's handle: ``explore(path, work)`` returns ``(outcome, problem)``; a problem
    is None when the promise held."""

    def __init__(self, warm: list[Path], work: Path) -> None:
        setup = {"prepare": "tests.hostile.worker:prepare", "warm": [str(p) for p in warm]}
        self.zygote = Zygote({**setup, "work": str(work / "warm")}, work)
        self.stderr = work / "example.stderr"

    def explore(self, path: Path, work: Path) -> tuple[str, str | None]:
        self.stderr.unlink(missing_ok=True)
        args = {"path": str(path), "work": str(work)}
        ended = self.zygote.run("tests.hostile.worker:example", args, self.stderr, _KILL_SECONDS)
        if ended.records and ended.returncode == 0:
            answer = ended.records[-1]
            return answer["outcome"], answer["problem"]
        text = self.stderr.read_text(errors="replace") if self.stderr.exists() else ""
        tail = " | ".join(text.strip().splitlines()[-8:])
        code = ended.returncode
        how = "killed" if ended.timed_out else f"signal {-code}" if code and code < 0 else code
        return "died", f"the child died or hung ({how}): {tail}"

    def close(self) -> None:
        self.zygote.close()


def prepare(setup: dict[str, Any]) -> None:
    """The zygote's warm-up: as the isolated runner's, then the baseline fingerprint."""
    isolated.prepare(setup)
    _baseline.update(isolated._fingerprint())


def example(args: dict[str, Any], report: Callable[[dict], None]) -> None:
    """In a forked child: explore one file under the watchdog and report the outcome."""
    import faulthandler

    start = time.perf_counter()
    faulthandler.dump_traceback_later(EXAMPLE_SECONDS, exit=True)
    outcome, problem = _explore(args["path"], Path(args["work"]))
    faulthandler.cancel_dump_traceback_later()
    report({"outcome": outcome, "problem": problem, "seconds": time.perf_counter() - start})


def _explore(path: str, work: Path) -> tuple[str, str | None]:
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
    changed = isolated._changed(_baseline, isolated._fingerprint())
    if problem is None and changed:
        problem = f"poisoned: {', '.join(changed)[:300]}"
    return outcome, problem
