"""Where a parallel export's shares run: local worker processes, or torchrun ranks.

Both engines give the orchestration (:mod:`.parallel`) the same two steps: ``leader(fn)``
runs ``fn`` once (in the parent; on rank 0) and hands every process its result or its
error; ``run(plan, shares, meter)`` does share *i* in process *i* and returns every task's
:class:`~.shares.Done` everywhere, or raises the first failure (in share order) everywhere,
only after every process stopped writing.

Local workers come from the fork server of :mod:`inspector.processes` (a fork, not a fresh
``import torch``: about 2 s each on a busy 2-core machine); they import the caller's
``__main__`` only when the plan refers to it (a ``rename`` function defined there). They
report each written tensor on a queue, so the parent shows one bar, and stop within a copy
step (64 MiB)
once another worker failed or the parent was interrupted; a worker's death is reported with
its cause (signal, exit code, the OOM killer when the cgroup counted a kill).
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from inspector import processes
from inspector.errors import ExportError, InspectorError
from inspector.exporting.shares import Done, Plan, Task, run_share, seed
from inspector.storage.copy import halting

if TYPE_CHECKING:
    from inspector.exporting.plan import Planned
    from inspector.formats.writing import Item

T = TypeVar("T")


class Meter(Protocol):
    def advance(self, name: str, nbytes: int) -> None: ...


class Engine(Protocol):
    size: int

    def leader(self, fn: Callable[[], T]) -> T: ...

    def run(self, plan: Plan, shares: Sequence[Sequence[Task]], meter: Meter) -> list[Done]: ...

    def close(self) -> None: ...


class Cancelled(InspectorError):
    """A worker stopped because another one failed (never the error reported)."""


# --- local processes ---------------------------------------------------------------------

_events: Any = None  # in a worker: the parent's queue of (name, bytes) written
_abort: Any = None  # in a worker: set by the parent once any worker failed


def _started(events: Any, abort: Any) -> None:
    global _events, _abort
    _events, _abort = events, abort


def _report(item: Item) -> None:
    _events.put((item.name, item.nbytes))
    _check_abort()


def _check_abort() -> None:
    if _abort.is_set():
        raise Cancelled("stopped: another worker failed or the export was interrupted")


def _share(plan: Plan, tasks: Sequence[Task]) -> list[Done]:
    with halting(_check_abort):  # a big tensor's copy stops within a step
        return run_share(plan, tasks, _report)


class Workers:
    """``size`` worker processes from the fork server, started once and reused for every step;
    ``with_main``: they import the caller's ``__main__`` (the plan refers to it)."""

    def __init__(self, size: int, with_main: bool = False) -> None:
        context = processes.context(["torch", "inspector.exporting.shares"], with_main)
        self.size = size
        self._events = context.Queue()
        self._abort = context.Event()
        self._oom_kills = processes.oom_kills()
        self._pool = ProcessPoolExecutor(
            size, mp_context=context, initializer=_started, initargs=(self._events, self._abort)
        )

    def leader(self, fn: Callable[[], T]) -> T:
        return fn()

    def run(self, plan: Plan, shares: Sequence[Sequence[Task]], meter: Meter) -> list[Done]:
        self._abort.clear()
        futures = [self._pool.submit(_share, plan, share) for share in shares if share]
        try:
            while not all(f.done() for f in futures):
                self._drain(meter, timeout=0.1)
                if any(f.done() and f.exception() is not None for f in futures):
                    self._abort.set()
        except BaseException:  # an interrupt: the workers stop before the temps are removed
            self._abort.set()
            concurrent.futures.wait(futures)
            raise
        self._drain(meter, timeout=0.05)  # the last reports may trail the results
        error = _first_error(futures, self._death)
        if error is not None:
            raise error
        return [done for f in futures for done in f.result()]

    def _drain(self, meter: Meter, timeout: float) -> None:
        try:
            name, nbytes = self._events.get(timeout=timeout)
            meter.advance(name, nbytes)
            while True:
                name, nbytes = self._events.get_nowait()
                meter.advance(name, nbytes)
        except queue.Empty:
            pass

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._events.close()

    def _death(self) -> str:
        return processes.death_cause(self._pool, self._oom_kills)


def _first_error(futures: list[Future], death: Callable[[], str]) -> BaseException | None:
    """The first real failure (a cancelled worker's is only its echo); a dead worker is
    reported with ``death()``, its cause."""
    errors = [f.exception() for f in futures if f.exception() is not None]
    for error in errors:
        if isinstance(error, BrokenProcessPool):
            return ExportError(f"a worker process died: {death()}")
    real = [e for e in errors if not isinstance(e, Cancelled)]
    return real[0] if real else (errors[0] if errors else None)


# --- torchrun ranks -------------------------------------------------------------------------


def distributed_world() -> int:
    """WORLD_SIZE from torchrun's environment (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class Ranks:
    """This process as one rank of a gloo process group (made from torchrun's environment
    unless one exists): every rank runs the same export and does its own share."""

    def __init__(self, planned: Sequence[Planned] | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._owned = not dist.is_initialized()
        if self._owned:
            dist.init_process_group("gloo")
        self.size, self.rank = dist.get_world_size(), dist.get_rank()
        self._planned = planned

    def leader(self, fn: Callable[[], T]) -> T:
        outcome: list[Any] = [None]
        if self.rank == 0:
            try:
                outcome = [(True, fn())]
            except BaseException as exc:
                outcome = [(False, _sendable(exc))]
                self._dist.broadcast_object_list(outcome, src=0)
                raise
        self._dist.broadcast_object_list(outcome, src=0)
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def run(self, plan: Plan, shares: Sequence[Sequence[Task]], meter: Meter) -> list[Done]:
        if self._planned is not None:
            seed(plan, self._planned)
        mine = shares[self.rank] if self.rank < len(shares) else []
        try:
            outcome: tuple[bool, Any] = (True, run_share(plan, mine, _local(meter)))
        except BaseException as exc:
            outcome = (False, _sendable(exc))
        gathered: list[Any] = [None] * self.size
        self._dist.all_gather_object(gathered, outcome)
        for rank, (ok, value) in enumerate(gathered):
            if not ok:
                raise value if rank == self.rank or not isinstance(value, InspectorError) else (
                    _from_rank(value, rank)
                )
        for rank, (_, done) in enumerate(gathered):  # the others' bytes, once they are written
            if rank != self.rank:
                meter.advance(f"rank {rank}", sum(d.task.nbytes for d in done))
        return [d for _, done in gathered for d in done]

    def close(self) -> None:
        if self._owned and self._dist.is_initialized():
            self._dist.destroy_process_group()


def _local(meter: Meter) -> Callable[[Item], None]:
    return lambda item: meter.advance(item.name, item.nbytes)


def _sendable(exc: BaseException) -> InspectorError:
    """An error every rank can unpickle and that still says what and where."""
    if isinstance(exc, InspectorError):
        return exc
    return ExportError(f"{type(exc).__name__}: {exc}")


def _from_rank(error: InspectorError, rank: int) -> InspectorError:
    """``error`` as another rank raised it: the same type, file and key, saying which rank."""
    copy = type(error).__new__(type(error))
    copy.__dict__.update(error.__dict__)
    copy.args = (f"rank {rank}: {error.args[0] if error.args else error.reason}",)
    return copy
