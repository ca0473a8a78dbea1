"""A warmed-up interpreter that forks one child per hostile case or fuzz example.

Starting an interpreter, importing torch and the inspector and warming up on genuine
checkpoints takes seconds; forking a process that has done it once takes milliseconds.
The zygote (``python -m tests.hostile.zygote SETUP``) warms up, then serves jobs read as
JSON lines on stdin: for each it forks; the child limits its address space (RLIMIT_AS),
points its stdout and stderr at the job's ``stderr`` file, calls ``run(args, report)`` (a
``module:function`` the zygote imported beforehand) and leaves with ``os._exit``. The child
reports JSON records through a pipe as it goes, so what it said before it crashed or hung
is kept. The zygote kills a child that runs past the job's ``seconds`` and answers with the
records and how the child ended (its exit status, or the signal that killed it). A
segfault, an abort, a hang or a poisoned module therefore costs one child, never the
zygote: every job starts from the same warmed-up state.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ADDRESS_SPACE = 3 << 30
_START_SECONDS = 600  # importing and warming up, on a loaded machine
_ANSWER_SLACK = 30  # beyond a job's own limit before the zygote itself counts as hung


@dataclass
class Ended:
    """How one forked child ended: ``returncode`` (negative: killed by that signal; None:
    unknown, the zygote itself died), whether it was killed for running too long, and the
    records it reported."""

    returncode: int | None
    timed_out: bool
    records: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


class Zygote:
    """The parent's handle. ``run(target, args, stderr, seconds)`` forks a child of the
    zygote that calls ``target`` (``module:function``); a zygote that dies is started again
    (once per call), so one broken job cannot fail the jobs after it."""

    def __init__(self, setup: dict[str, Any], work: Path) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.setup, self.work = setup, work
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self._start()

    def _start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        self.starts += 1
        log = open(self.work / f"zygote-{self.starts}.log", "w")  # noqa: SIM115  (kept by Popen)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.hostile.zygote", json.dumps(self.setup)],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        log.close()
        ready = self._answer(_START_SECONDS)
        if ready is None or not ready.get("ready"):
            raise RuntimeError(f"the zygote did not start: {self._stop()}")

    def _answer(self, seconds: float) -> dict[str, Any] | None:
        stdout = self.process.stdout
        readable, _, _ = select.select([stdout], [], [], seconds)
        line = stdout.readline() if readable else ""
        return json.loads(line) if line else None

    def _stop(self) -> str:
        process, self.process = self.process, None
        if process.poll() is None:
            process.kill()
        process.wait()
        log = self.work / f"zygote-{self.starts}.log"
        tail = log.read_text(errors="replace").strip().splitlines()[-8:] if log.exists() else []
        return f"exit status {process.returncode}: {' | '.join(tail)}"

    def run(self, target: str, args: Any, stderr: Path, seconds: float) -> Ended:
        if self.process is None or self.process.poll() is not None:
            self._start()
        job = {"target": target, "args": args, "stderr": str(stderr), "seconds": seconds}
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        answer = self._answer(seconds + _ANSWER_SLACK)
        if answer is None:
            why = self._stop()
            with open(stderr, "a") as f:
                f.write(f"\nthe zygote died or hung ({why})\n")
            return Ended(None, False)
        return Ended(
            answer["returncode"], answer["timed_out"], answer["records"], answer["seconds"]
        )

    def close(self) -> None:
        if self.process is not None:
            self.process.stdin.close()
            self.process.wait(timeout=60)
            self.process = None


# --- the zygote ------------------------------------------------------------------------------


def _resolve(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


class _Reporter:
    """The child's end of the pipe: one JSON line per record, written at once."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __call__(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, default=repr) + "\n").encode()
        while data:
            data = data[os.write(self.fd, data) :]


def _child(job: dict[str, Any], write_end: int) -> None:
    """In the forked child: never returns."""
    import resource

    code = 0
    try:
        out = os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, hard))
        _resolve(job["target"])(job["args"], _Reporter(write_end))
    except BaseException:  # whatever happens, the child leaves here and says why
        import traceback

        traceback.print_exc()
        code = 70
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no interpreter teardown: damaged objects must not crash it later


def _collect(pid: int, read_end: int, seconds: float) -> tuple[int, bool, bytes]:
    """Read the child's pipe until it closes, killing the child past ``seconds``; its
    status (``waitstatus_to_exitcode``), whether it was killed, and what it wrote."""
    deadline = time.monotonic() + seconds
    chunks, timed_out = [], False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            break
        readable, _, _ = select.select([read_end], [], [], left)
        if readable:
            data = os.read(read_end, 1 << 16)
            if not data:
                break
            chunks.append(data)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), timed_out, b"".join(chunks)


def _records(data: bytes) -> list[dict[str, Any]]:
    found = []
    for line in data.decode(errors="replace").splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:  # the last line of a child killed while writing it
            break
    return found


def _serve(setup: dict[str, Any]) -> None:
    import faulthandler

    faulthandler.enable()
    _resolve(setup["prepare"])(setup)
    if threading.active_count() != 1:  # a thread would be missing in every child
        raise RuntimeError(f"threads still running before forking: {threading.enumerate()}")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        _resolve(job["target"])  # imported here, never for the first time in a child
        read_end, write_end = os.pipe()
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            _child(job, write_end)
        os.close(write_end)
        try:
            returncode, timed_out, data = _collect(pid, read_end, job["seconds"])
        finally:
            os.close(read_end)
        answer = {
            "returncode": returncode,
            "timed_out": timed_out,
            "records": _records(data),
            "seconds": time.perf_counter() - start,
        }
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
