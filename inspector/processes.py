"""Worker processes started by a fork server that imported torch once (the "forkserver"
context), never forked from the caller: the caller's torch threads and fsspec clients are not
fork-safe, while the server has only imported modules. Starting a worker costs a fork, not a
fresh ``import torch``. A worker does not import the caller's ``__main__`` (multiprocessing
would re-run a script's top level in it) unless asked to (what it runs refers to it).
Shared by the parallel export and parallel analyses (health)."""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import sys
import types
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import context as mp_context
from multiprocessing import popen_forkserver
from pathlib import Path
from typing import Any


def context(preload: Sequence[str], with_main: bool = False) -> mp_context.BaseContext:
    """The fork server's context, its server importing ``preload`` (when it starts now);
    ``with_main``: its processes import the caller's ``__main__``."""
    server = multiprocessing.get_context("forkserver")
    server.set_forkserver_preload(list(preload))
    return server if with_main else _ContextWithoutMain()


def death_cause(pool: ProcessPoolExecutor, oom_kills_before: int) -> str:
    """Why a worker of a broken ``pool`` died: its signal or exit code (the SIGTERM the pool
    then sends the others is not the cause when there is another), and the OOM killer only
    when it acted since ``oom_kills_before`` (an :func:`oom_kills` count)."""
    workers = list((getattr(pool, "_processes", None) or {}).values())
    for worker in workers:
        worker.join(1)
    codes = {p.exitcode for p in workers if p.exitcode not in (None, 0)}
    if len(codes) > 1:
        codes.discard(-signal.SIGTERM)
    causes = [_cause(code) for code in sorted(codes)] or ["it ended without an exit status"]
    if oom_kills() > oom_kills_before:
        causes.append("the kernel's OOM killer ended a process: out of memory")
    return "; ".join(causes)


def _cause(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def oom_kills() -> int:
    """The OOM kills counted in this process's cgroup (v2), or 0 where it cannot be read."""
    try:
        for line in Path("/sys/fs/cgroup/memory.events").read_text().splitlines():
            name, _, count = line.partition(" ")
            if name == "oom_kill":
                return int(count)
    except (OSError, ValueError):
        pass
    return 0


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """``__main__`` as a bare module while a worker is launched, so the preparation data
    multiprocessing sends it names no main module to import (and re-run)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class _PopenWithoutMain(popen_forkserver.Popen):
    def _launch(self, process_obj: Any) -> None:
        with _main_hidden():
            super()._launch(process_obj)  # type: ignore[misc]  # typeshed omits it


class _ProcessWithoutMain(mp_context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _PopenWithoutMain(process_obj)


class _ContextWithoutMain(mp_context.ForkServerContext):
    """The fork server's context, whose processes do not import the caller's ``__main__``."""

    Process = _ProcessWithoutMain
