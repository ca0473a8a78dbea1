"""An audit-hook guard: inside ``guarded(tmp)`` nothing may run a program, run code compiled
from a string, import a package that was not loaded before, open a file for writing or
delete outside ``tmp``, use ctypes or a socket, or unpickle with pickle's own resolver.

``sys.addaudithook`` cannot be undone, so one hook is installed for the process (when this
module is first imported); it does nothing unless a guarded block is active in the
current thread. A violation raises :class:`GuardViolation` (a BaseException, so no
``except Exception`` in the code under test can swallow it) and is also recorded, so the
block fails on exit even if something caught it.
"""

from __future__ import annotations

import contextvars
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class GuardViolation(BaseException):
    """Something inside a guarded block did what a checkpoint must never make us do."""


# Events that are violations whatever their arguments.
_ALWAYS = frozenset(
    {
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "os.startfile",
        "os.kill",
        "pty.spawn",
        "subprocess.Popen",
        "shutil.rmtree",
        "socket.connect",
        "socket.bind",
        "socket.getaddrinfo",
        "urllib.Request",
        "webbrowser.open",
        "pickle.find_class",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.call_function",
        "ctypes.cdata",
        "ctypes.addressof",
    }
)
# Events that are violations when the path they touch lies outside the guarded folder.
_PATH_EVENTS = {
    "os.remove": 0,
    "os.rmdir": 0,
    "os.rename": 1,
    "os.mkdir": 0,
    "os.symlink": 1,
    "os.link": 1,
    "os.truncate": 0,
    "os.chmod": 0,
    "os.chown": 0,
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_IMPORT_FRAMES = "<frozen importlib._bootstrap"


@dataclass
class _Block:
    root: Path
    roots_loaded: frozenset[str]
    violations: list[str] = field(default_factory=list)


_active: contextvars.ContextVar[_Block | None] = contextvars.ContextVar("guard", default=None)


def _inside(path: Any, root: Path) -> bool:
    if isinstance(path, int):
        return True  # an already open descriptor: its opening was judged
    try:
        real = Path(os.fsdecode(path)).absolute().resolve()
    except (TypeError, ValueError, OSError):
        return False
    return real == root or root in real.parents


def _importing() -> bool:
    """Whether the current code runs as part of an import (module bodies build namedtuples
    and dataclasses from strings)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_IMPORT_FRAMES):
            return True
        frame = frame.f_back
    return False


def _judge(block: _Block, event: str, args: tuple) -> str | None:
    """Why ``event`` is a violation, or None."""
    if event in _ALWAYS:
        return f"{event}{args!r}"
    if event == "open":
        path, _mode, flags = args
        if flags & _WRITE_FLAGS and not _inside(path, block.root):
            return f"open for writing outside {block.root}: {path!r}"
        return None
    if event in _PATH_EVENTS:
        path = args[_PATH_EVENTS[event]]
        paths = (args[0], path) if event == "os.rename" else (path,)
        if not all(_inside(p, block.root) for p in paths):
            return f"{event} outside {block.root}: {paths!r}"
        return None
    if event == "import":
        root = str(args[0]).partition(".")[0]
        if root not in block.roots_loaded:
            return f"import of a package not loaded before: {args[0]!r}"
        return None
    if event in ("exec", "compile"):
        filename = args[0].co_filename if event == "exec" else args[1]
        if isinstance(filename, str) and os.path.isfile(filename):
            return None  # a module's own code, being imported
        if not _importing():
            return f"{event} of code from {filename!r}"
    return None


def _hook(event: str, args: tuple) -> None:
    block = _active.get()
    if block is None:
        return
    problem = _judge(block, event, args)
    if problem is not None:
        block.violations.append(problem)
        raise GuardViolation(problem)


sys.addaudithook(_hook)


@contextmanager
def guarded(root: Path) -> Iterator[None]:
    """Fail on any violation (see the module docstring) inside the block; writes may go
    only below ``root``."""
    roots = frozenset(name.partition(".")[0] for name in list(sys.modules))
    block = _Block(Path(root).resolve(), roots)
    token = _active.set(block)
    try:
        yield
    finally:
        _active.reset(token)
        fresh = {n for n in list(sys.modules) if n.partition(".")[0] not in roots}
        if fresh:
            block.violations.append(f"new packages imported: {sorted(fresh)}")
        if block.violations:  # replaces whatever the block raised: a violation comes first
            raise GuardViolation("; ".join(block.violations))
