"""Worker processes started by a fork server that imported torch once (the "forkserver"
context), never forked from the caller: the caller's torch threads and fsspec clients are not
fork-safe, while the server has only imported modules. Starting a worker costs a fork, not a
fresh ``import torch``. A worker does not import the caller's ``__main__`` (multiprocessing
would re-run a script's top level in it) unless asked to (what it runs refers to it).
Shared by the parallel export and parallel analyses (health)."""

from __future__ import annotations

import contextlib
import multiprocessing
import sys
import types
from collections.abc import Iterator, Sequence
from multiprocessing import context as mp_context
from multiprocessing import popen_forkserver
from typing import Any


def context(preload: Sequence[str], with_main: bool = False) -> mp_context.BaseContext:
    """The fork server's context, its server importing ``preload`` (when it starts now);
    ``with_main``: its processes import the caller's ``__main__``."""
    server = multiprocessing.get_context("forkserver")
    server.set_forkserver_preload(list(preload))
    return server if with_main else _ContextWithoutMain()


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
